"""``kv_aware`` under real gunicorn (one gevent worker) against what a hostile or merely large
fleet sends it: the worker keeps answering ``/health`` at once while its KV-event readers and
its matching work (docs/behaviour.md#routing-policies).

A worker's event loop serves every request it holds, so a reader or a match that keeps the CPU
for seconds stalls them all, and past gunicorn's timeout the master kills the worker. The time
bounds below are ones only such a stall breaks: a healthy worker answers ``/health`` in
milliseconds, a stalled one took tens of seconds.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import gevent.pool
import pytest
import requests

from tests.e2e.conftest import ROOT
from tests.helpers import eventually, free_port, scrape, stop_group, total
from tests.unit.test_kvaware import Publisher
from tests.unit.test_kvcache import BLOCK, batch, stored

pytestmark = pytest.mark.e2e

#: A /health slower than this means the worker's loop was held (a healthy one: milliseconds).
STALLED = 1.0


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def kv_proxy(procs: Any, pub: Publisher, max_model_len: int = 512) -> Any:
    """gunicorn (one worker) routing prefill by ``kv_aware`` over one simulated prefill whose
    KV events ``pub`` publishes, and a decode."""
    p = procs["sim"]("prefill", "--max-model-len", str(max_model_len))
    d = procs["sim"]("decode", "--max-model-len", str(max_model_len))
    return procs["gunicorn"]({"settings": {"routing": {"prefill": "kv_aware"}},
                              "instances": [{"role": "prefill", "url": p.url,
                                             "kv_events": pub.endpoint},
                                            {"role": "decode", "url": d.url}]})


def heard(base: str, kind: str) -> float:
    return total(scrape(base), "epd_kv_events_total", kind=kind)


def publish_until_heard(base: str, pub: Publisher, payload: bytes) -> None:
    """Send ``payload`` until the worker counts a store: its subscription reaches the
    publisher some time after it connects, and what is sent before is lost."""
    for _ in range(100):
        pub.send(payload)
        if eventually(lambda: heard(base, "stored") > 0, 0.2):
            return
    raise AssertionError("the worker never heard the publisher")


def health_while(base: str, busy: Callable[[], bool]) -> list[float]:
    """How long each ``/health`` took, asked one after another while ``busy()``."""
    took = []
    while busy():
        started = time.monotonic()
        assert requests.get(base + "/health", timeout=60).status_code == 200
        took.append(time.monotonic() - started)
        gevent.sleep(0.02)
    return took


def test_ten_long_prompts_of_repeated_blocks_match_without_stalling_the_worker(
        procs, publisher: Publisher) -> None:
    """A worker started by a reload heard a conversation of one block repeated only as an
    orphan chain (its head was stored before it subscribed). Ten prompts of that block
    repeated 4,096 times at once: each would start a walk along the chain from every block,
    the square of its length, unless matching is one pass that hands the loop back."""
    blocks = 4096
    tokens = [7] * (blocks * BLOCK)
    gw = kv_proxy(procs, publisher, max_model_len=blocks * BLOCK + 64)
    publish_until_heard(gw.url, publisher,
                        batch(stored(list(range(1, blocks + 1)), 99999, tokens)))
    before = total(scrape(gw.url), "epd_routing_decisions_total", policy="kv_aware",
                   outcome="kvhit")

    def complete(_: int) -> int:
        return requests.post(gw.url + "/v1/completions", timeout=120, json={
            "model": "tiny-llama", "prompt": tokens, "max_tokens": 1}).status_code

    jobs = gevent.spawn(gevent.pool.Pool(10).map, complete, range(10))
    took = health_while(gw.url, lambda: not jobs.ready())
    assert jobs.get() == [200] * 10
    assert total(scrape(gw.url), "epd_routing_decisions_total", policy="kv_aware",
                 outcome="kvhit") == before + 10
    assert took and max(took) < STALLED, took


class Flood:
    """``tests/e2e/kvflood.py`` in its own process: the publisher of one prefill's events."""

    def __init__(self, stores: int) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.kvflood", "--endpoint", self.endpoint,
             "--stores", str(stores)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def flood(self, seconds: float) -> gevent.Greenlet:
        """Start flooding; the greenlet ends with the number of messages sent."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"flood {seconds}\n")
        self.proc.stdin.flush()
        out = self.proc.stdout  # gevent's: reading waits cooperatively
        return gevent.spawn(lambda: int(out.readline().split()[1]))

    def close(self) -> None:
        stop_group(self.proc)


@pytest.fixture
def floods() -> Iterator[Callable[[int], Flood]]:
    started: list[Flood] = []

    def start(stores: int) -> Flood:
        started.append(Flood(stores))
        return started[-1]

    yield start
    for f in started:
        f.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.parametrize("stores", [512, 10_000], ids=["512-stores", "10000-stores"])
def test_a_flooding_publisher_never_stalls_the_worker_nor_grows_it(
        procs, floods, stores: int) -> None:
    """A publisher sending messages of ``stores`` one-block stores as fast as it can, for
    8 s. The worker answers every /health at once throughout, its memory stays bounded, and
    the picture it could not keep up with is not routed by. 512 stores a message are read
    at a share of a core, the rest dropped and counted (the picture is stale meanwhile); a
    message of 10,000 (~2 MB) is over the frame bound, and ZMQ drops the connection."""
    flood = floods(stores)
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode")
    gw = procs["gunicorn"]({"settings": {"routing": {"prefill": "kv_aware"}},
                            "instances": [{"role": "prefill", "url": p.url,
                                           "kv_events": flood.endpoint},
                                          {"role": "decode", "url": d.url}]})
    assert eventually(lambda: heard(gw.url, "stored") > 0, 20)
    (worker,) = gw.workers()
    rss_before = rss_mb(worker)
    flooding = flood.flood(8)
    took: list[float] = []
    rss: list[float] = []
    asked = 0
    while not flooding.ready():
        started = time.monotonic()
        assert requests.get(gw.url + "/health", timeout=60).status_code == 200
        took.append(time.monotonic() - started)
        rss.append(rss_mb(worker))
        if len(took) % 10 == 5:
            r = requests.post(gw.url + "/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": list(range(64)), "max_tokens": 1})
            assert r.status_code == 200, r.text
            asked += 1
        gevent.sleep(0.05)
    sent = flooding.get()
    assert gw.workers() == {worker}  # never killed for a missed heartbeat
    assert len(took) >= 20 and max(took) < STALLED, (max(took), len(took))
    assert max(rss) < rss_before + 200, (rss_before, max(rss))
    routed = re.findall(r"prefill:kv_aware\((\w+),", gw.log.read_text(errors="replace"))
    assert sent > 100 and asked and routed
    if stores == 512:
        assert heard(gw.url, "dropped") > 0
        assert "stale" in routed, routed
    else:
        assert "stale" not in routed and "noevents" in routed, routed


def test_one_worker_of_a_host_reads_the_kv_events_and_every_worker_routes_by_them(
        procs, publisher: Publisher) -> None:
    """Two workers: one subscribes and names the blocks, the other follows its picture
    through the state directory; requests either worker takes go where the prompt is
    cached."""
    p = procs["sim"]("prefill")
    other = procs["sim"]("prefill")
    d = procs["sim"]("decode")
    gw = procs["gunicorn"]({"settings": {"routing": {"prefill": "kv_aware"}},
                            "instances": [{"role": "prefill", "url": p.url,
                                           "kv_events": publisher.endpoint},
                                          {"role": "prefill", "url": other.url},
                                          {"role": "decode", "url": d.url}]}, workers=2)
    tokens = list(range(100, 100 + 4 * BLOCK))
    publish_until_heard(gw.url, publisher, batch(stored([1, 2, 3, 4], None, tokens)))
    readers = re.findall(r"\[(\d+)\] \[INFO\] [\w.]+: KV relay: this worker reads",
                         gw.log.read_text(errors="replace"))
    assert len(readers) == 1 and int(readers[0]) in gw.workers()

    by_blocks: set[str] = set()
    deadline = time.monotonic() + 60
    while len(by_blocks) < 2 and time.monotonic() < deadline:
        r = requests.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": tokens + [5] * BLOCK, "max_tokens": 1})
        assert r.status_code == 200, r.text
        by_blocks = set(re.findall(r"\[(\d+)\] .*prefill:kv_aware\(blocks=4/5,load=0\)",
                                   gw.log.read_text(errors="replace")))
    assert by_blocks == {str(pid) for pid in gw.workers()}
