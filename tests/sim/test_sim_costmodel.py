"""The simulator's cost model (epd_flask/sim/costmodel.py): off by default, and when
configured, prefill time follows uncached tokens and the queue, inter-token time follows the
running streams."""

from __future__ import annotations

import time

import gevent
import requests

from epd_flask.sim.costmodel import EngineClock
from tests.bodies import completion, conversation
from tests.helpers import eventually

SYSTEM = "You are a careful assistant who explains caches. " * 40  # ~500 tokens
OTHER = "Queues form where work arrives faster than it leaves. " * 37  # as long, not shared


def test_prefills_queue_through_one_token_budget() -> None:
    clock = EngineClock()
    first = clock.prefill(15000, 15000.0, now=100.0)
    second = clock.prefill(7500, 15000.0, now=100.0)
    assert first == 1.0 and second == 1.5  # the second waits for the first
    assert clock.prefill(0, 15000.0, now=100.0) == 0.0  # nothing to compute: no wait
    later = clock.prefill(1500, 15000.0, now=200.0)  # the queue drained meanwhile
    assert abs(later - 0.1) < 1e-9


def test_inter_token_time_grows_with_running_streams() -> None:
    clock = EngineClock()
    assert clock.inter_token(0.008, 0.001, now=0.0) == 0.008
    for _ in range(10):
        clock.stream_until(5.0)
    assert abs(clock.inter_token(0.008, 0.001, now=1.0) - 0.018) < 1e-9
    assert clock.inter_token(0.008, 0.001, now=6.0) == 0.008  # they ended


def test_inter_token_time_grows_with_the_context_the_running_streams_hold() -> None:
    """A decode step reads every running stream's KV: ten 1,500-token streams cost what one
    15,000-token stream does, and nothing once they ended."""
    short, long = EngineClock(), EngineClock()
    for _ in range(10):
        short.stream_until(5.0, 1500)
    long.stream_until(5.0, 15000)
    per_token = 1e-7
    assert abs(short.inter_token(0.008, 0.0, 1.0, per_token) - 0.0095) < 1e-9
    assert abs(long.inter_token(0.008, 0.0, 1.0, per_token) - 0.0095) < 1e-9
    assert short.inter_token(0.008, 0.0, 6.0, per_token) == 0.008


def ask(url: str, content: str) -> tuple[float, dict]:
    started = time.monotonic()
    r = requests.post(url + "/v1/chat/completions", timeout=10, json=conversation(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        max_tokens=2))
    assert r.status_code == 200, r.text
    return time.monotonic() - started, r.json()["usage"]


def test_a_cached_prefix_answers_sooner_and_reports_cached_tokens(start_sim) -> None:
    sim = start_sim(role="prefill_decode", prompt_tokens_details=True, max_model_len=4096,
                    prefill_tokens_per_s=2000.0, token_delay=0.001)
    cold, usage = ask(sim.url, "first question")
    assert usage["prompt_tokens"] > 400 and usage["prompt_tokens_details"] is None
    warm, usage = ask(sim.url, "second question")
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 400
    assert cold > 0.2 > warm  # ~500 uncached tokens at 2000/s, then ~10
    stats = sim.state.stats()
    assert stats["prefix_cached_tokens"] >= 400 and stats["prefix_computed_tokens"] > 500


def test_a_long_stream_running_slows_the_steps_of_a_request_by_its_context(start_sim) -> None:
    """Through HTTP: with a cost per token of context, a short answer started while a long
    one runs takes its steps at the base time plus that one's context, and alone the base."""
    sim = start_sim(role="prefill_decode", max_model_len=8192, prefill_tokens_per_s=1e9,
                    token_delay=0.001, token_delay_per_context_token=1e-4,
                    output_tokens=2000)

    def short() -> float:
        started = time.monotonic()
        r = requests.post(sim.url + "/v1/completions", timeout=10,
                          json=completion("a short one", max_tokens=5))
        assert r.status_code == 200, r.text
        return time.monotonic() - started

    alone = short()
    long = gevent.spawn(requests.post, sim.url + "/v1/completions", timeout=30,
                        json=completion(SYSTEM, max_tokens=2000))
    try:
        eventually(lambda: sim.state.engine.running() == 1, what="the long answer running")
        beside = short()  # its 4 steps each read ~1,500 tokens of the long one's KV: +0.15 s
    finally:
        long.kill()
    assert beside - alone > 0.3, (alone, beside)


def test_without_the_cost_model_a_combined_instance_caches_nothing(start_sim) -> None:
    sim = start_sim(role="prefill_decode", prompt_tokens_details=True, max_model_len=4096)
    for question in ("one", "two"):
        elapsed, usage = ask(sim.url, question)
        assert usage["prompt_tokens_details"] is None and elapsed < 1.0
    assert sim.state.stats()["prefix_computed_tokens"] == 0


def test_the_prefix_cache_evicts_least_recently_used_blocks(start_sim) -> None:
    sim = start_sim(role="prefill_decode", prompt_tokens_details=True, max_model_len=4096,
                    prefill_tokens_per_s=1e9, kv_cache_blocks=40)
    ask(sim.url, "a")
    requests.post(sim.url + "/v1/completions", timeout=10,
                  json=completion("z" * 4000, max_tokens=1))  # 62 blocks evict it
    _, usage = ask(sim.url, "b")
    assert usage["prompt_tokens_details"] is None


def test_a_streams_record_says_when_the_cost_model_put_its_first_token_and_how_late_it_went(
        start_sim) -> None:
    """/sim/requests: a stream queued behind another's prefill has its first token planned
    after both prompts, and the record tells that plan from the sim's own lateness."""
    sim = start_sim(role="prefill_decode", max_model_len=4096, prefill_tokens_per_s=2000.0,
                    token_delay=0.001)
    ahead = gevent.spawn(ask, sim.url, "ahead")
    eventually(lambda: sim.state.engine.backlog() > 0, what="the first prompt queued")
    r = requests.post(sim.url + "/v1/chat/completions", timeout=10, json=conversation(
        [{"role": "system", "content": OTHER}, {"role": "user", "content": "behind"}],
        max_tokens=2, stream=True))
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    ahead.get(timeout=10)
    records = requests.get(sim.url + "/sim/requests", timeout=5).json()
    streamed = [e for e in records if e["body"].get("stream")]
    plain = [e for e in records if not e["body"].get("stream")]
    assert len(streamed) == 1 and len(plain) == 1
    # ~500 uncached tokens each (no prefix shared) at 2000/s: its own 0.25 s after the
    # other's.
    assert 350 < streamed[0]["first_token_ms"] < 700, streamed[0]
    assert 0 <= streamed[0]["first_token_late_ms"] < 100, streamed[0]
    assert "first_token_ms" not in plain[0]
