"""What this proxy host has open on each instance, summed over the workers of one gunicorn
master: the requests running there, which ``max_concurrency`` is compared with
(docs/behaviour.md#admission), and the upstream calls open there with their estimated prompt
tokens, which routing's load counts (docs/behaviour.md#routing-policies).

Each worker writes its own counts into a small file of its own in the state directory, which it
alone writes (one aligned 8-byte store per change, no lock), and reads its siblings' files
through ``mmap`` to sum them, as prometheus_client's multiprocess values do. One shared file
would need an atomic add, which Python does not have on shared memory: every change would take
a file lock (two system calls, contended by every worker on every request); a single-writer
file per worker needs none, and a reader's sum is a handful of aligned loads. A file is
``load-<pid>.bin`` (``load-<pid>-<n>.bin`` for a further app in one process, as in the
in-process tests); a file whose worker died is skipped from the next refresh on (its pid is
gone) and removed by the master when it reaps the worker, or by the worker when it stops.

A file: a header (magic, a layout generation, slots used), then slots of (key, one count per
field: ``RUNNING``, ``CALLS``, ``TOKENS``, ``UNANSWERED``'s, ``UNANSWERED_CALLS``' and
``UNANSWERED_SINCE``'s two each), the key being the first 8
bytes of blake2b of the instance's URL. Slots are appended; a full file is compacted (slots
whose counts are all 0 dropped) under a new generation, which tells readers to index it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import mmap
import os
import struct
import time
from pathlib import Path

from epd_flask.control.statedir import LOAD_PREFIX, LOAD_SUFFIX, map_shared, running

logger = logging.getLogger(__name__)

MAGIC = b"EPDLOAD4"
HEADER = struct.Struct("<8sQQ")  # magic, generation, slots used
#: The counts of a slot: the requests admission let run there; the upstream calls open there;
#: the estimated prompt tokens of those calls; and per class better than the worst (``high``,
#: ``normal``), the estimated prompt tokens of that class's requests routed there whose answer
#: has not begun (docs/behaviour.md#admission, rule 14), how many those requests are, and the
#: sum of the times they were routed (``routed_ms``), which tells how long the engine has been
#: at them.
RUNNING, CALLS, TOKENS = 0, 1, 2
UNANSWERED = (3, 4)
UNANSWERED_CALLS = (5, 6)
UNANSWERED_SINCE = (7, 8)
FIELDS = 9
SLOT = struct.Struct(f"<Q{FIELDS}q")  # key, counts
COUNTS = struct.Struct(f"<{FIELDS}q")
COUNT = struct.Struct("<q")
NONE = (0,) * FIELDS
#: Instances one worker's file can hold at once; past that the file is compacted.
SLOTS = 4096
SIZE = HEADER.size + SLOTS * SLOT.size
#: How often a reader looks for workers that started or died (a look lists the directory,
#: ~20 us); and how often it checks whether the directory changed (a stat, ~2 us), which looks
#: again at once: routing reads the board from a worker's first engine read on, at boot, often
#: before its siblings have made their files, which then count from their first request. A
#: directory changed within ``RECENT_NS`` is looked at on every check: its time stamp is as
#: coarse as the kernel's clock tick, so a file made in the same tick as the last check would
#: leave it as it was.
REFRESH_SECONDS = 1.0
CHANGED_SECONDS = 0.05
RECENT_NS = 200_000_000

_apps = itertools.count()


def routed_ms() -> int:
    """Now in whole milliseconds of ``CLOCK_MONOTONIC``, which every process of a machine
    shares, so sibling workers' routing times add up and compare."""
    return time.monotonic_ns() // 1_000_000


def key_of(url: str) -> int:
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


class _Sibling:
    """Another worker's file, read through ``mmap``; indexed again whenever its layout
    changes."""

    __slots__ = ("generation", "index", "map", "path", "used")

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as fh:
            self.map = mmap.mmap(fh.fileno(), SIZE, access=mmap.ACCESS_READ)
        self.generation = -1
        self.used = 0
        self.index: dict[int, int] = {}

    def counts(self, key: int) -> tuple[int, ...]:
        magic, generation, used = HEADER.unpack_from(self.map, 0)
        if magic != MAGIC or generation & 1:
            return NONE  # not written yet, being compacted right now (a moment's undercount)
        if generation != self.generation:
            self.generation, self.used, self.index = generation, 0, {}
        if used != self.used:
            for slot in range(self.used, min(used, SLOTS)):
                offset = HEADER.size + slot * SLOT.size
                self.index[SLOT.unpack_from(self.map, offset)[0]] = offset + 8
            self.used = used
        offset = self.index.get(key)
        return COUNTS.unpack_from(self.map, offset) if offset is not None else NONE

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()


