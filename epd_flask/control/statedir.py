"""The runtime state directory a gunicorn master shares with its workers.

It holds the published roster (the last validated copy with a generation number, written by
the master on start and reload and by a worker after an admin change, read by every worker),
one health snapshot per worker, so that workers started by a reload inherit what their
predecessors learned, and the tally of roster reloads by source and outcome (the master
counts SIGHUP reloads here, where it cannot use prometheus_client, and workers count admin
changes beside them; any worker's ``/metrics`` shows the tally). Light enough for the
master: JSON files, ``fcntl`` and our roster schema.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_flask.control import settings
from epd_flask.control.roster import Roster, RosterError, parse

logger = logging.getLogger(__name__)

STATE_DIR_ENV = "EPD_STATE_DIR"
PUBLISHED_FILE = "roster.json"
LOCK_FILE = "lock"
RELOADS_FILE = "reloads.json"
HEALTH_PREFIX = "health-"
HEALTH_SUFFIX = ".json"
#: Each worker's requests per instance (fleet/loadboard.py): ``load-<pid>[-<n>].bin``.
LOAD_PREFIX = "load-"
LOAD_SUFFIX = ".bin"
#: The host's rate-limit counters when no shared store answers (serving/ratelimit.py).
RATE_FILE = "ratelimit.bin"
#: The load store's exchange (fleet/loadshare.py): the lock its exchanging worker holds, and
#: the other hosts' counts as that worker last read them, for its siblings.
SHARE_LOCK_FILE = "loadshare.lock"
SHARE_FILE = "loadshare.bin"
#: One KV picture per host (fleet/kvrelay.py): the lock its reading worker holds, and the
#: sockets it sends its pictures' changes and answers snapshots on.
KV_RELAY_LOCK_FILE = "kvrelay.lock"
KV_RELAY_SOCKETS = ("kvrelay-changes.sock", "kvrelay-snapshots.sock")
LOCK_TIMEOUT = 5.0
LOCK_POLL = 0.01


#: The lock file descriptors this process has open, and the guard that keeps a fork from
#: falling between opening one and listing it here. ``flock`` belongs to the open file
#: description, which ``fork`` shares with the child (``O_CLOEXEC`` only closes it on exec):
#: a gunicorn worker forked while the master's reload thread held the lock, or was waiting for
#: it with the file open, held it for the rest of its life, and every later writer waited 5 s
#: and failed. A child closes its copies before it runs anything else; that releases nothing
#: (the parent's descriptor still refers to the description), so the parent keeps the lock
#: exactly as long as it meant to. POSIX record locks (``lockf``) are not inherited, but are
#: per process: greenlets and threads of one process would not exclude each other, and any
#: close of the file would drop them all. OFD locks belong to the description like ``flock``.
_open_locks: set[int] = set()
_fork_guard = threading.Lock()


def open_lock(path: Path) -> int:
    """A lock file's descriptor, closed in a forked child before it runs anything else."""
    with _fork_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _open_locks.add(fd)
    return fd


