"""Folding exited workers' metric files (observe/mpdir.py): the totals a scrape reads are the
same before and after, the directory keeps one archive per kind instead of a file per worker
that ever lived, and a fold never runs under a scrape that is reading.

Each "worker" is a real process writing through prometheus_client's multiprocess values, as a
gunicorn worker does, then exiting."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client.multiprocess import MultiProcessCollector

from epd_flask.observe.mpdir import MultiprocessDir
from epd_flask.observe.shown import Shown

WORKER = textwrap.dedent("""
    import sys
    from prometheus_client import Counter, Gauge, Histogram
    n = int(sys.argv[1])
    requests = Counter("served_total", "x", ["route"])
    requests.labels("/v1/completions").inc(n)
    requests.labels("passthrough").inc(1)
    seconds = Histogram("took_seconds", "x", ["stage"], buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 5.0)[: n % 3 + 1]:
        seconds.labels("decode").observe(value)
    Gauge("open_calls", "x", multiprocess_mode="livesum").inc(2)
""")


def worker(directory: Path, n: int) -> None:
    """One process that writes its metrics and exits (its pid is then dead)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    subprocess.run([sys.executable, "-c", WORKER, str(n)], env=env, timeout=60, check=True)


def totals(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    files = [str(p) for p in directory.glob("*.db")]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in MultiProcessCollector.merge(files, accumulate=True) for s in m.samples}


def collected(found: MultiprocessDir) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in found.collect() for s in m.samples}


def test_folded_totals_equal_the_workers_sums_and_the_files_do_not_pile_up(
        tmp_path: Path) -> None:
    for n in (3, 4, 5):
        worker(tmp_path, n)
    before = totals(tmp_path)
    assert before[("served_total", (("route", "/v1/completions"),))] == 12
    assert len(list(tmp_path.glob("*.db"))) == 9  # counter, histogram, gauge per worker
    found = MultiprocessDir(str(tmp_path))
    assert found.fold() == 9
    assert sorted(p.name for p in tmp_path.glob("*.db")) == [
        "counter_archive.db", "histogram_archive.db"]
    # Every counter and histogram series as it was; the dead workers' live gauges gone.
    after = collected(found)
    assert after == {k: v for k, v in before.items() if k[0] != "open_calls"}
    # More generations: still two archives, totals still the sums.
    for n in (6, 7):
        worker(tmp_path, n)
    assert found.fold() == 6
    after = collected(found)
    assert after[("served_total", (("route", "/v1/completions"),))] == 12 + 13
    assert after[("served_total", (("route", "passthrough"),))] == 5
    assert after[("took_seconds_count", (("stage", "decode"),))] == 1 + 2 + 3 + 1 + 2
    assert after[("took_seconds_bucket", (("le", "+Inf"), ("stage", "decode")))] == 9
    assert after[("took_seconds_bucket", (("le", "0.1"), ("stage", "decode")))] == 5
    assert len(list(tmp_path.glob("*.db"))) == 2


def test_a_live_workers_files_stay_and_a_reading_scrape_holds_a_fold_off(
        tmp_path: Path) -> None:
    worker(tmp_path, 1)
    mine = tmp_path / f"counter_{os.getpid()}.db"  # this process: alive
    next(tmp_path.glob("counter_*.db")).rename(mine)
    found = MultiprocessDir(str(tmp_path))
    with found._locked(fcntl.LOCK_SH, wait=0.0) as held:  # a scrape reading right now
        assert held
        assert found.fold() == 0
        assert len(list(tmp_path.glob("*.db"))) == 3
    assert found.fold() == 2  # the dead worker's histogram and gauge; this process's stays
    assert sorted(p.name for p in tmp_path.glob("*.db")) == [
        mine.name, "histogram_archive.db"]
    assert collected(found)[("served_total", (("route", "/v1/completions"),))] == 1


def test_the_shown_series_leave_out_departed_labels_in_every_worker_file(
        tmp_path: Path) -> None:
    """The exposition filter (observe/shown.py) reads through the multiprocess directory: a
    series whose label value may no longer show is left out however many workers wrote it,
    and a label a series does not carry never hides it."""
    worker(tmp_path, 1)
    worker(tmp_path, 2)
    shown = Shown([MultiprocessDir(str(tmp_path))], {"route": lambda kind, v: v != "passthrough",
                                                     "model": lambda kind, v: False})
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for m in shown.collect() for s in m.samples}
    assert got[("served_total", (("route", "/v1/completions"),))] == 3
    assert not [k for k in got if ("route", "passthrough") in k[1]]
    assert got[("took_seconds_count", (("stage", "decode"),))] == 2 + 3
