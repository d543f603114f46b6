"""The KV-event readers of a host: a ZMQ subscriber per instance whose roster entry names a
``kv_events`` endpoint, each feeding that instance's ``CachePicture``
(docs/behaviour.md#routing-policies).

vLLM binds a PUB socket that any number of subscribers connect to, so every host subscribes
for itself and builds its own pictures, with no coordination. Within a host one worker reads
and its siblings follow its pictures (fleet/kvrelay.py); without a state directory to meet
in, every worker reads. The set of readers follows the registry: an instance added gets
one, an instance removed or evicted loses its reader and its picture (its cache is unknown
until it is back), and an instance that stays keeps both across roster changes. Nothing
here can fail a request: a dead endpoint, garbage on the socket, a publisher faster than the
reader or a reader that fails gives a warning, a metric and a picture routing ignores or
trusts less, and ``kv_aware`` falls back to the prefix policy.

Every host subscribes to every instance, so one bad publisher reaches a worker of every
host: a reader is bounded in what it holds (ZMQ's queue, a message's size and events)
and in the CPU it takes (a share of a core, in turns of a few milliseconds), and drops what
it cannot read rather than hold the worker. It waits on ZMQ's file descriptor through
gevent's own event loop, never ``select()``, so it works at any descriptor number.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import gevent
import zmq
import zmq.green as zmq_green
from zmq.utils.monitor import recv_monitor_message

from epd_flask.core import cooperate
from epd_flask.core.events import Events
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.kvcache import (
    MAX_BLOCKS,
    CachePicture,
    Changes,
    Cleared,
    MalformedEvents,
    Picture,
    Removed,
    Stored,
    open_batch,
    pieces,
    sequence_number,
)
from epd_flask.fleet.kvrelay import Relay
from epd_flask.fleet.registry import Registry

logger = logging.getLogger(__name__)

#: How soon a roster change or an eviction reaches the readers.
SYNC_INTERVAL = 1.0
#: Metric kinds (the ``kind`` label of ``epd_kv_events_total``).
KINDS = ("stored", "removed", "cleared", "malformed", "gap", "dropped")
#: Messages ZMQ queues for one reader; past them it stops reading the connection and the
#: publisher's own queue drops (the sequence then shows a gap).
QUEUE_MESSAGES = 16
#: The largest frame a reader takes (ZMQ disconnects a publisher that sends more): ~250,000
#: token ids, more than an engine step stores with chunked prefill. With the queue: ~16 MB
#: held at most per reader, and one event decodes in a few milliseconds.
MAX_MESSAGE_BYTES = 1024 * 1024
#: Events one message may carry. vLLM sends one per request stored and one per block evicted
#: in an engine step; a message claiming more is dropped before any is decoded.
MAX_MESSAGE_EVENTS = 32768
#: ZMQ's reconnect interval to an endpoint that does not answer, doubling up to the maximum.
RECONNECT_FIRST_MS = 200
RECONNECT_MAX_MS = 10_000
#: Blocks applied between two looks at the clock.
PIECE_BLOCKS = 256
#: Work one reader does before it hands the event loop back.
TURN_SECONDS = 0.002
#: The share of a core one reader may use over time, and the burst it may take at once.
CPU_SHARE = 0.2
CPU_BURST = 0.2
#: A reader that has found more waiting after every message for this long is behind: it
#: drops what is queued (the publisher's own queue included) until it has caught up.
BEHIND_SECONDS = 1.0
#: How long nothing must come for a drop of the backlog to end.
DRAIN_WAIT = 0.01
#: How long a picture is not trusted after its reader dropped messages.
STALE_SECONDS = 5.0
#: A reader that fails starts again after this, doubling up to RESTART_MAX per failure in a
#: row (a run longer than RESTART_MAX starts the count again).
RESTART_FIRST = 1.0
RESTART_MAX = 60.0
#: How long stopping waits for the readers to close their sockets.
STOP_SECONDS = 1.0
#: Why kv_aware has no picture to compare (the decision's why).
NOEVENTS, STALE = "noevents", "stale"
_MONITORED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
              | zmq.EVENT_CLOSED)
_SOCKET_OPTIONS = ((zmq.LINGER, 0), (zmq.RCVHWM, QUEUE_MESSAGES),
                   (zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES), (zmq.RECONNECT_IVL, RECONNECT_FIRST_MS),
                   (zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS), (zmq.SUBSCRIBE, b""))
_CONTEXT: zmq_green.Context | None = None


def reader_context() -> zmq_green.Context:
    """The readers' own ZMQ context, made on first use (in the worker, after fork). Each
    reader has three sockets (its subscriber, and the two ends of its monitor), and a
    context's default limit is 1,023: this one's is what the process may open."""
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT.closed:
        context = zmq_green.Context()
        context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))
        _CONTEXT = context
    return _CONTEXT


class CPUBudget:
    """A bucket of CPU seconds filled at ``share`` of a core, holding at most ``burst``."""

    def __init__(self, share: float = CPU_SHARE, burst: float = CPU_BURST) -> None:
        self.share = share
        self.burst = burst
        self.level = burst
        self._at = time.monotonic()

    def spend(self, seconds: float) -> float:
        """Take ``seconds``; how long to pause until the bucket is no longer empty."""
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self._at) * self.share) - seconds
        self._at = now
        return 0.0 if self.level >= 0 else -self.level / self.share


class Reader:
    """One subscriber: its greenlet (started again when it fails), its sockets and the
    picture it keeps."""

    def __init__(self, url: str, endpoint: str, context: zmq_green.Context,
                 max_blocks: int = MAX_BLOCKS, events: Events | None = None) -> None:
        self.url = url
        self.events = events if events is not None else Events()
        self.endpoint = endpoint
        self.picture = CachePicture(max_blocks)
        self.connected = False
        self.failures = 0
        #: Connection attempts ZMQ made after the first failed (it backs off between them).
        self.retries = 0
        self.budget = CPUBudget()
        self._context = context
        self._greenlet: gevent.Greenlet | None = None
        self._last_seq: int | None = None
        self._stale_until = 0.0
        self._caught_up = time.monotonic()
        self._warned_down = False
        self._warned_garbage = False
        #: Told after each message applied (the host's relay sends what changed).
        self.on_change: Callable[[str, Reader], None] | None = None

    @property
    def stale(self) -> bool:
        """It dropped messages lately: what it missed may contradict its picture."""
        return time.monotonic() < self._stale_until

    @property
    def trusted(self) -> bool:
        """Its picture is worth routing by: it is connected, heard a store (so it knows the
        block size) and has dropped nothing lately."""
        return self.connected and self.picture.ready and not self.stale

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._supervise)

    def stop(self) -> gevent.Greenlet | None:
        """Stop reading; the greenlet to wait for, if one ran."""
        greenlet, self._greenlet = self._greenlet, None
        if greenlet is not None:
            greenlet.kill(block=False)
        return greenlet

    def _supervise(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self._read()
            except Exception as exc:  # a reader must outlive anything: it starts again
                if time.monotonic() - started > RESTART_MAX:
                    self.failures = 0
                self.failures += 1
                delay = min(RESTART_MAX, RESTART_FIRST * 2 ** (self.failures - 1))
                logger.warning("KV events of %s: the reader of %s failed (%s: %s); it starts "
                               "again in %.0f s, and kv_aware routes by prefix for this "
                               "instance until it has", self.url, self.endpoint,
                               type(exc).__name__, exc, delay, exc_info=True)
            else:
                delay = RESTART_FIRST
            self._forget()
            gevent.sleep(delay)

    def _forget(self) -> None:
        """What happens while nobody listens is unknown: start again from nothing."""
        self.picture.clear()
        self._last_seq = None
        self.connected = False

    def _read(self) -> None:
        sub = self._context.socket(zmq.SUB)
        monitor: zmq_green.Socket | None = None
        watcher: gevent.Greenlet | None = None
        try:
            for option, value in _SOCKET_OPTIONS:
                sub.setsockopt(option, value)
            monitor = sub.get_monitor_socket(_MONITORED)
            watcher = gevent.spawn(self._watch, monitor)
            watcher.link_exception(self._watcher_failed)
            sub.connect(self.endpoint)
            while True:
                idle = not sub.getsockopt(zmq.EVENTS) & zmq.POLLIN
                frames, extra = self._receive(sub)
                if idle:  # behind is counted from the first message after a wait, not the wait
                    self._caught_up = time.monotonic()
                self._take(frames, extra)
                if self.on_change is not None:
                    self.on_change(self.url, self)
                if not sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._caught_up = time.monotonic()
                elif time.monotonic() - self._caught_up > BEHIND_SECONDS:
                    self._drop_backlog(sub)
                cooperate.yield_now()
        finally:
            if watcher is not None:
                watcher.unlink(self._watcher_failed)
                watcher.kill(block=False)
            # Closing must not raise: it runs when the reader is stopped too, and an error
            # here would replace the stop with a failure (and a restart).
            with contextlib.suppress(zmq.ZMQError):
                if monitor is not None:
                    sub.disable_monitor()
                    monitor.close(linger=0)
                sub.close(linger=0)

    def _watch(self, monitor: zmq_green.Socket) -> None:
        while True:
            self.on_monitor(recv_monitor_message(monitor)["event"])

    def _watcher_failed(self, watcher: gevent.Greenlet) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(watcher.exception, block=False)

    @staticmethod
    def _receive(sub: zmq_green.Socket) -> tuple[list[bytes], int]:
        """The next message's first three frames (waiting for it) and how many more it had,
        read and let go one at a time: a message of a million frames holds no list."""
        frames = [sub.recv()]
        extra = 0
        while sub.getsockopt(zmq.RCVMORE):
            frame = sub.recv(zmq.NOBLOCK)  # a message's frames arrive together
            if len(frames) < 3:
                frames.append(frame)
            else:
                extra += 1
                if extra % 1024 == 0:
                    cooperate.yield_now()
        return frames, extra

    def on_monitor(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            if self._warned_down:
                logger.info("KV events of %s: %s answers again", self.url, self.endpoint)
            self._warned_down = False
        elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
            self.retries += event == zmq.EVENT_CONNECT_RETRIED
            if self.connected:
                # Whatever happened while we were away is unknown: start again.
                self._forget()
            self.connected = False
            if not self._warned_down:
                self._warned_down = True
                logger.warning("KV events of %s: %s is not reachable (or sent a frame over "
                               "%d bytes); kv_aware routes by prefix for this instance until "
                               "it is", self.url, self.endpoint, MAX_MESSAGE_BYTES)

    def _malformed(self, why: object) -> None:
        self.events.kv_events.fire(self.url, "malformed", 1)
        if not self._warned_garbage:
            self._warned_garbage = True
            logger.warning("KV events of %s: %s sent a message that is not vLLM's KV-event "
                           "format (%s); such messages are counted and skipped", self.url,
                           self.endpoint, why)

    def _dropped(self, count: int, why: str) -> None:
        self.events.kv_events.fire(self.url, "dropped", count)
        if not self.stale:
            logger.warning("KV events of %s: %s; dropped %d message(s), and kv_aware routes by "
                           "prefix for this instance until its reader has kept up for %.0f s",
                           self.url, why, count, STALE_SECONDS)
        self._stale_until = time.monotonic() + STALE_SECONDS

    def _take(self, frames: list[bytes], extra: int) -> None:
        """One message: check, count, apply, handing the event loop back every
        ``TURN_SECONDS`` and pausing when this reader's CPU budget is spent (garbage costs
        budget too). Garbage is counted and warned about once per endpoint, never raised; a
        malformed event ends its message, the events before it applied."""
        turn = _Turn(self)
        try:
            self._apply(frames, extra, turn)
        finally:
            turn.rest(yielding=False)

    def _apply(self, frames: list[bytes], extra: int, turn: _Turn) -> None:
        if extra or len(frames) != 3:
            self._malformed(f"{len(frames) + extra} frames, not 3 (topic, sequence, payload)")
            return
        try:
            seq = sequence_number(frames[1])
            count, batch = open_batch(frames[2])
        except MalformedEvents as exc:
            self._malformed(exc)
            return
        if count > MAX_MESSAGE_EVENTS:
            self._dropped(1, f"a message of {count} events (more than {MAX_MESSAGE_EVENTS})")
            return
        self._sequence(seq)
        counts = dict.fromkeys(_KIND, 0)
        picture = self.picture
        try:
            for event in batch:
                kind = type(event)
                if kind is Removed and len(event.block_hashes) <= PIECE_BLOCKS:
                    picture.remove(event.block_hashes)  # one per evicted block: kept short
                    turn.check()
                else:
                    for piece in pieces(event, PIECE_BLOCKS):
                        picture.apply((piece,))
                        turn.check()
                counts[kind] += 1
        except MalformedEvents as exc:
            self._malformed(exc)
        finally:
            for kind, n in counts.items():
                if n:
                    self.events.kv_events.fire(self.url, _KIND[kind], n)

    def _sequence(self, seq: int) -> None:
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.events.kv_events.fire(self.url, "gap", 1)
            if seq <= self._last_seq:
                # The publisher started again (a restarted engine counts from 0): its
                # cache is new, and its hashes are seeded anew.
                self.picture.clear()
        self._last_seq = seq

    def _drop_backlog(self, sub: zmq_green.Socket) -> None:
        """Let every message queued go unread (counted), however many the publisher has
        queued for us, then go on from the present; the picture is stale for a while. Draining
        costs a fraction of reading, and is paced and budgeted like it."""
        turn = _Turn(self)
        dropped = 0
        waited = False
        try:
            while True:
                try:
                    sub.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    # ZMQ refills the queue from the connection as we empty it: done only
                    # when nothing more came for a moment.
                    if waited:
                        break
                    waited = True
                    turn.rest(yielding=False)
                    gevent.sleep(DRAIN_WAIT)
                    turn = _Turn(self)
                    continue
                waited = False
                if not sub.getsockopt(zmq.RCVMORE):
                    dropped += 1
                    if dropped % 1024 == 0:
                        self._dropped(1024, self._why_behind())
                turn.check()
        finally:
            turn.rest(yielding=False)
            if dropped % 1024:
                self._dropped(dropped % 1024, self._why_behind())
        self._last_seq = None  # the messages we let go are not a gap of the publisher's
        self._caught_up = time.monotonic()

    def _why_behind(self) -> str:
        return (f"{self.endpoint} sends more than this worker reads ({CPU_SHARE:.0%} of a "
                f"core at most)")


_KIND = {Stored: "stored", Removed: "removed", Cleared: "cleared"}


class _Turn:
    """One reader's stretch of work between two hand-backs of the event loop; its CPU time
    is taken from the reader's budget."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self._begin()

    def _begin(self) -> None:
        self.deadline = time.perf_counter() + TURN_SECONDS
        self.cpu = time.thread_time()

    def check(self) -> None:
        if time.perf_counter() >= self.deadline:
            self.rest(yielding=True)
            self._begin()

    def rest(self, yielding: bool) -> None:
        """Spend the turn's CPU; pause while the budget is empty, else hand the loop back if
        ``yielding``."""
        pause = self.reader.budget.spend(time.thread_time() - self.cpu)
        if pause:
            gevent.sleep(pause)
        elif yielding:
            cooperate.yield_now()


