"""Routing policies as pure functions and through the Router
(docs/behaviour.md#routing-policies)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from epd_flask.control.roster import Instance, Roster, RosterError, Settings, parse
from epd_flask.fleet import affinity, policies
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import Decision, Placement, RouteRequest
from epd_flask.fleet.routing import Router


def instances(n: int) -> list[Instance]:
    return [Instance(role="prefill", url=f"http://10.0.0.{i}:8100") for i in range(1, n + 1)]


def prefills(n: int) -> list[Placement]:
    return [Placement(i) for i in instances(n)]


def keys(n: int) -> list[bytes]:
    return [f"conversation-{i}".encode() for i in range(n)]


def owner(key: bytes, candidates: list[Placement]) -> str:
    return policies.rendezvous_order(key, candidates)[0].url


def test_rendezvous_is_the_same_in_another_process_with_another_hash_seed() -> None:
    """Every worker and host must agree with no coordination: a stable hash, not hash()."""
    here = [owner(k, prefills(5)) for k in keys(50)]
    code = ("import json; from tests.unit.test_policies import keys, owner, prefills; "
            "print(json.dumps([owner(k, prefills(5)) for k in keys(50)]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert json.loads(out.stdout) == here
    assert len(set(here)) == 5  # and it spreads


def test_a_joining_instance_takes_only_its_own_share() -> None:
    before, after = prefills(4), prefills(5)
    moved = [k for k in keys(2000) if owner(k, before) != owner(k, after)]
    # Every moved key went to the newcomer, and it took about 1/5 of them.
    assert all(owner(k, after) == after[-1].url for k in moved)
    assert 300 < len(moved) < 500


def test_a_leaving_instance_moves_only_the_keys_it_held() -> None:
    before = prefills(5)
    after = before[:2] + before[3:]
    moved = [k for k in keys(2000) if owner(k, before) != owner(k, after)]
    assert moved and all(owner(k, before) == before[2].url for k in moved)
    assert len(moved) == sum(owner(k, before) == before[2].url for k in keys(2000))


def test_bounded_load_spills_a_hot_key_to_its_next_instance() -> None:
    instances = prefills(4)
    key = b"one hot system prompt"
    order = policies.rendezvous_order(key, instances)
    load = Counter({order[0].url: 5})
    decision = policies.bounded_rendezvous(key, instances, lambda i: load[i.url], 1.25,
                                           "prefix")
    # bound = ceil(1.25 * 6 / 4) = 2: the owner holds 5, so its next in order takes it.
    assert decision.target == order[1] and decision.outcome == policies.SPILL
    assert decision.why == "spill1:5>=2"
    idle = policies.bounded_rendezvous(key, instances, lambda i: 0, 1.25, "prefix")
    assert idle.target == order[0] and idle.outcome == policies.HIT


def test_bounded_load_keeps_every_instance_under_the_bound_for_one_hot_key() -> None:
    instances = prefills(4)
    load: Counter[str] = Counter()
    for _ in range(40):  # 40 requests of one prefix, none finishing
        decision = policies.bounded_rendezvous(b"hot", instances, lambda i: load[i.url], 1.25,
                                               "prefix")
        load[decision.instance.url] += 1
    assert max(load.values()) <= 13  # ceil(1.25 * 40 / 4)
    assert len(load) == 4


def test_power_of_two_takes_the_less_loaded_of_its_draw() -> None:
    instances = prefills(2)
    load = {instances[0].url: 7, instances[1].url: 2}
    for seed in range(10):
        d = policies.power_of_two(instances, lambda i: load[i.url], random.Random(seed))
        assert d.target == instances[1] and d.why == "2<7"


def test_chat_prefix_key_is_stable_across_turns_and_differs_between_conversations() -> None:
    system = {"role": "system", "content": "You are terse. " * 50}
    turn1 = {"messages": [system, {"role": "user", "content": "what is rust?"}]}
    turn2 = {"messages": turn1["messages"] + [
        {"role": "assistant", "content": "a language"}, {"role": "user", "content": "and go?"}]}
    other = {"messages": [system, {"role": "user", "content": "what is zig?"}]}
    a1, a2, b = (affinity.route_request(x) for x in (turn1, turn2, other))
    assert a1.prefix == a2.prefix != b.prefix
    assert a2.prompt_tokens > a1.prompt_tokens > 150  # 750 characters of system prompt


def test_completion_prefix_key_uses_the_leading_blocks_only() -> None:
    head = "x" * (affinity.PREFIX_BLOCK_CHARS * affinity.PREFIX_BLOCKS)
    one = affinity.route_request({"prompt": head + "first question"})
    two = affinity.route_request({"prompt": head + "another question entirely"})
    short = affinity.route_request({"prompt": "hi"})
    assert one.prefix == two.prefix and short.prefix is not None
    assert affinity.route_request({"prompt": "a" * 400}).prompt_tokens == 100


def test_session_key_is_the_user_field() -> None:
    a = affinity.route_request({"prompt": "x", "user": "alice"})
    b = affinity.route_request({"prompt": "y", "user": "alice"})
    assert a.session == b.session is not None and a.prefix != b.prefix


def router_over(members: list[Instance], routing: dict[str, str]) -> Router:
    return Router(LiveFleet(Roster(settings=Settings(routing=routing),
                                   instances=tuple(members))), seed=0)


class Heard:
    """A request context's ``decided`` as far as these tests care: the log line's entries."""

    def __init__(self) -> None:
        self.decisions: list[str] = []

    def __call__(self, role: str, decision: Decision) -> None:
        self.decisions.append(decision.describe(role))


def pick(router: Router, role: str = "prefill", heard: Heard | None = None,
         **request: object) -> Placement:
    return router.pick(role, RouteRequest(**request), heard or Heard())  # type: ignore[arg-type]


def test_router_prefix_picks_the_same_instance_and_logs_why() -> None:
    router = router_over(instances(4), {"prefill": "prefix"})
    picks = set()
    for _ in range(5):
        heard = Heard()
        picks.add(pick(router, heard=heard, prefix=b"conversation").url)
        assert heard.decisions == ["prefill:prefix(hit)"]
    assert len(picks) == 1


def test_router_prefix_without_a_key_rotates_and_kv_aware_without_events_as_prefix() -> None:
    router = router_over(instances(3), {"prefill": "kv_aware"})
    assert len({pick(router).url for _ in range(3)}) == 3
    heard = Heard()
    chosen = pick(router, heard=heard, prefix=b"k")
    assert chosen == policies.rendezvous_order(b"k", prefills(3))[0]
    assert heard.decisions == ["prefill:kv_aware(noevents,hit)"]


def test_router_least_loaded_reads_the_registry_in_flight_count() -> None:
    router = router_over(instances(2), {"prefill": "least_loaded"})
    registry = router.live.registry
    busy = instances(2)[0].url
    for _ in range(3):
        registry.track(busy, +1)
    assert {pick(router).url for _ in range(10)} == {instances(2)[1].url}
    for _ in range(3):
        registry.track(busy, -1)
    assert registry.get(busy).in_flight == 0


@pytest.mark.parametrize("routing", [
    {"prefill": "fastest"}, {"prefil": "prefix"}, "prefix", {"decode": 3}])
def test_unknown_policy_or_role_is_a_roster_error(routing: object) -> None:
    with pytest.raises(RosterError) as info:
        parse({"settings": {"routing": routing}, "instances": []})
    assert "routing" in str(info.value)


def test_known_policies_parse() -> None:
    roster = parse({"settings": {"routing": {"prefill": "prefix", "decode": "least_loaded",
                                             "encode": "round_robin"},
                                 "disaggregate_min_prompt_tokens": 64}, "instances": []})
    assert roster.settings.routing["prefill"] == "prefix"
    with pytest.raises(RosterError):
        parse({"settings": {"routing_load_factor": 0.5}, "instances": []})


def test_conversations_of_one_system_prompt_stay_on_half_the_instances() -> None:
    instances = prefills(4)
    system = b"one system prompt"
    homes = {policies.tiered_order(system, k, instances, 0.5)[0].url for k in keys(200)}
    assert len(homes) == 2  # each of those computes the system prompt; the other two never
    other = {policies.tiered_order(b"another", k, instances, 0.5)[0].url for k in keys(200)}
    assert len(other) == 2
    # Each conversation still has one home, the same in every call.
    assert all(policies.tiered_order(system, k, instances, 0.5)
               == policies.tiered_order(system, k, instances, 0.5) for k in keys(20))


def test_chat_shared_key_is_the_system_prompt() -> None:
    system = {"role": "system", "content": "be brief"}
    a = affinity.route_request({"messages": [system, {"role": "user", "content": "a"}]})
    b = affinity.route_request({"messages": [system, {"role": "user", "content": "b"}]})
    bare = affinity.route_request({"messages": [{"role": "user", "content": "a"}]})
    assert a.shared == b.shared is not None and a.prefix != b.prefix and bare.shared is None


def test_prefill_load_is_prompt_tokens_in_flight_and_decode_load_is_calls() -> None:
    """One long prompt queued outweighs several short ones on a prefill; on a decode every
    stream counts one whatever its prompt."""
    router = router_over([*instances(2), Instance(role="decode", url="http://10.0.0.9:8200"),
                          Instance(role="decode", url="http://10.0.0.8:8200")],
                         {"prefill": "least_loaded", "decode": "least_loaded"})
    registry = router.live.registry
    short, long = (i.url for i in instances(2))
    for _ in range(3):
        registry.track(short, +1, tokens=20)
    registry.track(long, +1, tokens=3000)
    load = router.load("prefill")
    assert load.measure(instances(2)[0]) == 63 and load.measure(instances(2)[1]) == 3001
    assert load.calls(instances(2)[0]) == 3 and load.calls(instances(2)[1]) == 1
    assert {pick(router).url for _ in range(10)} == {short}
    registry.track("http://10.0.0.9:8200", +1, tokens=3000)
    for _ in range(3):
        registry.track("http://10.0.0.8:8200", +1, tokens=20)
    assert {pick(router, "decode").url for _ in range(10)} == {"http://10.0.0.9:8200"}
    registry.track(long, -1, tokens=3000)
    assert registry.get(long).in_flight == 0 and registry.get(long).tokens_in_flight == 0


def test_prefix_bound_stays_in_calls_on_a_prefill() -> None:
    """The affinity policies bound calls, not tokens: a prefix's instance holding one long
    prompt and fewer calls than the others keeps its key."""
    router = router_over(instances(3), {"prefill": "prefix"})
    registry = router.live.registry
    order = policies.rendezvous_order(b"hot", prefills(3))
    registry.track(order[0].url, +1, tokens=5000)
    for other in order[1:]:
        for _ in range(2):
            registry.track(other.url, +1, tokens=10)
    heard = Heard()
    assert pick(router, heard=heard, prefix=b"hot", prompt_tokens=100) == order[0]
    assert heard.decisions == ["prefill:prefix(hit)"]