def try_lock(fd: int) -> bool:
    """Take the exclusive ``flock`` on ``fd`` (from ``open_lock``) unless another open file
    holds it: False then, at once. A worker polls rather than block its event loop."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


def close_lock(fd: int) -> None:
    """Close a descriptor from ``open_lock`` (which releases its ``flock``)."""
    with _fork_guard:
        _open_locks.discard(fd)
        os.close(fd)


def map_shared(fd: int, size: int) -> mmap.mmap:
    """The file of ``fd`` mapped read-write at ``size`` bytes, grown to that first if shorter
    and never shrunk: a sibling worker may have it mapped, and a read past a file's end is
    SIGBUS."""
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)
    return mmap.mmap(fd, size)


def _close_locks_in_child() -> None:
    for fd in _open_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_locks.clear()
    _fork_guard.release()


os.register_at_fork(before=_fork_guard.acquire, after_in_parent=_fork_guard.release,
                    after_in_child=_close_locks_in_child)


@dataclass(frozen=True)
class Published:
    generation: int
    roster: Roster
    origin: str


class StateDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StateDir | None:
        value = settings.read(STATE_DIR_ENV, environ)
        return cls(value) if value else None

    def ensure(self) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lock(self, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
        """Serialise writers of the roster file and the published copy across processes.

        Polls a non-blocking ``flock`` instead of blocking in the kernel: a gevent worker must
        keep serving its streams while another process holds the lock (``time.sleep`` is
        patched there).
        """
        fd = open_lock(self.path / LOCK_FILE)
        try:
            deadline = time.monotonic() + timeout
            while not try_lock(fd):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.path / LOCK_FILE} stayed locked for {timeout:g} s")
                time.sleep(LOCK_POLL)
            yield
        finally:
            close_lock(fd)  # closing releases the lock

    # -- the published roster ------------------------------------------------------------

    def signature(self) -> tuple[int, int, int] | None:
        """Changes whenever the published copy is replaced; cheap enough to poll."""
        try:
            st = os.stat(self.path / PUBLISHED_FILE)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def published(self) -> Published | None:
        """The published roster, or None when there is none or it cannot be read."""
        path = self.path / PUBLISHED_FILE
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            return Published(int(doc["generation"]), parse(doc["roster"], str(path)),
                             str(doc.get("origin", "")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, RosterError) as exc:
            logger.error("cannot read the published roster %s: %s", path, exc)
            return None

    def publish(self, roster: Roster, origin: str) -> int:
        """Write ``roster`` as the next generation; the caller holds ``lock()``."""
        current = self.published()
        generation = (current.generation if current else 0) + 1
        doc = {"generation": generation, "origin": origin, "published_at": time.time(),
               "roster": roster.model_dump(mode="json")}
        atomic_write(self.path / PUBLISHED_FILE, json.dumps(doc, indent=1).encode())
        return generation

    # -- the reload tally ----------------------------------------------------------------

    def record_reload(self, source: str, outcome: str) -> None:
        """Count one reload (``source`` sighup or admin, ``outcome`` ok or rejected); the
        caller holds ``lock()``."""
        tally = self.reloads()
        key = f"{source}/{outcome}"
        tally[key] = tally.get(key, 0) + 1
        atomic_write(self.path / RELOADS_FILE, json.dumps(tally).encode())

    def reloads(self) -> dict[str, int]:
        """``{"source/outcome": count}``; empty when nothing was counted or it cannot be read
        (atomic replacement means a reader never sees half a file)."""
        try:
            doc = json.loads((self.path / RELOADS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict):
            return {}
        return {str(k): int(v) for k, v in doc.items() if isinstance(v, int)}

    def reset_reloads(self) -> None:
        """A new master starts counting from zero, as its metrics directory does."""
        with contextlib.suppress(FileNotFoundError):
            (self.path / RELOADS_FILE).unlink()

    # -- health snapshots ----------------------------------------------------------------

    def write_health(self, worker: int | str, entries: Mapping[str, Any]) -> None:
        """Replace the snapshot of ``worker``: its pid, or ``<pid>-<n>`` for a further
        worker in the same process (see ``fleet.rostersync.snapshot_name``)."""
        pid = int(str(worker).split("-", 1)[0])
        doc = {"pid": pid, "written_at": time.time(), "instances": entries}
        atomic_write(self.path / f"{HEALTH_PREFIX}{worker}{HEALTH_SUFFIX}",
                     json.dumps(doc).encode())

    def read_health(self) -> dict[str, dict[str, Any]]:
        """Every worker's snapshot merged, per instance (see ``merge_health``)."""
        entries: dict[str, list[dict[str, Any]]] = {}
        for path in self.path.glob(f"{HEALTH_PREFIX}*{HEALTH_SUFFIX}"):
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
                for url, entry in doc["instances"].items():
                    if isinstance(entry, dict):
                        entries.setdefault(url, []).append(entry)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # a snapshot being replaced or left half-read: the others suffice
        return {url: merge_health(found) for url, found in entries.items()}

    def prune_health(self, keep: int) -> None:
        """Drop snapshots of workers that no longer run (their knowledge lives on in the
        snapshots of the workers that read them at boot)."""
        for path in self.path.glob(f"{HEALTH_PREFIX}*{HEALTH_SUFFIX}"):
            try:
                pid = int(path.name[len(HEALTH_PREFIX):-len(HEALTH_SUFFIX)].split("-", 1)[0])
            except ValueError:
                continue
            if pid != keep and not running(pid):
                with contextlib.suppress(OSError):
                    path.unlink()


    def forget_worker(self, pid: int) -> None:
        """A reaped worker's load file: its requests ended with it."""
        for path in self.path.glob(f"{LOAD_PREFIX}{pid}*{LOAD_SUFFIX}"):
            if path.name[len(LOAD_PREFIX):-len(LOAD_SUFFIX)].split("-", 1)[0] == str(pid):
                with contextlib.suppress(OSError):
                    path.unlink()


def merge_health(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One instance's health as several workers saw it: the most recent observation wins,
    except that a worker still counting failures below the threshold (live, ``failures`` >
    0) does not undo another's eviction. Its newest observation is a failure too; had it
    seen an answer after that eviction, a later success or rejoin would say so. Taking its
    "live" would send a new worker's traffic to an instance its siblings gave up on, until
    its own probes evicted it again; an eviction inherited wrongly costs one probe, which
    a new worker sends at once.
    """
    def when(entry: dict[str, Any]) -> float:
        try:
            return float(entry.get("changed_at") or 0)
        except (TypeError, ValueError):
            return 0.0

    def failing(entry: dict[str, Any]) -> bool:
        try:
            return bool(entry.get("live")) and int(entry.get("failures") or 0) > 0
        except (TypeError, ValueError):
            return False

    newest = max(entries, key=when)
    if failing(newest):
        latest = max((e for e in entries if not failing(e)), key=when, default=None)
        if latest is not None and not latest.get("live"):
            return latest
    return newest


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` so that readers see the old or the new content, never a mix: a temp
    file in the same directory, flushed to disk, then ``os.replace``. Keeps the file mode."""
    target = Path(path)
    try:
        mode: int | None = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists (a worker whose files still count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
