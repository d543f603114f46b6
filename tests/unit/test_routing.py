"""Round-robin cursors and the live/evicted registry (docs/behaviour.md#routing,
docs/behaviour.md#health-probes)."""

from __future__ import annotations

import pytest

from epd_flask.control.roster import Instance, Roster
from epd_flask.core.errors import NoBackend
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import RouteRequest
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.routing import Router


def decodes(*ports: int) -> list[Instance]:
    return [Instance(role="decode", url=f"http://127.0.0.1:{p}") for p in ports]


def router_over(instances: list[Instance]) -> Router:
    return Router(LiveFleet(Roster(instances=tuple(instances))), seed=0)


def pick(router: Router, role: str = "decode", **request: object) -> str:
    return router.pick(role, RouteRequest(**request), lambda role, decision: None).url  # type: ignore[arg-type]


def test_round_robin_visits_every_live_instance_in_turn() -> None:
    router = router_over(decodes(1, 2, 3))
    picks = [pick(router)[-1] for _ in range(6)]
    assert picks == ["1", "2", "3", "1", "2", "3"]


def test_cursor_survives_a_roster_change() -> None:
    router = router_over(decodes(1, 2, 3))
    assert [pick(router)[-1] for _ in range(2)] == ["1", "2"]
    router.live.adopt(Roster(instances=tuple(decodes(1, 2, 3, 4))), 1)
    # The rotation continues (index 2) instead of restarting at the first instance.
    assert pick(router)[-1] == "3"


def test_no_live_instance_is_a_503_naming_the_role() -> None:
    router = router_over([])
    with pytest.raises(NoBackend) as info:
        pick(router)
    assert info.value.status == 503
    assert "decode" in info.value.message


def test_exclude_prefers_other_instances_but_falls_back() -> None:
    router = router_over(decodes(1, 2))
    for _ in range(4):
        assert pick(router, exclude=frozenset({"http://127.0.0.1:1"})).endswith(":2")
    single = router_over(decodes(1))
    assert pick(single, exclude=frozenset({"http://127.0.0.1:1"})).endswith(":1")


def test_eviction_after_threshold_and_rejoin_on_first_success() -> None:
    registry = Registry(decodes(1, 2), fail_threshold=2)
    url = "http://127.0.0.1:1"
    registry.record_failure(url, "refused")
    assert len(registry.live("decode")) == 2
    registry.record_failure(url, "refused")
    assert [i.url for i in registry.live("decode")] == ["http://127.0.0.1:2"]
    assert registry.snapshot()["decode"]["evicted"] == [url]
    registry.record_success(url)
    assert len(registry.live("decode")) == 2


def test_success_resets_the_consecutive_count() -> None:
    registry = Registry(decodes(1), fail_threshold=2)
    url = "http://127.0.0.1:1"
    registry.record_failure(url, "x")
    registry.record_success(url)
    registry.record_failure(url, "x")
    assert registry.live("decode")


def test_late_result_does_not_resurrect_a_removed_instance() -> None:
    registry = Registry(decodes(1, 2))
    registry.replace(decodes(2))
    registry.record_success("http://127.0.0.1:1")
    registry.record_failure("http://127.0.0.1:1", "x")
    assert [i.url for i in registry.instances()] == ["http://127.0.0.1:2"]


def test_evicted_instances_are_forgotten_after_the_ttl() -> None:
    registry = Registry(decodes(1), fail_threshold=1, evicted_ttl=10)
    registry.record_failure("http://127.0.0.1:1", "x")
    evicted_at = registry.get("http://127.0.0.1:1").evicted_at
    assert registry.forget_expired(now=evicted_at + 5) == []
    assert registry.forget_expired(now=evicted_at + 11) == ["http://127.0.0.1:1"]
    assert registry.instances() == []


def test_ttl_zero_probes_forever() -> None:
    registry = Registry(decodes(1), fail_threshold=1, evicted_ttl=0)
    registry.record_failure("http://127.0.0.1:1", "x")
    assert registry.forget_expired(now=1e12) == []


def test_reload_keeps_health_of_instances_that_stay() -> None:
    registry = Registry(decodes(1, 2), fail_threshold=1)
    registry.record_failure("http://127.0.0.1:1", "x")
    registry.replace(decodes(1, 2, 3))
    assert not registry.get("http://127.0.0.1:1").live
    assert registry.get("http://127.0.0.1:3").live
