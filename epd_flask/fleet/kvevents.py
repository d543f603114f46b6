"""The KV-event readers of one worker: a ZMQ subscriber per instance whose roster entry names
a ``kv_events`` endpoint, each feeding that instance's ``CachePicture``
(docs/behaviour.md#routing-policies).

vLLM binds a PUB socket that any number of subscribers connect to, so every worker of every
host subscribes for itself and builds its own picture, with no coordination. The set of
readers follows the registry: an instance added gets one, an instance removed or evicted
loses its reader and its picture (its cache is unknown until it is back), and an instance
that stays keeps both across roster changes. Nothing here can fail a request: a dead
endpoint, garbage on the socket or lost messages give one warning, a metric and a picture
routing ignores or trusts less, and ``kv_aware`` falls back to the prefix policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import gevent
import zmq
import zmq.green as zmq_green
from zmq.utils.monitor import recv_monitor_message

from epd_flask.core import events
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.kvcache import (
    MAX_BLOCKS,
    CachePicture,
    MalformedEvents,
    Removed,
    Stored,
    decode_batch,
    sequence_number,
)
from epd_flask.fleet.registry import Registry

logger = logging.getLogger(__name__)

#: How soon a roster change or an eviction reaches the readers.
SYNC_INTERVAL = 1.0
#: Metric kinds (the ``kind`` label of ``epd_kv_events_total``).
KINDS = ("stored", "removed", "cleared", "malformed", "gap")
_MONITORED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
              | zmq.EVENT_CLOSED)


class Reader:
    """One subscriber: its socket, its greenlet and the picture it keeps."""

    def __init__(self, url: str, endpoint: str, context: zmq_green.Context,
                 max_blocks: int = MAX_BLOCKS) -> None:
        self.url = url
        self.endpoint = endpoint
        self.picture = CachePicture(max_blocks)
        self._context = context
        self._greenlet: gevent.Greenlet | None = None
        self._last_seq: int | None = None
        self.connected = False
        self._warned_down = False
        self._warned_garbage = False

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(_MONITORED)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.endpoint)
            poller = zmq_green.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(poller.poll())
                if monitor in ready:
                    self.on_monitor(recv_monitor_message(monitor)["event"])
                if sub in ready:
                    self.on_message(sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def on_monitor(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            if self._warned_down:
                logger.info("KV events of %s: %s answers again", self.url, self.endpoint)
            self._warned_down = False
        elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
            if self.connected:
                # Whatever happened while we were away is unknown: start again.
                self.picture.clear()
                self._last_seq = None
            self.connected = False
            if not self._warned_down:
                self._warned_down = True
                logger.warning("KV events of %s: %s is not reachable; kv_aware routes by "
                               "prefix for this instance until it is", self.url, self.endpoint)

    def on_message(self, frames: list[bytes]) -> None:
        """One message: decode, count, check the sequence, apply; garbage is counted and
        warned about once per endpoint, never raised."""
        try:
            if len(frames) != 3:
                raise MalformedEvents(f"{len(frames)} frames, not 3 (topic, sequence, payload)")
            seq = sequence_number(frames[1])
            batch = decode_batch(frames[2])
        except MalformedEvents as exc:
            events.kv_events.fire(self.url, "malformed", 1)
            if not self._warned_garbage:
                self._warned_garbage = True
                logger.warning("KV events of %s: %s sent a message that is not vLLM's KV-event "
                               "format (%s); such messages are counted and skipped", self.url,
                               self.endpoint, exc)
            return
        if self._last_seq is not None and seq != self._last_seq + 1:
            events.kv_events.fire(self.url, "gap", 1)
            if seq <= self._last_seq:
                # The publisher started again (a restarted engine counts from 0): its
                # cache is new, and its hashes are seeded anew.
                self.picture.clear()
        self._last_seq = seq
        self.picture.apply(batch)
        counts = {"stored": 0, "removed": 0, "cleared": 0}
        for event in batch:
            kind = ("stored" if isinstance(event, Stored) else
                    "removed" if isinstance(event, Removed) else "cleared")
            counts[kind] += 1
        for kind, n in counts.items():
            if n:
                events.kv_events.fire(self.url, kind, n)


class KVEvents:
    """This worker's readers, by instance URL, following the registry."""

    def __init__(self, registry: Registry,
                 context: Callable[[], zmq_green.Context] = zmq_green.Context.instance,
                 max_blocks: int = MAX_BLOCKS) -> None:
        self.registry = registry
        self.max_blocks = max_blocks
        self._context = context
        self.readers: dict[str, Reader] = {}
        self._loop = Periodic("KV event readers", self.sync, lambda: SYNC_INTERVAL)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        for reader in self.readers.values():
            reader.stop()
        self.readers.clear()

    def sync(self) -> None:
        """A reader for every live instance with an endpoint; none for any other."""
        wanted = {s.instance.url: s.instance.kv_events for s in self.registry.states()
                  if s.live and s.instance.kv_events}
        for url, reader in list(self.readers.items()):
            if wanted.get(url) != reader.endpoint:
                reader.stop()
                del self.readers[url]
        for url, endpoint in wanted.items():
            if url not in self.readers and endpoint:
                reader = self.readers[url] = Reader(url, endpoint, self._context(),
                                                    self.max_blocks)
                reader.start()

    def picture(self, url: str) -> CachePicture | None:
        """``url``'s picture when it is worth routing by: a reader is on it and it has
        heard at least one store (so it knows the block size)."""
        reader = self.readers.get(url)
        if reader is None or not reader.picture.ready:
            return None
        return reader.picture
