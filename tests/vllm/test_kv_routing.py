"""Cache-aware routing against real vLLM (docs/behaviour.md#routing-policies): two NIXL
prefills with prefix caching, one decode, epd-flask under gunicorn in front.

One two-turn conversation, sent several times per policy: with ``prefix`` and ``kv_aware``
every second turn lands on the prefill that computed the first and that prefill serves the
shared blocks from its cache every time; with ``round_robin`` it does not every time. The
``kv_aware`` proxy builds its picture from the prefills' real KV-cache events (ZMQ, msgpack)
and names the matched blocks in its log.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.helpers import eventually, scrape
from tests.rosters import roster
from tests.vllm.checks import CACHED, EXTERNAL, LOCAL, METRICS_SETTLE_SECONDS, post
from tests.vllm.fleet import MODEL_NAME, VllmServer

pytestmark = pytest.mark.vllm

REPEATS = 3
WARM_UP_ATTEMPTS = 8
BLOCK = 32
#: ~150 tokens: several 32-token blocks both turns share.
SYSTEM = ("You are a patient teacher of marine biology. You answer in plain words, give one "
          "example from the North Sea and one from a coral reef, never use lists, and end "
          "with a short question that checks the student understood. ") * 2


def conversation(tag: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Turns 1 and 2 of one conversation; ``tag`` leads it so each policy's is new to every
    cache (an earlier policy's run cannot have warmed it)."""
    turn1 = [{"role": "system", "content": f"[{tag}] {SYSTEM}"},
             {"role": "user", "content": "Why do fish school together?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "For safety: a predator confuses many."},
             {"role": "user", "content": "And do whales do the same?"}]
    return turn1, turn2


def prefill_tokens(prefills: list[VllmServer]) -> dict[str, dict[str, float]]:
    return {p.url: p.metrics() for p in prefills}


def settled(prefills: list[VllmServer], before: dict[str, dict[str, float]],
            prompt_tokens: int) -> dict[str, tuple[float, float]]:
    """Per prefill, (prompt tokens accounted, of which served from its cache) since
    ``before``, once one of them has accounted for the request (counters trail answers)."""
    out: dict[str, tuple[float, float]] = {}

    def accounted() -> bool:
        for p in prefills:
            now, then = p.metrics(), before[p.url]
            seen = sum(now.get(k, 0) - then.get(k, 0) for k in (EXTERNAL, LOCAL, CACHED))
            out[p.url] = (seen, now.get(CACHED, 0) - then.get(CACHED, 0))
        return any(seen >= prompt_tokens for seen, _ in out.values())
    eventually(accounted, METRICS_SETTLE_SECONDS, interval=0)
    return out


def prefills_of(fleet: Any) -> list[VllmServer]:
    return [s for s in fleet.current.servers if s.role == "prefill"]


def start_proxy(fleet: Any, policy: str) -> Any:
    proxy = fleet.proxy(roster(
        [(p, {"kv_events": f"tcp://127.0.0.1:{p.kv_events_port}"}) for p in prefills_of(fleet)],
        [fleet.current.by_role("decode")], connector="nixl", decode_retries=0,
        routing={"prefill": policy}))
    time.sleep(1.0)  # the workers' subscribers connect (ZMQ drops what they miss)
    return proxy


def warm_up(fleet: Any) -> None:
    """Let the decode finish its first NIXL handshake with each prefill before any test
    measures routing. On this CPU machine a first handshake takes ~30 s, at the edge of
    vLLM's own limit when the machine is busy, and a request caught by a failed one is
    answered 500 by the decode (seen once in a full tier run); the next request to that
    prefill handshakes again. Round-robin alternates the two prefills, so each is tried in
    turn until both have served one request (bounded)."""
    prefills = prefills_of(fleet)
    proxy = start_proxy(fleet, "round_robin")
    served: set[str] = set()
    for attempt in range(WARM_UP_ATTEMPTS):
        turn1, _ = conversation(f"warm-up {attempt}")
        before = prefill_tokens(prefills)
        reply = post(proxy.url, "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": turn1, "max_tokens": 1, "temperature": 0})
        if reply.status == 200:
            per = settled(prefills, before, reply.json["usage"]["prompt_tokens"])
            served.add(max(per, key=lambda u: per[u][0]))
        if served == {p.url for p in prefills}:
            break
    proxy.stop()
    assert served == {p.url for p in prefills}, f"only {served} served after warming up"


def turn(proxy: Any, prefills: list[VllmServer],
         messages: list[dict[str, str]]) -> tuple[str, float, int]:
    """One turn through ``proxy``: (the prefill that computed it, tokens it served from its
    cache, prompt tokens)."""
    before = prefill_tokens(prefills)
    reply = post(proxy.url, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert reply.status == 200, reply.raw
    prompt = reply.json["usage"]["prompt_tokens"]
    per = settled(prefills, before, prompt)
    url = max(per, key=lambda u: per[u][0])
    return url, per[url][1], prompt


def run(fleet: Any, policy: str) -> tuple[list[tuple[str, float, int]], Any]:
    """Each turn's (prefill that computed it, tokens it served from cache, prompt tokens)."""
    prefills = prefills_of(fleet)
    proxy = start_proxy(fleet, policy)
    turns = [turn(proxy, prefills, messages)
             for _ in range(REPEATS) for messages in conversation(policy)]
    return turns, proxy


@pytest.fixture(scope="module")
def kv_fleet(fleet):
    fleet.up("kv")
    warm_up(fleet)
    return fleet


@pytest.mark.parametrize("policy", ["prefix", "kv_aware"])
def test_the_second_turn_lands_where_the_first_is_cached(kv_fleet, policy):
    turns, proxy = run(kv_fleet, policy)
    first, second = turns[0::2], turns[1::2]
    shared_blocks = first[0][2] // BLOCK
    assert shared_blocks >= 4, first
    for (url1, _, _), (url2, cached, _) in zip(first, second, strict=True):
        assert url2 == url1, turns
        assert cached >= shared_blocks * BLOCK - BLOCK, turns  # vLLM recomputes the last
    if policy == "kv_aware":
        log = proxy.log_text()
        held = [int(m) for m in re.findall(r"prefill:kv_aware\(blocks=(\d+)/\d+", log)]
        assert held and max(held) >= shared_blocks - 1, log[-3000:]
        stored = sum(v for (name, labels), v in scrape(proxy.url).items()
                     if name == "epd_kv_events_total" and ("kind", "stored") in labels)
        assert stored > 0
    print(f"{policy}: {turns}")
    proxy.stop()


def test_round_robin_does_not_find_the_cache_every_time(kv_fleet):
    turns, proxy = run(kv_fleet, "round_robin")
    second = turns[1::2]
    assert any(cached == 0 for _, cached, _ in second), turns
    assert {url for url, _, _ in turns} == {s.url for s in kv_fleet.current.servers
                                            if s.role == "prefill"}
    print(f"round_robin: {turns}")
    proxy.stop()
