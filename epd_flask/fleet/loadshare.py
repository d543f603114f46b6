"""Every proxy host's open calls per instance, shared through Redis (the roster's
``load_store``), so routing on one host counts the other hosts' calls as it counts its own,
each by its estimated prompt tokens, instead of as the engines' counts of requests
(docs/behaviour.md#routing-policies 2).

Off the request path: one worker per host runs one exchange every ``INTERVAL`` seconds in a
greenlet of its own, one round trip (a Lua script): it sends the host's counts (the load
board's sum over the host's workers) when they changed since it last sent them or
``HEARTBEAT`` seconds passed, and gets every other host's back. A host's key expires ``TTL``
seconds after its last write, so a host that dies stops counting within it. Routing reads the
last snapshot (``counts``), never Redis. A snapshot older than ``STALE`` counts for nothing,
and neither does a store that does not answer: routing is then as without one, the engines'
queues counting the other hosts (logged once per host; ``events.load_store`` hears whether it
answers).

Which worker exchanges: the one holding an exclusive ``flock`` on ``loadshare.lock`` in the
state directory. Every other worker's loop tries it (non-blocking) every ``TAKEOVER_SECONDS``;
the holder keeps the descriptor open for its life or until it has no store, and the kernel
releases it when the worker dies, so a sibling takes over at its next try: no extra process,
no heartbeat. Every worker of a host used to send the same sum, each its own round trip every
``INTERVAL``, 40 scripts a second per worker where 40 per host carry the same news: on a
2-vCPU VM, two idle hosts of two gunicorn workers spent 15-17 % of a CPU on their exchanges,
7.5-8.5 % with one exchanging worker per host (``/proc/<pid>/schedstat``).

The holder publishes what it got in ``loadshare.bin`` after each exchange, answered or not:
the other hosts' counts per instance (keyed by the first 8 bytes of blake2b of the URL, as the
load board's slots), the time it read them (``time.monotonic``: one clock for the machine's
processes), when it wrote, whether the store answered, and a digest of the store's URL, so a
sibling configured for another store (mid-reload) leaves it alone. It is one file of fixed
size, which the holder alone writes through ``mmap`` under a sequence number (odd while
written, as the load board's layout generation) and its siblings read through ``mmap``: a
sibling looks at the sequence number when routing asks (an 8-byte load, no system call, and
no tick of its own: a wakeup alone costs ~0.2 ms of CPU on that VM) and reads the record only
when it changed; the body's CRC guards a read that raced a write the
sequence number missed. A temporary file replaced at every exchange would cost the holder a
file's creation and rename 40 times a second, each reader a ``stat`` and a read, and would
touch the state directory's time stamp, which makes every worker's load board list the
directory again. A sibling serves ``counts`` from the holder's snapshot exactly as the holder
does (``STALE`` from the holder's read: a holder that stalls counts for nothing after it) and
reports what the holder last saw as ``up`` (at its tries of the lock); only the holder logs
the store going down or coming back.

Between exchanges every worker also tells the other hosts of each call it opens, at once: one
Redis ``PUBLISH`` on ``CLAIMS`` (its host, a space, then the calls and estimated prompt tokens
per instance as an exchange sends them; calls opened while one is under way go out together),
sent by a greenlet of its own so the request never waits for it. Each host's exchanging worker
subscribes and counts a call it hears of for ``CLAIM_SECONDS``, by when the periodic counts
carry it (the claiming host's exchange sends it within ``INTERVAL``, ours reads it within the
next), and publishes it to its siblings' snapshot at once. The exchange alone left a call
unseen by the other hosts for up to two intervals: replaying a bursty trace on 2 hosts, the
hosts sent a burst's requests ~9 ms apart, and 41-58 pairs per 400 requests went to a prefill
both had seen idle (19-35 with the claims, which reach the other host p50 7 ms, p90 35 ms after
the call opened on a busy 2-vCPU machine: docs/benchmarks.md). A claim is a hint, not a count:
lost when the store does not answer, counted twice (the claim and the exchange's counts) for at
most ``CLAIM_SECONDS``, its close never sent (the exchange carries it).

A host is the workers of one gunicorn master: one load board, one state directory. Its key is
the machine's name and a digest of the state directory's path (two masters on one machine have
two directories), or the process id without a state directory (an app that counts its own
calls alone, and exchanges itself, as does a worker that cannot make the two files). The
script reads keys it is not given (the hosts' keys, found in a set): one Redis, not a cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import gevent
import orjson

from epd_flask.control.statedir import (
    SHARE_FILE,
    SHARE_LOCK_FILE,
    close_lock,
    map_shared,
    open_lock,
    try_lock,
)
from epd_flask.core.events import Events
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.loadboard import CALLS, TOKENS, LoadBoard, key_of
from epd_flask.upstream import redisclient
from epd_flask.upstream.redisclient import redacted

logger = logging.getLogger(__name__)

#: Seconds between the exchanges while the store answers; after a failure, the next comes
#: ``RETRY_SECONDS`` later. Without a store the loop looks for one every ``IDLE_SECONDS``.
INTERVAL = 0.025
RETRY_SECONDS = 1.0
IDLE_SECONDS = 1.0
#: A sibling of the exchanging worker tries the lock (and takes the store's state from the
#: snapshot) this often; it reads the counts when routing asks, not on this tick. Each tick
#: wakes the worker, which alone costs ~0.2 ms of CPU on a 2-vCPU VM (a bare 25 ms gevent
#: loop: 0.8 % of a CPU); this keeps a takeover well within ``HEARTBEAT`` and ``STALE``.
TAKEOVER_SECONDS = 0.25
#: Counts that did not change are sent again this often, so the host's key never expires
#: while the host lives.
HEARTBEAT = 0.5
#: A host's key lives this long after its last write.
TTL = 2.0
#: A snapshot this old counts for nothing (the exchanges fail or stall).
STALE = 1.0
#: A snapshot file written longer ago than this is an earlier master's (or the holder stalled):
#: a sibling does not take its word on whether the store answers.
OLD = 10.0
#: The most instances read from one host's counts, and kept in the snapshot; the rest are
#: left out.
MAX_INSTANCES = 4096
PREFIX = "epd-flask:load:"
HOSTS = PREFIX + "hosts"
CLAIMS = PREFIX + "claims"
NONE = (0, 0)
#: A call another host claimed counts this long, by when the exchanges carry it.
CLAIM_SECONDS = 2 * INTERVAL
#: The exchanging worker waits for claims this long per round, then looks again whether it
#: still exchanges.
LISTEN_SECONDS = 0.5
#: Claims that came together are taken in at once, up to this many messages: the snapshot
#: is rebuilt and published once for them, not once each.
LISTEN_BATCH = 256
#: Claims waiting to be sent past this many are dropped (a store too slow for them): the
#: exchange carries the counts.
MAX_OUTBOX = 1024
#: How long closing the store's client waits for the claims' listener to stop.
STOP_SECONDS = 1.0
#: Connections a worker keeps to the store: the exchange, the claims it sends, the claims it
#: hears (a subscription holds its connection).
CONNECTIONS = 3

#: The snapshot file: a head (magic, sequence number: odd while being written), a record
#: (digest of the store's URL, monotonic time of the read, of the write, whether the store
#: answered, slots used, CRC-32 of the slots), then slots (instance key, calls, tokens).
MAGIC = b"EPDSHAR1"
HEAD = struct.Struct("<8sQ")
SEQUENCE = struct.Struct("<Q")
RECORD = struct.Struct("<8sddQQQ")
SLOT = struct.Struct("<Qqq")
BODY = HEAD.size + RECORD.size
SIZE = BODY + MAX_INSTANCES * SLOT.size

#: ARGV: the hosts' key prefix, this host, its counts ("": unchanged, not sent), their TTL in
#: ms. Returns the other hosts' names and counts, alternating; a host whose key expired leaves
#: the set.
SCRIPT = """
local prefix, own = ARGV[1], ARGV[2]
if ARGV[3] ~= '' then
  redis.call('SET', prefix .. own, ARGV[3], 'PX', ARGV[4])
  redis.call('SADD', KEYS[1], own)
