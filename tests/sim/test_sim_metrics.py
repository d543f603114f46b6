"""The simulator's ``GET /metrics``: vLLM 0.32's scheduler gauges (requests running, requests
waiting, KV cache usage) with vLLM's names and labels, following the cost model's queue."""

from __future__ import annotations

import gevent
import requests

from epd_flask.sim.costmodel import EngineClock
from tests.bodies import completion
from tests.helpers import eventually

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def gauges(url: str) -> dict[str, float]:
    r = requests.get(url + "/metrics", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line.startswith("vllm:"):
            series, _, value = line.rpartition(" ")
            assert series.endswith('{model_name="tiny-llama",engine="0"}'), series
            out[series.partition("{")[0]] = float(value)
    return out


def test_an_idle_server_reports_nothing_running_or_waiting(start_sim) -> None:
    sim = start_sim(role="prefill")
    assert gauges(sim.url) == dict.fromkeys(GAUGES, 0.0)
    text = requests.get(sim.url + "/metrics", timeout=5).text
    assert "# TYPE vllm:num_requests_waiting gauge" in text


def test_queued_prefills_wait_and_the_one_computing_runs(start_sim) -> None:
    sim = start_sim(role="prefill", prefill_tokens_per_s=2000.0, max_model_len=4096,
                    kv_cache_blocks=1000)
    prompts = [f"{i} " + "word " * 800 for i in range(3)]  # ~1000 tokens each: ~0.5 s apiece
    calls = [gevent.spawn(requests.post, sim.url + "/v1/completions", timeout=10,
                          json=completion(p, max_tokens=1)) for p in prompts]
    seen = eventually(lambda: (g := gauges(sim.url))["vllm:num_requests_waiting"] == 2 and g,
                      what="two prefills queued behind the first")
    assert seen["vllm:num_requests_running"] == 1
    assert 0.15 < seen["vllm:kv_cache_usage_perc"] < 0.35  # ~3 x 63 blocks of 1000
    gevent.joinall(calls, timeout=10)
    assert all(c.value.status_code == 200 for c in calls)
    assert eventually(lambda: gauges(sim.url) == dict.fromkeys(GAUGES, 0.0),
                      what="the queue drained")


def test_the_clock_counts_prefills_not_started_and_blocks_held() -> None:
    clock = EngineClock()
    clock.prefill(1000, 1000.0, now=10.0)  # 10.0 to 11.0
    clock.prefill(500, 1000.0, now=10.0)  # waits until 11.0
    clock.hold(40, until=11.5)
    clock.hold(2, until=10.5)
    assert clock.waiting(now=10.2) == 1 and clock.blocks_held(now=10.2) == 42
    assert clock.waiting(now=11.1) == 0 and clock.blocks_held(now=11.1) == 40
    assert abs(clock.backlog(now=10.5) - 1.0) < 1e-9
    clock.reset()
    assert clock.waiting(now=0.0) == 0 and clock.blocks_held(now=0.0) == 0


def test_a_more_urgent_prompt_overtakes_the_waiting_ones_not_the_one_computing() -> None:
    """vLLM's priority policy orders its waiting queue by (priority, arrival); a prefill that
    started keeps its place (docs/behaviour.md#admission 11)."""
    clock = EngineClock()
    computing = clock.queue(1000, 1000.0, 1, now=10.0)  # 10.0 to 11.0
    low = clock.queue(1000, 1000.0, 1, now=10.1)  # would run 11.0 to 12.0
    high = clock.queue(500, 1000.0, -1, now=10.2)
    assert (computing.end, high.start, high.end, low.end) == (11.0, 11.0, 11.5, 12.5)
    same = clock.queue(100, 1000.0, -1, now=10.3)  # arrival order within a priority
    assert same.start == high.end and abs(low.end - 12.6) < 1e-9
    assert clock.waiting(now=11.2) == 2 and abs(clock.backlog(now=11.2) - 1.4) < 1e-9


def test_first_come_first_served_prefills_keep_arrival_order() -> None:
    clock = EngineClock()
    jobs = [clock.queue(1000, 1000.0, 0, now=10.0 + 0.1 * n) for n in range(3)]
    assert [j.end for j in jobs] == [11.0, 12.0, 13.0]