class LoadBoard:
    """This worker's counts, published to its siblings when there is a state directory, and
    the host's total per instance. Every caller runs on one gevent hub; nothing here yields."""

    def __init__(self, state_dir: str | os.PathLike[str] | None) -> None:
        self._own: dict[str, list[int]] = {}
        self._keys: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._dir = Path(state_dir) if state_dir else None
        self._path: Path | None = None
        self._map: mmap.mmap | None = None
        self._generation = 0
        self._siblings: dict[Path, _Sibling] = {}
        self._refreshed = float("-inf")
        self._checked = float("-inf")
        self._dir_mtime: int | None = None

    def start(self) -> None:
        """Create this worker's file (after fork: the name carries the worker's pid)."""
        if self._dir is None or self._map is not None:
            return
        n = next(_apps)
        name = f"{LOAD_PREFIX}{os.getpid()}{f'-{n}' if n else ''}{LOAD_SUFFIX}"
        self._path = self._dir / name
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                self._map = map_shared(fd, SIZE)  # emptied by O_TRUNC: a fresh file
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("cannot share this worker's load in %s (%s); its siblings will "
                           "not see it", self._dir, exc)
            self._path = None
            return
        self._rewrite()

    def stop(self) -> None:
        for sibling in self._siblings.values():
            sibling.close()
        self._siblings.clear()
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()

    def add(self, url: str, delta: int, field: int = RUNNING) -> None:
        """A request of this worker started (+1) or stopped (-1) running on ``url``; with
        ``field``, a call opened or closed there (``CALLS``), its tokens (``TOKENS``), or a
        class's unanswered prompt tokens (``UNANSWERED``), requests (``UNANSWERED_CALLS``) or
        their routing times (``UNANSWERED_SINCE``)."""
        values = self._own.get(url)
        if values is None:
            if delta <= 0:
                return
            values = self._own[url] = [0] * FIELDS
        value = values[field] = max(0, values[field] + delta)
        if not any(values):
            del self._own[url]
        if self._map is None:
            return
        slot = self._slots.get(url)
        if slot is None:
            if value == 0:
                return
            if len(self._slots) >= SLOTS:
                self._rewrite()
            slot = self._slots[url] = len(self._slots)
            SLOT.pack_into(self._map, HEADER.size + slot * SLOT.size, self._key(url), *values)
            HEADER.pack_into(self._map, 0, MAGIC, self._generation, len(self._slots))
            return
        COUNT.pack_into(self._map, HEADER.size + slot * SLOT.size + 8 + 8 * field, value)

    def own(self, url: str, field: int = RUNNING) -> int:
        values = self._own.get(url)
        return values[field] if values is not None else 0

    def count(self, url: str, field: int = RUNNING) -> int:
        """Requests running on ``url`` (or ``field``'s count) from every worker of this host
        (this one exactly, the others as of their last store)."""
        return self.counts(url)[field]

    def counts(self, url: str) -> tuple[int, ...]:
        """Every field's count on ``url``, summed over this host's workers."""
        values = self._own.get(url)
        if self._map is None:
            return tuple(values) if values is not None else NONE
        now = time.monotonic()
        if now - self._checked >= CHANGED_SECONDS:
            self._check(now)
        if not self._siblings:
            return tuple(values) if values is not None else NONE
        total = list(values) if values is not None else [0] * FIELDS
        key = self._key(url)
        for sibling in self._siblings.values():
            theirs = sibling.counts(key)
            if theirs is not NONE:
                for i in range(FIELDS):
                    total[i] += theirs[i]
        return tuple(total)

    def _key(self, url: str) -> int:
        key = self._keys.get(url)
        if key is None:
            if len(self._keys) >= SLOTS:
                self._keys.clear()
            key = self._keys[url] = key_of(url)
        return key

    def _rewrite(self) -> None:
        """Lay the file out again with only the instances this worker counts anything on."""
        assert self._map is not None
        self._generation += 1  # odd: readers skip the file until it is consistent again
        HEADER.pack_into(self._map, 0, MAGIC, self._generation, 0)
        self._slots = {}
        for slot, (url, values) in enumerate(self._own.items()):
            self._slots[url] = slot
            SLOT.pack_into(self._map, HEADER.size + slot * SLOT.size, self._key(url), *values)
        self._generation += 1
        HEADER.pack_into(self._map, 0, MAGIC, self._generation, len(self._slots))

    def _check(self, now: float) -> None:
        self._checked = now
        assert self._dir is not None
        try:
            mtime: int | None = os.stat(self._dir).st_mtime_ns
        except OSError:
            mtime = None
        if mtime != self._dir_mtime or now - self._refreshed >= REFRESH_SECONDS \
                or (mtime is not None and time.time_ns() - mtime < RECENT_NS):
            self._dir_mtime = mtime
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        self._refreshed = now
        assert self._dir is not None
        seen: set[Path] = set()
        try:
            paths = list(self._dir.glob(f"{LOAD_PREFIX}*{LOAD_SUFFIX}"))
        except OSError:
            paths = []
        for path in paths:
            if path == self._path:
                continue
            try:
                pid = int(path.name[len(LOAD_PREFIX):-len(LOAD_SUFFIX)].split("-", 1)[0])
            except ValueError:
                continue
            if not running(pid):
                continue
            seen.add(path)
            if path not in self._siblings:
                try:
                    self._siblings[path] = _Sibling(path)
                except (OSError, ValueError):
                    continue  # not full size yet, or gone: the next refresh sees it
        for path in set(self._siblings) - seen:
            self._siblings.pop(path).close()
