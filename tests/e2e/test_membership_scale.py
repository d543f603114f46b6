"""A large, busy etcd membership through real gunicorn (two gevent workers;
docs/behaviour.md#discovery): 1,000 records read at start by every worker, then records put,
changed and deleted at 50 a second (5 s by default, 60 s under ``slow``). Every worker ends
with exactly the records etcd holds; /health keeps answering throughout; over the minute, the
workers' memory does not grow with the changes.

The figures (time to converge, /health latency, RSS) are printed, not asserted: they are
measurements of this box's moment (docs/benchmarks.md's rule). What is asserted is that every
change reaches every worker, /health never fails, and RSS stays within a bound that steady
growth would cross.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import gevent
import pytest
import requests

from tests.e2e.conftest import Launcher, Process
from tests.helpers import eventually
from tests.membership import Etcd, needs_etcd

pytestmark = [pytest.mark.e2e, needs_etcd]

PREFIX = "/scale/"
KEY = "scale-admin-key"
RECORDS = 1000
#: The addresses instances join at: twice the fleet, so joins reuse addresses that left, as a
#: cluster's pods do. Every address is seen once before the changes begin: a distinct address
#: costs a worker its metric series for the worker's life (prometheus_client's multiprocess
#: files keep every label set), which is not what this measures.
POOL = 2 * RECORDS
RATE = 50  # changes per second
HEALTH_EVERY = 0.02  # seconds between /health calls
BASELINE = 2.0  # seconds of /health before the changes begin
#: What a worker may grow by between the first and the last third of the churn: 1,000
#: instances cost a worker a few MB; a leak of each change's merge would cross this.
RSS_GROWTH_BOUND = 32 * 1024 * 1024
FIRST_PORT = 20000


def record(n: int, dp_size: int = 1) -> dict[str, Any]:
    """Instance ``n``: a loopback URL nothing listens on (probes are refused at once)."""
    return {"role": "prefill_decode", "url": f"http://127.0.0.1:{FIRST_PORT + n}",
            "dp_size": dp_size}


def key(n: int) -> str:
    return f"{PREFIX}instances/i{n}"


def worker_views(state: Path, workers: set[int]) -> dict[int, set[str]]:
    """The instance URLs each worker routes by, from the health snapshot it writes (within
    0.2 s of a change, docs/behaviour.md#roster)."""
    views = {}
    for pid in workers:
        try:
            doc = json.loads((state / f"health-{pid}.json").read_text())
        except (OSError, ValueError):
            continue
        views[pid] = set(doc["instances"])
    return views


def differences(views: dict[int, set[str]], expected: set[str]) -> str:
    return "; ".join(f"worker {pid}: {len(expected - urls)} missing {sorted(expected - urls)[:3]}"
                     f", {len(urls - expected)} extra {sorted(urls - expected)[:3]}"
                     for pid, urls in views.items())


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def records_served(host: Process, workers: set[int]) -> dict[int, dict[str, int]]:
    """Each worker's {url: dp_size}, through GET /instances (new connections land on either
    worker; bounded tries)."""
    seen: dict[int, dict[str, int]] = {}
    for _ in range(40):
        doc = requests.get(host.url + "/instances", headers={"X-API-Key": KEY,
                           "Connection": "close"}, timeout=10).json()
        seen[doc["worker"]] = {row["url"]: row.get("dp_size", 1) for row in doc["data"]}
        if set(seen) >= workers:
            break
    return seen


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(latencies: list[float]) -> str:
    return (f"p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
            f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, "
            f"max {max(latencies) * 1000:.1f} ms")


def churn(tmp_path: Path, seconds: float, memory_bound: bool) -> None:
    """``memory_bound``: see every address of the pool first, and hold RSS to the bound (a
    run long enough for the status page's history to sample it a few times)."""
    (tmp_path / "etcd").mkdir()
    etcd = Etcd(tmp_path / "etcd").start()
    launcher = Launcher(tmp_path)
    rng = random.Random(7)
    try:
        held = {n: record(n) for n in range(RECORDS)}
        etcd.put_many({key(n): json.dumps(r).encode() for n, r in held.items()})
        roster = {"settings": {"probe_interval": 30},
                  "discovery": {"etcd": {"endpoints": [etcd.url], "prefix": PREFIX}}}
        started = time.monotonic()
        host = launcher.gunicorn(roster, workers=2, env={"ADMIN_API_KEY": KEY})
        state = tmp_path / f"state-{host.url.rsplit(':', 1)[1]}"
        workers = eventually(lambda: w if len(w := host.workers()) == 2 else None,
                             what="two workers")
        expected = {r["url"] for r in held.values()}
        eventually(lambda: (v := worker_views(state, workers)) and len(v) == 2
                   and all(urls == expected for urls in v.values()), seconds=60,
                   what=lambda: f"every worker with {RECORDS} instances: "
                                f"{ {p: len(u) for p, u in worker_views(state, workers).items()} }")
        converged = time.monotonic() - started
        if memory_bound:
            spare = {n: record(n) for n in range(RECORDS, POOL)}
            etcd.put_many({key(n): json.dumps(r).encode() for n, r in spare.items()})
            everyone = expected | {r["url"] for r in spare.values()}
            eventually(lambda: (v := worker_views(state, workers)) and len(v) == 2
                       and all(urls == everyone for urls in v.values()), seconds=60,
                       what="every worker with the whole pool")
            etcd.delete_many([key(n) for n in spare])
            eventually(lambda: (v := worker_views(state, workers)) and len(v) == 2
                       and all(urls == expected for urls in v.values()), seconds=60,
                       what=f"every worker back to {RECORDS}")

        latencies: list[float] = []
        failures: list[str] = []
        memory: list[dict[int, int]] = []

        def poll_health() -> None:
            while True:
                sent = time.monotonic()
                try:
                    r = requests.get(host.url + "/health", headers={"Connection": "close"},
                                     timeout=10)
                    if r.status_code != 200:
                        failures.append(f"HTTP {r.status_code}")
                except requests.RequestException as exc:
                    failures.append(str(exc))
                latencies.append(time.monotonic() - sent)
                gevent.sleep(max(0.0, HEALTH_EVERY - (time.monotonic() - sent)))

        def sample_memory() -> None:
            while True:
                memory.append({pid: rss(pid) for pid in workers})
                gevent.sleep(1)

        pollers = [gevent.spawn(poll_health)]
        gevent.sleep(BASELINE)  # /health with the fleet at rest, to compare with
        at_rest, latencies[:] = list(latencies), []
        pollers.append(gevent.spawn(sample_memory))
        changes = {"put": 0, "update": 0, "delete": 0}
        begin = time.monotonic()
        total = int(seconds * RATE)
        for i in range(total):
            gevent.sleep(max(0.0, begin + i / RATE - time.monotonic()))
            kind = rng.choice(("put", "update", "delete"))
            if kind == "delete" and held:
                n = rng.choice(list(held))
                del held[n]
                etcd.client.delete(key(n))
            elif kind == "update" and held:
                n = rng.choice(list(held))
                held[n] = record(n, held[n]["dp_size"] % 8 + 1)
                etcd.client.put(key(n), json.dumps(held[n]).encode())
            else:  # an instance joins: an address of the pool not in use
                kind = "put"
                n = rng.choice([m for m in range(POOL) if m not in held])
                held[n] = record(n)
                etcd.client.put(key(n), json.dumps(held[n]).encode())
            changes[kind] += 1
        elapsed = time.monotonic() - begin
        expected = {r["url"] for r in held.values()}
        applied = eventually(lambda: (v := worker_views(state, workers)) and len(v) == 2
                             and all(urls == expected for urls in v.values()), seconds=30,
                             what=lambda: "every change in every worker: " + differences(
                                 worker_views(state, workers), expected))
        settled = time.monotonic() - begin - elapsed
        gevent.killall(pollers)
        served = records_served(host, workers)
        want = {r["url"]: r["dp_size"] for r in held.values()}

        third = max(1, len(memory) // 3)
        early = {pid: max(m[pid] for m in memory[:third]) for pid in workers}
        late = {pid: max(m[pid] for m in memory[-third:]) for pid in workers}
        print(f"\n{RECORDS} records: every worker had them {converged:.2f} s after gunicorn "
              f"was started; {total} changes in {elapsed:.1f} s ({total / elapsed:.1f}/s: "
              f"{changes}), every worker had the last {settled:.2f} s after it was written; "
              f"/health during the changes x{len(latencies)}: {spread(latencies)}; at rest "
              f"x{len(at_rest)}: {spread(at_rest)}; load average {os.getloadavg()[0]:.1f}; "
              f"RSS MB first third -> last third "
              + ", ".join(f"{early[p] / 2**20:.1f} -> {late[p] / 2**20:.1f}" for p in workers)
              + "; RSS MB every 10 s: "
              + " | ".join(" ".join(f"{m[p] / 2**20:.0f}" for p in workers)
                           for m in memory[::10]))
        assert applied
        assert set(served) == workers and all(s == want for s in served.values())
        assert not failures, failures[:5]
        if memory_bound:
            for pid in workers:
                assert late[pid] - early[pid] < RSS_GROWTH_BOUND, (pid, early[pid], late[pid])
    finally:
        launcher.stop_all()
        etcd.stop()


def test_a_thousand_records_and_their_changes_reach_every_worker(tmp_path: Path) -> None:
    churn(tmp_path, 5.0, memory_bound=False)


@pytest.mark.slow
def test_a_minute_of_fifty_changes_a_second_over_a_thousand_records(tmp_path: Path) -> None:
    churn(tmp_path, 60.0, memory_bound=True)
