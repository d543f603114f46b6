"""One KV picture per host (docs/behaviour.md#routing-policies): one worker of a host reads
every instance's KV events and names their blocks; its siblings follow its pictures through
two Unix sockets in the state directory instead of reading and naming the same events again.

Reading costs a worker microseconds per block an engine stores or evicts (decoding vLLM's
messages, checking the token ids, hashing each block), and a host whose every worker read
every instance paid that once per worker. A sibling applies the reader's 16-byte keys, a
fraction of it. The reading worker (the *holder*) is whichever holds the state directory's
``kvrelay.lock``; it binds a PUB socket for the changes and a ROUTER that answers a sibling
asking for everything (one that just started, or missed a change). A sibling that cannot
follow (no snapshot yet, a change missed, the holder silent) has no picture, and ``kv_aware``
routes by prefix until it has one again. When the holder goes, the first sibling to take the
lock reads from then on, starting from nothing as any new reader does, and the others follow
it. Without a state directory, or one whose path is too long for a Unix socket, every worker
reads for itself.

The messages are our own and stay on the host: each is a multipart whose first frame names it.
- change: epoch, sequence (8 bytes, big-endian), instance URL, state, ``b"1"`` if the picture
  was cleared first (else empty), then four frames of keys (16 bytes each, back to back): held
  now, no longer held, orphan roots now, no longer orphan roots;
- beat (every ``BEAT_SECONDS``): epoch, the last change's sequence, then URL and state of every
  instance read;
- a snapshot, answering a sibling's request: epoch, sequence, then URL, state, held keys and
  orphan roots of every instance read.
A state is the block size (4 bytes, 0 while unknown) and flags (1 trusted, 2 stale). The epoch
is new with every holder, the sequence counts its changes: a follower that sees either jump
asks for a snapshot.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import gevent
import zmq
import zmq.green as zmq_green

from epd_flask.control.statedir import (
    KV_RELAY_LOCK_FILE,
    KV_RELAY_SOCKETS,
    close_lock,
    open_lock,
    try_lock,
)
from epd_flask.core import cooperate
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.kvcache import KEY_BYTES, CachePicture, HeldKeys

logger = logging.getLogger(__name__)

CHANGE, BEAT, SNAPSHOT, ASK = b"change", b"beat", b"snapshot", b"ask"
STATE = struct.Struct(">IB")
SEQUENCE = struct.Struct(">Q")
TRUSTED, STALE = 1, 2
#: How often the holder says what it reads (and sends changes no message carried: a reader
#: that lost its connection cleared its picture).
BEAT_SECONDS = 0.25
#: A holder not heard for this long is gone: its followers have no pictures until one is.
SILENT_SECONDS = 2.0
#: A snapshot not answered in this long is asked for again (the holder may have changed).
ASK_AGAIN_SECONDS = 1.0
#: Changes a follower keeps while it waits for a snapshot; past them it asks again.
WAITING_CHANGES = 4096
#: Messages either end queues before dropping (a dropped change is a sequence gap, answered
#: by a snapshot).
QUEUE_MESSAGES = 10_000
#: Keys a follower takes in before it hands the event loop back (a snapshot holds up to
#: ~130,000 per instance).
YIELD_KEYS = 65536
#: A follower that fails starts again after this.
RESTART_SECONDS = 1.0
#: The longest path a Unix socket can be bound at (``sun_path`` less its terminating NUL).
MAX_SOCKET_PATH = 107


class Source(Protocol):
    """What the holder relays of one reader."""

    picture: CachePicture

    @property
    def trusted(self) -> bool: ...

    @property
    def stale(self) -> bool: ...


def socket_paths(state_dir: Path) -> tuple[Path, Path] | None:
    """Where the holder binds its changes and its snapshots; None when a path would be too
    long for a Unix socket."""
    paths = tuple(state_dir / name for name in KV_RELAY_SOCKETS)
    if any(len(os.fsencode(p)) > MAX_SOCKET_PATH for p in paths):
        return None
    return paths[0], paths[1]


def state_of(source: Source) -> bytes:
    flags = (TRUSTED if source.trusted else 0) | (STALE if source.stale else 0)
    return STATE.pack(source.picture.block_size or 0, flags)


def keys(blob: bytes) -> list[bytes]:
    """The keys of a frame; ValueError if it is not whole keys."""
    if len(blob) % KEY_BYTES:
        raise ValueError(f"a frame of {len(blob)} bytes is not {KEY_BYTES}-byte keys")
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


class Holder:
    """The reading worker's side: its readers' changes out, snapshots for those who ask."""

    def __init__(self, context: zmq_green.Context, paths: tuple[Path, Path],
                 sources: Callable[[], Mapping[str, Source]]) -> None:
        self._sources = sources
        self.epoch = os.urandom(8)
        self.sequence = 0
        self._pub = context.socket(zmq.PUB)
        self._router = context.socket(zmq.ROUTER)
        self._beat = Periodic("KV relay beat", self.beat, lambda: BEAT_SECONDS)
        self._server: gevent.Greenlet | None = None
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, QUEUE_MESSAGES)
        try:
            # A socket file left by a holder that died is replaced.
            self._pub.bind(f"ipc://{paths[0]}")
            self._router.bind(f"ipc://{paths[1]}")
        except zmq.ZMQError:
            self.close()
            raise
        self._server = gevent.spawn(self._serve)
        self._beat.start()

    def close(self) -> None:
        self._beat.stop()
        if self._server is not None:
            self._server.kill(block=False)
        with contextlib.suppress(zmq.ZMQError):
            self._pub.close(linger=0)
            self._router.close(linger=0)

    def send(self, url: str, source: Source) -> None:
        """``url``'s picture's changes since the last, if any."""
        changes = source.picture.changes
        if not changes:
            return
        held = [k for k, v in changes.held.items() if v]
        gone = [k for k, v in changes.held.items() if not v]
        roots = [k for k, v in changes.roots.items() if v]
        unrooted = [k for k, v in changes.roots.items() if not v]
        cleared = changes.cleared
        changes.held, changes.roots, changes.cleared = {}, {}, False
        self.sequence += 1
        self._out([CHANGE, self.epoch, SEQUENCE.pack(self.sequence), url.encode(),
                   state_of(source), b"1" if cleared else b"", b"".join(held), b"".join(gone),
                   b"".join(roots), b"".join(unrooted)])

    def beat(self) -> None:
        sources = dict(self._sources())
        for url, source in sources.items():
            self.send(url, source)
        frames = [BEAT, self.epoch, SEQUENCE.pack(self.sequence)]
        for url, source in sources.items():
            frames += [url.encode(), state_of(source)]
        self._out(frames)

    def _out(self, frames: list[bytes]) -> None:
        # A follower this far behind sees the gap and asks for everything.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(frames, zmq.NOBLOCK)

    def snapshot(self) -> list[bytes]:
        """Everything, as of the last change sent: any change still to go applies on top of
        it as on top of what it changes (each key's last state), so the follower lands in the
        same place either way."""
        frames = [SNAPSHOT, self.epoch, SEQUENCE.pack(self.sequence)]
        for url, source in self._sources().items():
            picture = source.picture
            frames += [url.encode(), state_of(source), b"".join(picture.keys()),
                       b"".join(picture.roots())]
        return frames

    def _serve(self) -> None:
        """Answer every ask; one that cannot be answered is logged and the next served (the
        siblings ask again), so no error leaves them without snapshots for good."""
        while True:
            request = self._router.recv_multipart()
            if len(request) != 2 or request[1] != ASK:
                continue
            try:
                self._router.send_multipart([request[0], *self.snapshot()])
            except Exception:
                logger.exception("KV relay: cannot answer a sibling's ask for everything")


class Follower:
    """A sibling's side: the holder's pictures, followed change by change."""

    def __init__(self, context: zmq_green.Context, paths: tuple[Path, Path]) -> None:
        self._context = context
        self._paths = paths
        self.pictures: dict[str, HeldKeys] = {}
        self._flags: dict[str, int] = {}
        self.synced = False
        self._epoch = b""
        self._sequence = 0
        self._waiting: list[list[bytes]] = []
        self._heard = time.monotonic()
        self._asked = 0.0
        self._warned = False
        self._greenlet = gevent.spawn(self._supervise)

    def close(self) -> gevent.Greenlet:
        self._greenlet.kill(block=False)
        return self._greenlet

    def picture(self, url: str) -> HeldKeys | None:
        """``url``'s picture when the holder trusts it and this worker follows the holder."""
        picture = self.pictures.get(url) if self.synced else None
        if picture is None or not picture.ready or not self._flags.get(url, 0) & TRUSTED:
            return None
        return picture

    def stale(self, url: str) -> bool:
        picture = self.pictures.get(url) if self.synced else None
        return picture is not None and picture.ready and bool(self._flags.get(url, 0) & STALE)

    def _supervise(self) -> None:
        while True:
            try:
                self._follow()
            except Exception as exc:  # a follower must outlive anything: it starts again
                logger.warning("KV relay: following the host's reading worker failed (%s: "
                               "%s); kv_aware routes by prefix until it starts again",
                               type(exc).__name__, exc, exc_info=True)
            self._lose()
            gevent.sleep(RESTART_SECONDS)

    def _follow(self) -> None:
        sub = self._context.socket(zmq.SUB)
        dealer = self._context.socket(zmq.DEALER)
        try:
            for sock in (sub, dealer):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)
            # An ask goes only to a holder that is there: none pile up for the next one.
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{self._paths[0]}")
            dealer.connect(f"ipc://{self._paths[1]}")
            poller = zmq_green.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(dealer, zmq.POLLIN)
            self._heard = time.monotonic()
            while True:
                now = time.monotonic()
                if not self.synced and now - self._asked > ASK_AGAIN_SECONDS:
                    with contextlib.suppress(zmq.Again):  # no holder yet: the next round
                        dealer.send_multipart([ASK], zmq.NOBLOCK)
                        self._asked = now
                if now - self._heard > SILENT_SECONDS and self.synced:
                    self._lose()
                ready = dict(poller.poll(int(BEAT_SECONDS * 1000)))
                if dealer in ready:
                    self._install(dealer.recv_multipart())
                if sub in ready:
                    while sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._take(sub.recv_multipart(zmq.NOBLOCK))
                        cooperate.yield_now()
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)

    def _lose(self) -> None:
        """Stop following until a snapshot comes: nothing here is known to be right."""
        self.synced = False
        self.pictures, self._flags, self._waiting = {}, {}, []
        self._asked = 0.0

    def _malformed(self, why: object) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("KV relay: a message from the host's reading worker that is not "
                           "its format (%s); asking it for everything again", why)
        self._lose()

    def _take(self, frames: list[bytes]) -> None:
        self._heard = time.monotonic()
        try:
            kind, epoch, sequence = frames[0], frames[1], SEQUENCE.unpack(frames[2])[0]
        except (IndexError, struct.error) as exc:
            self._malformed(exc)
            return
        if not self.synced:
            if kind == CHANGE:
                self._waiting.append(frames)
                if len(self._waiting) > WAITING_CHANGES:
                    self._lose()
            return
        if epoch != self._epoch:
            self._lose()  # another holder
        elif kind == BEAT:
            # An older beat may come after a snapshot (another socket); a newer one means
            # changes went missing.
            if sequence > self._sequence:
                self._lose()
            elif sequence == self._sequence:
                self._beat(frames[3:])
        elif kind == CHANGE:
            if sequence == self._sequence + 1:
                self._change(frames)
            elif sequence > self._sequence:
                self._lose()
                self._waiting.append(frames)

    def _beat(self, frames: list[bytes]) -> None:
        try:
            flags = {url.decode(): STATE.unpack(state)[1]
                     for url, state in zip(frames[::2], frames[1::2], strict=True)}
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            self._malformed(exc)
            return
        self._flags = flags
        for url in [u for u in self.pictures if u not in flags]:
            del self.pictures[url]

    def _change(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 10:
                raise ValueError(f"a change of {len(frames)} frames, not 10")
            url = frames[3].decode()
            size, flags = STATE.unpack(frames[4])
            held, gone, roots, unrooted = (keys(f) for f in frames[6:10])
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            self._malformed(exc)
            return
        picture = self.pictures.get(url)
        if picture is None:
            picture = self.pictures[url] = HeldKeys()
        if frames[5] or picture.block_size != (size or None):
            picture.clear()
        picture.block_size = size or None
        picture.change(held, gone, roots, unrooted)
        self._flags[url] = flags
        self._sequence = SEQUENCE.unpack(frames[2])[0]

    def _install(self, frames: list[bytes]) -> None:
        """A snapshot: what the holder's pictures were at its sequence; the changes that came
        while it was on its way go on top of it, each the one after the last."""
        if self.synced or len(frames) < 3 or frames[0] != SNAPSHOT or (len(frames) - 3) % 4:
            return
        try:
            epoch, sequence = frames[1], SEQUENCE.unpack(frames[2])[0]
            pictures: dict[str, HeldKeys] = {}
            flags: dict[str, int] = {}
            for at in range(3, len(frames), 4):
                url = frames[at].decode()
                size, flags[url] = STATE.unpack(frames[at + 1])
                picture = pictures[url] = HeldKeys(size or None)
                for found, blob in ((picture.held, frames[at + 2]),
                                    (picture.roots, frames[at + 3])):
                    for part in _parts(keys(blob)):
                        found.update(part)
                        cooperate.yield_now()
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            self._malformed(exc)
            return
        waiting, self._waiting = self._waiting, []
        self.pictures, self._flags, self._epoch, self._sequence = pictures, flags, epoch, sequence
        self.synced = True
        for change in waiting:
            if self.synced:
                self._take(change)


def _parts(items: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    for at in range(0, len(items), YIELD_KEYS):
        yield items[at:at + YIELD_KEYS]


class Relay:
    """This worker's part in its host's relay: it holds the lock and reads for its siblings,
    or follows the worker that does."""

    def __init__(self, state_dir: Path, paths: tuple[Path, Path],
                 context: Callable[[], zmq_green.Context],
                 sources: Callable[[], Mapping[str, Source]]) -> None:
        self.where = state_dir
        self._lock_path = state_dir / KV_RELAY_LOCK_FILE
        self._paths = paths
        self._context = context
        self._sources = sources
        self._lock: int | None = None
        self.holder: Holder | None = None
        self.follower: Follower | None = None

    @classmethod
    def for_state_dir(cls, state_dir: str | os.PathLike[str] | None,
                      context: Callable[[], zmq_green.Context],
                      sources: Callable[[], Mapping[str, Source]]) -> Relay | None:
        """The relay of the host's state directory; None (every worker reads for itself)
        without one, or when its sockets' paths would be too long."""
        if not state_dir:
            return None
        paths = socket_paths(Path(state_dir))
        if paths is None:
            logger.warning("KV relay: the state directory %s is too deep for a Unix socket "
                           "(%d bytes at most); every worker reads the KV events itself",
                           state_dir, MAX_SOCKET_PATH)
            return None
        return cls(Path(state_dir), paths, context, sources)

    @property
    def leading(self) -> bool:
        return self.holder is not None

    @property
    def active(self) -> bool:
        """It holds or follows (it did not while the host had no instance to read)."""
        return self.holder is not None or self.follower is not None

    def lead(self) -> bool:
        """Take the lock if no sibling holds it: True when this worker now reads for its
        host (it stops following first)."""
        if self.holder is not None:
            return True
        if self._lock is None:
            self._lock = open_lock(self._lock_path)
        if not try_lock(self._lock):
            return False
        if self.follower is not None:
            self.follower.close()
            self.follower = None
        try:
            self.holder = Holder(self._context(), self._paths, self._sources)
        except zmq.ZMQError:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            raise
        logger.info("KV relay: this worker reads the KV events for its host")
        return True

    def follow(self) -> None:
        if self.holder is None and self.follower is None:
            self.follower = Follower(self._context(), self._paths)

    def send(self, url: str, source: Source) -> None:
        if self.holder is not None:
            self.holder.send(url, source)

    def close(self) -> list[gevent.Greenlet]:
        """Stop holding or following; the greenlets to wait for."""
        waiting = []
        if self.follower is not None:
            waiting.append(self.follower.close())
            self.follower = None
        if self.holder is not None:
            self.holder.close()
            self.holder = None
        if self._lock is not None:
            close_lock(self._lock)
            self._lock = None
        return waiting