class KVEvents:
    """This worker's readers, by instance URL, following the registry; or, with a state
    directory (``state_dir``) whose lock a sibling holds, that sibling's pictures."""

    def __init__(self, registry: Registry,
                 context: Callable[[], zmq_green.Context] = reader_context,
                 max_blocks: int = MAX_BLOCKS, events: Events | None = None,
                 state_dir: str | Path | None = None) -> None:
        self.registry = registry
        self.events = events if events is not None else Events()
        self.max_blocks = max_blocks
        self._context = context
        self.readers: dict[str, Reader] = {}
        self.relay = Relay.for_state_dir(state_dir, context, lambda: self.readers)
        self._loop = Periodic("KV event readers", self.sync, lambda: SYNC_INTERVAL)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        """Stop every reader and wait (briefly) until their sockets are closed."""
        self._loop.stop()
        stopping = [g for g in (r.stop() for r in self.readers.values()) if g is not None]
        self.readers.clear()
        if self.relay is not None:
            stopping += self.relay.close()
        gevent.joinall(stopping, timeout=STOP_SECONDS)

    @property
    def following(self) -> bool:
        """A sibling reads for this worker's host."""
        return self.relay is not None and not self.relay.leading

    def sync(self) -> None:
        """Read for the host if no sibling does (else follow the one that does): a reader for
        every live instance with an endpoint; none for any other. A host whose instances
        publish no events takes no lock and opens no socket."""
        wanted = {s.instance.url: s.instance.kv_events for s in self.registry.states()
                  if s.live and s.instance.kv_events}
        if self.relay is not None and (wanted or self.relay.active) and not self._lead():
            self.relay.follow()
            return
        for url, reader in list(self.readers.items()):
            if wanted.get(url) != reader.endpoint:
                reader.stop()
                del self.readers[url]
        for url, endpoint in wanted.items():
            if url not in self.readers and endpoint:
                reader = self.readers[url] = Reader(url, endpoint, self._context(),
                                                    self.max_blocks, self.events)
                if self.relay is not None:
                    # Starting with a clear: a sibling may hold what an earlier reader of
                    # this instance saw.
                    reader.picture.changes = Changes(cleared=True)
                    reader.on_change = self.relay.send
                reader.start()

    def _lead(self) -> bool:
        """Whether this worker reads for its host, taking the relay's lock if it is free. A
        relay that cannot be set up is given up: every worker then reads for itself."""
        assert self.relay is not None
        try:
            return self.relay.lead()
        except (OSError, zmq.ZMQError) as exc:
            logger.warning("KV relay: cannot share this host's KV pictures through %s (%s); "
                           "this worker reads the KV events itself", self.relay.where, exc)
            self.relay.close()
            self.relay = None
            return True

    def picture(self, url: str) -> Picture | None:
        """``url``'s picture when it is worth routing by (``Reader.trusted``, as the reading
        worker says when a sibling reads)."""
        if self.relay is not None and self.relay.follower is not None:
            return self.relay.follower.picture(url)
        reader = self.readers.get(url)
        if reader is None or not reader.trusted:
            return None
        return reader.picture

    def missing(self, urls: Sequence[str]) -> str:
        """Why none of these instances has a picture to route by: ``stale`` when a reader
        dropped messages lately, else ``noevents``."""
        follower = self.relay.follower if self.relay is not None else None
        if follower is not None:
            return STALE if any(follower.stale(url) for url in urls) else NOEVENTS
        if any(r is not None and r.picture.ready and r.stale
               for r in (self.readers.get(url) for url in urls)):
            return STALE
        return NOEVENTS
