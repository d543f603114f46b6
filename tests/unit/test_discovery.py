"""Mooncake bootstrap answers, and the (prefill, rank) pairs as the prefill role's candidates
under its routing policy, without a network."""

from __future__ import annotations

import pytest

from epd_flask.control.roster import Instance, Roster, Settings
from epd_flask.core.errors import NoBackend
from epd_flask.fleet.bootstrap import (
    BootstrapAnswerError,
    BootstrapDiscovery,
    Engines,
    parse_query,
)
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import Decision, RouteRequest
from epd_flask.fleet.routing import Router

P1 = Instance(role="prefill", url="http://p1:8100", bootstrap_url="http://p1:8998")
P2 = Instance(role="prefill", url="http://p2:8100", bootstrap_url="http://p2:8998")
D = Instance(role="decode", url="http://d:8200")


def test_parse_todays_shape_by_rank() -> None:
    doc = {"1": {"engine_id": "e1", "worker_addr": {}}, "0": {"engine_id": "e0"}}
    assert parse_query(doc) == ("e0", "e1")


def test_parse_older_shape_keyed_by_engine_id() -> None:
    assert parse_query({"e-a": {"0": {"0": "tcp://h:1"}}, "e-b": {}}) == ("e-a", "e-b")
    assert parse_query({"e-a": {"dp_rank": 1}, "e-b": {"dp_rank": 0}}) == ("e-b", "e-a")


@pytest.mark.parametrize("doc", [{}, [], None, {"0": {"engine_id": "a"}, "2": {"engine_id": "b"}},
                                 {"0": {"worker_addr": {}}}, {"0": "e"}])
def test_unusable_answers_are_refused(doc) -> None:
    with pytest.raises(BootstrapAnswerError):
        parse_query(doc)


def discovery(*engines: tuple[Instance, tuple[str, ...]],
              routing: dict[str, str] | None = None) -> BootstrapDiscovery:
    settings = Settings(connector="mooncake", routing=routing or {})
    live = LiveFleet(Roster(settings=settings, instances=(P1, P2, D)))
    found = BootstrapDiscovery(live, transport=None)  # type: ignore[arg-type]
    for inst, ids in engines:
        found._engines[inst.url] = Engines(inst.bootstrap_url or "", ids)
    return found


def router(found: BootstrapDiscovery) -> Router:
    return Router(found.live, sources={"prefill": found}, seed=0)


def test_round_robin_over_prefill_rank_pairs() -> None:
    found = discovery((P1, ("a0", "a1")), (P2, ("b0",)))
    heard: list[str] = []

    def record(role: str, decision: Decision) -> None:
        heard.append(decision.describe(role))

    rr = router(found)
    picks = [(p.instance.url, p.dp_rank, p.engine_id)
             for p in (rr.pick("prefill", RouteRequest(), record) for _ in range(4))]
    assert picks == [(P1.url, 0, "a0"), (P1.url, 1, "a1"), (P2.url, 0, "b0"), (P1.url, 0, "a0")]
    away = RouteRequest(exclude=frozenset({P1.url}))
    assert {rr.pick("prefill", away, record).instance.url for _ in range(3)} == {P2.url}
    assert heard[-1] == "prefill:round_robin(rotation)"


def test_prefix_keeps_a_conversation_on_one_prefill_rank() -> None:
    """The prefill's policy chooses among the discovered pairs like among any candidates: a
    conversation's turns meet the KV its earlier turns left on one engine."""
    found = discovery((P1, ("a0", "a1")), (P2, ("b0", "b1")), routing={"prefill": "prefix"})
    rr = router(found)
    heard: list[str] = []
    homes = set()
    for _ in range(6):
        placed = rr.pick("prefill", RouteRequest(prefix=b"one conversation"),
                         lambda role, d: heard.append(d.describe(role)))
        homes.add((placed.instance.url, placed.dp_rank, placed.engine_id))
    assert len(homes) == 1 and heard == ["prefill:prefix(hit)"] * 6
    others = {rr.pick("prefill", RouteRequest(prefix=f"conversation {n}".encode()),
                      lambda role, d: None).engine_id for n in range(40)}
    assert others == {"a0", "a1", "b0", "b1"}  # conversations still spread over every engine


def test_no_discovered_engine_is_a_503_naming_the_role() -> None:
    found = discovery()
    with pytest.raises(NoBackend) as info:
        router(found).pick("prefill", RouteRequest(), lambda role, d: None)
    assert info.value.status == 503 and "Mooncake engine" in info.value.message


def test_ready_only_when_every_live_prefill_is_discovered() -> None:
    found = discovery((P1, ("a0",)))
    ok, reason = found.ready()
    assert not ok and reason == "Mooncake bootstrap of 1 live prefill(s) not discovered yet"
    assert P2.url not in reason  # /ready answers anyone
    for _ in range(3):
        found.live.registry.record_failure(P2.url, "down")  # evicted: no longer awaited
    assert found.ready() == (True, "ok")
    assert all(p.instance.url == P1.url for p in found.placements())


def test_a_rejoined_prefill_takes_no_traffic_until_asked_again() -> None:
    found = discovery((P1, ("a0",)), (P2, ("b0",)))
    for _ in range(3):
        found.live.registry.record_failure(P2.url, "down")
    found._was_live = {P1.url: True, P2.url: False}
    found._asked_at = {P1.url: float("inf"), P2.url: float("inf")}
    found.live.registry.record_success(P2.url)
    found._pool.map = lambda fn, items: None  # no network: only the bookkeeping is under test
    found.refresh_due()
    assert [p.engine_id for p in found.placements()] == ["a0"]
