"""Mooncake under a routing policy against real vLLM (docs/behaviour.md#routing): two Mooncake
prefills with prefix caching, one decode, epd-flask under gunicorn in front.

The prefill's policy chooses among the (prefill, rank) pairs the proxy discovered from each
bootstrap server. With ``prefix``, both turns of a conversation run on one prefill and the
second turn's prompt is served from that prefill's cache (the prefill reports it in its
answer's usage, which the proxy counts per prefill); with ``round_robin`` the turns
alternate and the second finds nothing cached.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import scrape, total
from tests.rosters import roster
from tests.vllm.test_kv_routing import BLOCK, conversation, prefills_of, turn

pytestmark = pytest.mark.vllm

WARM_UP_ATTEMPTS = 8


def start_proxy(fleet: Any, policy: str) -> Any:
    return fleet.proxy(roster(
        [(p, {"bootstrap_url": p.bootstrap_url}) for p in prefills_of(fleet)],
        [fleet.current.by_role("decode")], connector="mooncake", decode_retries=0,
        routing={"prefill": policy}))


@pytest.fixture(scope="module")
def pair(fleet):
    """The topology, with the decode's first transfer from each prefill done (a first
    Mooncake transfer between two engines is slow on this CPU machine): round-robin until
    both prefills served one request (bounded)."""
    fleet.up("mooncake-pair")
    prefills = prefills_of(fleet)
    proxy = start_proxy(fleet, "round_robin")
    served: set[str] = set()
    for attempt in range(WARM_UP_ATTEMPTS):
        url, _, _ = turn(proxy, prefills, conversation(f"mooncake warm-up {attempt}")[0])
        served.add(url)
        if served == {p.url for p in prefills}:
            break
    proxy.stop()
    assert served == {p.url for p in prefills}, f"only {served} served after warming up"
    return fleet


Turn = tuple[str, float, int]


def two_turns(pair: Any, policy: str) -> tuple[Any, Turn, Turn]:
    """A conversation's two turns through a proxy routing prefills by ``policy``: the proxy,
    and per turn (the prefill that served it, its cached tokens, its prompt tokens)."""
    prefills = prefills_of(pair)
    proxy = start_proxy(pair, policy)
    turn1, turn2 = conversation(f"mooncake {policy}")
    first = turn(proxy, prefills, turn1)
    second = turn(proxy, prefills, turn2)
    print(f"\nmooncake {policy}: turn 1 {first}, turn 2 {second}")
    return proxy, first, second


def test_prefix_keeps_a_conversation_on_one_mooncake_prefill(pair):
    proxy, first, second = two_turns(pair, "prefix")
    shared_blocks = first[2] // BLOCK
    assert shared_blocks >= 4, first
    assert second[0] == first[0]
    assert second[1] >= shared_blocks * BLOCK - BLOCK  # vLLM recomputes the last block
    # The prefill's own answer reported it, and the proxy counted it for that prefill.
    samples = scrape(proxy.url)
    assert total(samples, "epd_prefill_cached_tokens_total", instance=first[0]) >= second[1]
    log = proxy.log_text()
    assert log.count("prefill:prefix(hit)") >= 2, log[-3000:]
    proxy.stop()


def test_round_robin_alternates_mooncake_prefills(pair):
    proxy, first, second = two_turns(pair, "round_robin")
    assert second[0] != first[0] and second[1] == 0
    proxy.stop()
