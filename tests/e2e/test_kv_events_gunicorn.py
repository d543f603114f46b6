"""``kv_aware`` under real gunicorn (one gevent worker) against what a hostile or merely large
fleet sends it: the worker keeps answering ``/health`` at once while its KV-event readers and
its matching work (docs/behaviour.md#routing-policies).

A worker's event loop serves every request it holds, so a reader or a match that keeps the CPU
for seconds stalls them all, and past gunicorn's timeout the master kills the worker. The time
bounds below are ones only such a stall breaks: a healthy worker answers ``/health`` in
milliseconds, a stalled one took tens of seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import gevent.pool
import pytest
import requests

from tests.helpers import eventually, scrape, total
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