end
local out = {}
for _, host in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if host ~= own then
    local counts = redis.call('GET', prefix .. host)
    if counts then
      out[#out + 1] = host
      out[#out + 1] = counts
    else
      redis.call('SREM', KEYS[1], host)
    end
  end
end
return out
"""

Counts = dict[str, tuple[int, int]]


def host_name(state_dir: str | os.PathLike[str] | None) -> str:
    """This proxy host's key: the same in every worker of one master, another for each master."""
    machine = socket.gethostname() or "localhost"
    if not state_dir:
        return f"{machine}:pid{os.getpid()}"
    path = os.path.realpath(state_dir).encode("utf-8", "surrogateescape")
    return f"{machine}:{hashlib.blake2b(path, digest_size=6).hexdigest()}"


def host_counts(board: LoadBoard, urls: Iterable[str]) -> Counts:
    """The calls this host's workers have open on each of ``urls`` and their estimated prompt
    tokens; instances with neither left out."""
    out: Counts = {}
    for url in urls:
        counts = board.counts(url)
        if counts[CALLS] or counts[TOKENS]:
            out[url] = (counts[CALLS], counts[TOKENS])
    return out


def encode(counts: Mapping[str, tuple[int, int]]) -> bytes:
    return orjson.dumps({url: list(pair) for url, pair in counts.items()})


def decode(raw: bytes) -> Counts:
    """One host's counts as it sent them; what is not a pair of non-negative integers is left
    out, and all of it past ``MAX_INSTANCES``."""
    doc = orjson.loads(raw)
    out: Counts = {}
    if not isinstance(doc, dict):
        return out
    for url, pair in doc.items():
        if len(out) >= MAX_INSTANCES:
            break
        if isinstance(pair, list) and len(pair) == 2 and all(
                type(v) is int and v >= 0 for v in pair):
            out[url] = (pair[0], pair[1])
    return out


def others(answer: Iterable[Any]) -> Counts:
    """The script's answer (host, counts, host, counts, ...) summed per instance; a host whose
    counts cannot be read counts for nothing."""
    items = list(answer)
    total: dict[str, list[int]] = {}
    for raw in items[1::2]:
        try:
            counts = decode(raw)
        except (orjson.JSONDecodeError, TypeError):
            continue
        for url, (calls, tokens) in counts.items():
            pair = total.get(url)
            if pair is None:
                total[url] = [calls, tokens]
            else:
                pair[0] += calls
                pair[1] += tokens
    return {url: (pair[0], pair[1]) for url, pair in total.items()}


def store_digest(url: str) -> bytes:
    """What a snapshot names its store by (the URL may carry a password)."""
    return hashlib.blake2b(url.encode("utf-8", "surrogateescape"), digest_size=8).digest()


class LoadShare:
    """This worker's view of the other hosts' open calls, kept fresh by the host's exchanging
    worker (this one, or a sibling that publishes its snapshot in the state directory); and
    the host's counts, sent from it. ``configure`` names the store (empty: none)."""

    def __init__(self, board: LoadBoard, host: str, events: Events | None = None,
                 state_dir: str | os.PathLike[str] | None = None) -> None:
        self.board = board
        self.host = host
        self._events = events if events is not None else Events()
        self._urls: Callable[[], Iterable[str]] = tuple
        self._url = ""
        self._digest = store_digest("")
        self._client: Any = None
        self._script: Any = None
        self._errors: tuple[type[BaseException], ...] = ()
        self._sent = b""
        self._sent_at = float("-inf")
        #: The other hosts' counts by instance key (``key_of``), and when they were read: as
        #: the exchange read them (``_theirs``) plus the claims heard since (``_claims``:
        #: until when, instance key, calls, tokens).
        self._snapshot: dict[int, tuple[int, int]] = {}
        self._theirs: dict[int, tuple[int, int]] = {}
        self._claims: list[tuple[float, int, int, int]] = []
        self._outbox: list[tuple[str, int]] = []
        self._sending = False
        self._pubsub: Any = None
        self._listen_at = 0.0
        self._read_at = float("-inf")
        self._retry_at = 0.0
        self._keys: dict[str, int] = {}
        #: The state directory's two files; None without one (this worker exchanges itself).
        self._dir = Path(state_dir) if state_dir else None
        self._lock: int | None = None
        self._map: mmap.mmap | None = None
        #: Whether this worker holds the lock: it exchanges and writes the snapshot file.
        self.leading = False
        #: The snapshot file as this worker last read it (a sibling) or wrote it (the holder).
        self._seen = -1
        self._body: bytes | None = None
        self._body_id: tuple[int, int] | None = None
        self._heard = True
        self._written_at = float("-inf")
        #: None without a store; else whether it answered the host's latest exchange.
        self.up: bool | None = None
        self._loop = Periodic("load share", self.tick, self._interval)
        self._listener = Periodic("load claims", self.listen, self._listen_interval)

    def follow(self, urls: Callable[[], Iterable[str]]) -> None:
        """Where the instances whose counts are sent come from (the registry's, read at each
        exchange)."""
        self._urls = urls

    def configure(self, url: str) -> None:
        """Use the store at ``url`` (empty: none) from the next exchange on."""
        if url == self._url:
            return
        listening = self._listener.running
        self._close()
        self._url, self._sent, self._retry_at = url, b"", 0.0
        self._snapshot, self._theirs, self._claims, self._outbox = {}, {}, [], []
        self._digest, self._read_at, self._seen, self._body_id = \
            store_digest(url), float("-inf"), -1, None
        if url:
            self._client = redisclient.connect(url, max_connections=CONNECTIONS)
            self._script = self._client.register_script(SCRIPT)
            self._errors = redisclient.errors()
        else:
            self._release()  # a sibling with a store exchanges (mid-reload)
        self._answered(True if url else None)
        if listening:
            self._listener.start()

    def start(self) -> None:
        self._loop.start()
        self._listener.start()

    def stop(self) -> None:
        self._loop.stop()
        self._close()
        self._release()
        if self._lock is not None:
            close_lock(self._lock)
            self._lock = None
        if self._map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
            self._map = None

    def counts(self, url: str) -> tuple[int, int]:
        """The calls the other hosts have open on ``url`` and their estimated prompt tokens, as
        last heard; (0, 0) when nothing fresh was heard."""
        if self._script is None:
            return NONE
        if self._map is not None and not self.leading:
            self._follow()
        if not self._snapshot or not 0 <= time.monotonic() - self._read_at <= STALE:
            return NONE
        return self._snapshot.get(self._key(url), NONE)

    def tick(self) -> None:
        """One round of the loop: with a store, exchange if this worker holds (or now takes)
        the host's lock, else read the holder's snapshot."""
        if self._script is None:
            return
        if not self._exchanges() and not self._lead():
            if self._follow() and 0 <= time.monotonic() - self._written_at <= OLD:
                self._answered(self._heard)
            return
        self.exchange()

    def exchange(self) -> None:
        """Send this host's counts if due and take the other hosts' (one round trip); the
        host's exchanging worker then publishes what it took to its siblings."""
        script = self._script
        if script is None or time.monotonic() < self._retry_at:
            return
        payload = encode(host_counts(self.board, self._urls()))
        now = time.monotonic()
        send = payload != self._sent or now - self._sent_at >= HEARTBEAT
        try:
            answer = script(keys=[HOSTS], args=[PREFIX, self.host, payload if send else b"",
                                                int(TTL * 1000)])
        except Exception as exc:
            if script is not self._script:
                return  # its client was closed (a reload, a stop) while this exchange waited
            if not isinstance(exc, self._errors):
                raise
            self._failed(" ".join(str(exc).split())[:200] or type(exc).__name__)
            return
        if script is not self._script:
            return  # the store changed while this exchange waited
        if send:
            self._sent, self._sent_at = payload, now
        self._theirs = self._keyed(others(answer or ()))
        self._read_at = time.monotonic()
        self._merge()
        if self.up is False:
            logger.info("routing: the load store %s answers again; the other proxy hosts' "
                        "calls count as they publish them", redacted(self._url))
        self._answered(True)
        self._publish()

    def _failed(self, why: str) -> None:
        self._snapshot, self._theirs, self._claims, self._sent = {}, {}, [], b""
        self._retry_at = time.monotonic() + RETRY_SECONDS
        if self.up:
            logger.warning("routing: the load store %s does not answer (%s); the other proxy "
                           "hosts count through the engines' queues until it does",
                           redacted(self._url), why)
        self._answered(False)
        self._publish()

    def _interval(self) -> float:
        if self._script is None:
            return IDLE_SECONDS
        if not self._exchanges():
            return TAKEOVER_SECONDS
        return INTERVAL if self.up else RETRY_SECONDS

    def _exchanges(self) -> bool:
        """Whether this worker exchanges for its host: it holds the lock, or has no state
        directory to share the exchange in."""
        return self._dir is None or self.leading

    def _answered(self, up: bool | None) -> None:
        if up != self.up:
            self.up = up
            self._events.load_store.fire(up)

    def _close(self) -> None:
        """Detach the client (no exchange or claim starts on it), then close it. The listener
        waits in a read on its subscription: it must be gone before its connection closes, or
        redis-py's read fails in the middle of its own bookkeeping."""
        client, self._client, self._script = self._client, None, None
        self._listener.stop(wait=STOP_SECONDS)
        self._unsubscribe()
        if client is not None:
            client.close()

    # -- claims: each call opened, told to the other hosts at once ------------------------

    def claim(self, url: str, tokens: int) -> None:
        """A call this worker just opened on ``url`` for a prompt of ``tokens`` (estimated):
        sent to the other hosts by a greenlet of its own, the request never waiting."""
        if self._client is None or self.up is False:
            return
        if len(self._outbox) >= MAX_OUTBOX:
            self._outbox.clear()
        self._outbox.append((url, tokens))
        if not self._sending:
            self._sending = True
            gevent.spawn(self._send)

    def _send(self) -> None:
        client = self._client
        try:
            while self._outbox and client is not None and client is self._client:
                batch, self._outbox = self._outbox, []
                calls: dict[str, tuple[int, int]] = {}
                for url, tokens in batch:
                    opened, held = calls.get(url, NONE)
                    calls[url] = (opened + 1, held + tokens)
                client.publish(CLAIMS, self.host.encode() + b" " + encode(calls))
        except Exception as exc:
            self._outbox = []  # the exchange carries the counts
            if client is self._client and not isinstance(exc, self._errors):
                logger.exception("load share: cannot claim calls on the store")
        finally:
            self._sending = False

    def listen(self) -> None:
        """One round of the claims' listener: while this worker exchanges for its host, wait
        up to ``LISTEN_SECONDS`` for the other hosts' claims, each taken in as it comes."""
        client = self._client
        if client is None or not self._exchanges():
            self._unsubscribe()
            return
        until = time.monotonic() + LISTEN_SECONDS
        try:
            if self._pubsub is None:
                self._pubsub = client.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(CLAIMS)
            pubsub = self._pubsub
            while (left := until - time.monotonic()) > 0 and pubsub is self._pubsub:
                message = pubsub.get_message(timeout=left)
                batch: list[bytes] = []
                while message is not None and len(batch) < LISTEN_BATCH:
                    if message.get("type") == "message":
                        batch.append(message["data"])
                    message = pubsub.get_message(timeout=0)
                if batch:
                    self.heard(*batch)
        except self._errors as exc:
            logger.debug("load share: cannot hear the other hosts' claims (%s)", exc)
            self._unsubscribe()
            self._listen_at = time.monotonic() + RETRY_SECONDS

    def heard(self, *raws: bytes) -> None:
        """Messages on ``CLAIMS`` (those that came together: the snapshot is rebuilt and
        published once for them): other hosts' calls counted from now for ``CLAIM_SECONDS``,
        and published to this host's siblings at once; this host's own, and what cannot be
        read, ignored."""
        until = time.monotonic() + CLAIM_SECONDS
        own = self.host.encode()
        for raw in raws:
            host, _, body = raw.partition(b" ")
            if host == own:
                continue
            try:
                counts = decode(body)
            except (orjson.JSONDecodeError, TypeError):
                continue
            for url, (calls, tokens) in counts.items():
                if len(self._claims) < MAX_INSTANCES:
                    self._claims.append((until, self._key(url), calls, tokens))
        self._merge()
        self._publish()

    def _merge(self) -> None:
        """The snapshot routing reads: the exchange's counts plus the claims still counting
        (at most ``MAX_INSTANCES`` instances in all)."""
        now = time.monotonic()
        self._claims = [claim for claim in self._claims if claim[0] > now]
        if not self._claims:
            self._snapshot = self._theirs
            return
        merged = dict(self._theirs)
        for _, key, calls, tokens in self._claims:
            if key in merged or len(merged) < MAX_INSTANCES:
                known, held = merged.get(key, NONE)
                merged[key] = (known + calls, held + tokens)
        self._snapshot = merged

    def _listen_interval(self) -> float:
        if self._client is None or not self._exchanges():
            return IDLE_SECONDS
        return max(0.0, self._listen_at - time.monotonic())

    def _unsubscribe(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(*self._errors):
                pubsub.close()

    def _key(self, url: str) -> int:
        key = self._keys.get(url)
        if key is None:
            if len(self._keys) >= 4 * MAX_INSTANCES:
                self._keys.clear()
            key = self._keys[url] = key_of(url)
        return key

    def _keyed(self, counts: Counts) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for url, pair in counts.items():
            if len(out) >= MAX_INSTANCES:
                break
            out[self._key(url)] = pair
        return out

    # -- one exchanging worker per host, its snapshot for the others ----------------------

    def _open(self) -> bool:
        """The lock and the snapshot file (made, at full size, by whichever worker comes
        first); a worker that cannot have them exchanges itself, as without a state dir."""
        if self._map is not None:
            return True
        assert self._dir is not None
        try:
            if self._lock is None:
                self._lock = open_lock(self._dir / SHARE_LOCK_FILE)
            fd = os.open(self._dir / SHARE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                self._map = map_shared(fd, SIZE)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("cannot share the load store's exchange in %s (%s); this worker "
                           "exchanges itself", self._dir, exc)
            if self._lock is not None:
                close_lock(self._lock)
                self._lock = None
            self._dir = None
            return False
        return True

    def _lead(self) -> bool:
        """Take the host's lock if no sibling holds it: True when this worker now exchanges
        (or has no state directory to share it in)."""
        if not self._open():
            return True
        assert self._lock is not None
        if not try_lock(self._lock):
            return False
        self.leading = True
        self._sent, self._retry_at, self._body = b"", 0.0, None  # the host's counts go out at once
        logger.debug("load share: this worker exchanges for host %s", self.host)
        return True

    def _release(self) -> None:
        if self.leading and self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
        self.leading = False

    def _publish(self) -> None:
        """Write the snapshot for the siblings: the sequence number odd, the record (and the
        slots when they changed), the sequence number even again."""
        if self._map is None or not self.leading:
            return
        body = b"".join(SLOT.pack(key, calls, tokens)
                        for key, (calls, tokens) in self._snapshot.items())
        sequence = SEQUENCE.unpack_from(self._map, 8)[0]
        sequence += 1 if sequence % 2 == 0 else 2  # odd: a holder that died mid-write
        HEAD.pack_into(self._map, 0, MAGIC, sequence)
        if body != self._body:
            self._map[BODY:BODY + len(body)] = body
            self._body = body
        RECORD.pack_into(self._map, HEAD.size, self._digest, self._read_at, time.monotonic(),
                         1 if self.up else 0, len(body) // SLOT.size, zlib.crc32(body))
        HEAD.pack_into(self._map, 0, MAGIC, sequence + 1)

    def _follow(self) -> bool:
        """Read the holder's snapshot if it changed since the last look; True when the
        snapshot as read is for this worker's store (its ``up`` is then in ``_heard``)."""
        assert self._map is not None
        magic, sequence = HEAD.unpack_from(self._map, 0)
        if sequence == self._seen:
            return self._body_id is not None
        if magic != MAGIC or sequence % 2:
            return False  # not written yet, or being written: the next look
        digest, read_at, written_at, up, used, crc = RECORD.unpack_from(self._map, HEAD.size)
        if digest != self._digest:
            self._seen, self._snapshot, self._body_id = sequence, {}, None
            return False
        used = min(used, MAX_INSTANCES)
        body = self._map[BODY:BODY + used * SLOT.size] if (used, crc) != self._body_id \
            else None
        if SEQUENCE.unpack_from(self._map, 8)[0] != sequence:
            return False  # written meanwhile
        if body is not None:
            if zlib.crc32(body) != crc:
                return False
            self._snapshot = {key: (calls, tokens)
                              for key, calls, tokens in SLOT.iter_unpack(body)}
            self._body_id = (used, crc)
        self._seen, self._read_at, self._written_at, self._heard = \
            sequence, read_at, written_at, bool(up)
        return True
