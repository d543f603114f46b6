"""The multiprocess directory as one collector: every worker's values summed at a scrape
(prometheus_client's own merge; observe/shown.py leaves out the series of departed models and
instances), and the files of workers that have exited folded into one archive per kind, so a
scrape costs the same after a thousand reloads as after one.

Folding: counters and histograms of dead workers are summed into ``counter_archive.db`` and
``histogram_archive.db`` (their totals, and so every ``rate()``, carry on), their files
removed; their live-mode gauges (in flight, probe state: every gauge the proxy has) are
dropped, as prometheus_client's ``mark_process_dead`` drops them. Whichever worker scrapes
folds, under an exclusive ``flock`` on the directory's lock file; every scrape reads under a
shared one, so none sees a dead worker's values both in its file and in the archive, nor a
file vanish under it. The archive is written aside and renamed into place.

The archive is written with prometheus_client's file format (``mmap_dict``), a module its
package does not export: setup.cfg bounds the version, and tests/unit/test_mpdir.py holds the
folded sums to the unfolded ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import time
from collections.abc import Iterator

import gevent
from prometheus_client.core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

#: The kinds whose values outlive their worker, summed into an archive file each.
FOLDED = ("counter", "histogram", "summary")
ARCHIVE = "archive"
LOCK_FILE = ".epd-flask-fold.lock"
#: How long a scrape waits for a fold in progress (a fold takes milliseconds); after that it
#: reads without the lock and reads again if a file vanished under it.
LOCK_WAIT_SECONDS = 2.0
LOCK_POLL_SECONDS = 0.005


def _kind_of(path: str) -> str:
    """``counter``, ``histogram``, ``gauge_livesum``...: what a file holds."""
    return os.path.basename(path)[:-len(".db")].rsplit("_", 1)[0]


def _pid_of(path: str) -> int | None:
    """The worker a file belongs to (``counter_123.db``, ``gauge_livesum_123.db``)."""
    tail = os.path.basename(path)[:-len(".db")].rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True


class MultiprocessDir(Collector):
    def __init__(self, path: str) -> None:
        self.path = path

    def files(self) -> list[str]:
        return glob.glob(os.path.join(self.path, "*.db"))

    def collect(self) -> Iterator[Metric]:
        self.fold()
        with self._locked(fcntl.LOCK_SH, wait=LOCK_WAIT_SECONDS):
            try:
                metrics = MultiProcessCollector.merge(self.files(), accumulate=True)
            except FileNotFoundError:  # folded under a scrape that waited in vain
                metrics = MultiProcessCollector.merge(self.files(), accumulate=True)
        yield from metrics

    def fold(self) -> int:
        """Fold every dead worker's files, unless another process is folding right now;
        returns how many files went."""
        with self._locked(fcntl.LOCK_EX, wait=0.0) as held:
            if not held:
                return 0
            dead = [f for f in self.files()
                    if (pid := _pid_of(f)) is not None and not _alive(pid)]
            for kind in FOLDED:
                files = [f for f in dead if _kind_of(f) == kind]
                if files:
                    self._fold_kind(kind, files)
            gauges = [f for f in dead if _kind_of(f).startswith("gauge_live")]
            for gauge in gauges:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(gauge)
            gone = sum(_kind_of(f) in FOLDED for f in dead) + len(gauges)
            if gone:
                logger.debug("metrics: folded %d files of exited workers", gone)
            return gone

    def _fold_kind(self, kind: str, files: list[str]) -> None:
        archive = os.path.join(self.path, f"{kind}_{ARCHIVE}.db")
        staged = os.path.join(self.path, f".{kind}_{ARCHIVE}.staged")
        sources = [archive, *files] if os.path.exists(archive) else files
        # accumulate=False: histogram buckets stay per bucket, as the files hold them.
        merged = MultiProcessCollector.merge(sources, accumulate=False)
        with contextlib.suppress(FileNotFoundError):
            os.remove(staged)  # a fold that died half way
        out = MmapedDict(staged)
        try:
            for metric in merged:
                for s in metric.samples:
                    key = mmap_key(metric.name, s.name, list(s.labels), list(s.labels.values()),
                                   metric.documentation)
                    out.write_value(key, s.value, 0.0)
        finally:
            out.close()
        os.replace(staged, archive)
        for name in files:
            os.remove(name)

    @contextlib.contextmanager
    def _locked(self, how: int, wait: float) -> Iterator[bool]:
        """``flock`` on the directory's lock file without blocking the worker's loop: tried
        again every few milliseconds for up to ``wait`` seconds; yields whether it is held."""
        fd = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + wait
            held = False
            while True:
                try:
                    fcntl.flock(fd, how | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    gevent.sleep(LOCK_POLL_SECONDS)
            yield held
        finally:
            os.close(fd)  # releases the lock
