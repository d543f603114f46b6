"""Encoder topology: the roster's EC consumer rules (docs/behaviour.md#roster), encoder settings,
and how encoders and replicas are picked (docs/behaviour.md#routing)."""

from __future__ import annotations

import pytest

from epd_flask.control.roster import Instance, Roster, RosterError, Settings, parse
from epd_flask.core.errors import NoBackend
from epd_flask.fleet import policies
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import Decision, RouteRequest
from epd_flask.fleet.routing import Router

ADDRS = ["tcp://10.0.0.1:17000", "tcp://10.0.0.1:17001"]


def pd(url: str, **extra: object) -> dict[str, object]:
    return {"role": "prefill_decode", "url": url, **extra}


def test_e_pd_with_mooncake_consumers_is_accepted() -> None:
    roster = parse({"instances": [
        {"role": "encode", "url": "http://e:1"},
        pd("http://a:1", dp_size=2, ec_zmq_addrs=ADDRS),
        pd("http://b:1", ec_zmq_addrs=["tcp://b:1"]),
    ]})
    assert roster.by_role("prefill_decode")[0].ec_zmq_addrs == tuple(ADDRS)


def test_e_p_d_with_mooncake_consumers_on_the_prefills_is_accepted() -> None:
    """E+P+D: the prefill computes the prompt, so it is the replica encoders push to."""
    roster = parse({"instances": [
        {"role": "encode", "url": "http://e:1"},
        {"role": "prefill", "url": "http://p:1", "dp_size": 2, "ec_zmq_addrs": ADDRS},
        {"role": "decode", "url": "http://d:1"},
    ]})
    assert roster.by_role("prefill")[0].ec_zmq_addrs == tuple(ADDRS)


@pytest.mark.parametrize("instances, words", [
    ([{"role": "prefill", "url": "http://p:1"},
      {"role": "decode", "url": "http://d:1", "ec_zmq_addrs": ["tcp://d:1"]}],
     ["http://d:1 (decode)", "prefill instances (E+P+D)"]),
    ([{"role": "prefill", "url": "http://p:1", "ec_zmq_addrs": ["tcp://p:1"]},
      {"role": "prefill", "url": "http://q:1"}, {"role": "decode", "url": "http://d:1"}],
     ["http://q:1", "every prefill instance"]),
    ([{"role": "encode", "url": "http://e:1", "ec_zmq_addrs": ["tcp://e:1"]}],
     ["http://e:1 (encode)"]),
    # some consumers pushable, some not: a request could land where nothing was addressed
    ([pd("http://a:1", ec_zmq_addrs=["tcp://a:1"]), pd("http://b:1")],
     ["http://b:1", "every prefill_decode"]),
])
def test_topologies_that_cannot_route_ec_handles_are_refused(instances, words) -> None:
    with pytest.raises(RosterError) as info:
        parse({"instances": instances}, "r.yaml")
    for word in words:
        assert word in str(info.value)


def test_encoder_settings_defaults_and_bounds() -> None:
    s = Settings()
    assert (s.encoder_max_batch_size, s.encoder_concurrency, s.encoder_timeout,
            s.rewrite_media) == (0, 8, 300.0, True)
    for bad in ({"encoder_concurrency": 0}, {"encoder_timeout": 0},
                {"encoder_max_batch_size": -1}):
        with pytest.raises(RosterError, match=next(iter(bad))):
            parse({"settings": bad})


def encoders(*ports: int) -> list[Instance]:
    return [Instance(role="encode", url=f"http://127.0.0.1:{p}") for p in ports]


def router_over(instances: list[Instance]) -> Router:
    return Router(LiveFleet(Roster(instances=tuple(instances))), seed=0)


def nobody(role: str, decision: Decision) -> None:
    return None


def test_encoder_assignment_continues_across_requests() -> None:
    router = router_over(encoders(1, 2, 3))
    first = [p.url[-1] for p in router.pick_each("encode", [b"a", b"b"], RouteRequest(), nobody)]
    second = [p.url[-1] for p in router.pick_each("encode", [b"c", b"d", b"e", b"f"],
                                                  RouteRequest(), nobody)]
    assert first == ["1", "2"] and second == ["3", "1", "2", "3"]
    # One cursor per role, shared with single picks.
    assert router.pick("encode", RouteRequest(), nobody).url[-1] == "1"


def test_each_item_decision_is_recorded_and_prefix_keeps_one_image_on_one_encoder() -> None:
    router = Router(LiveFleet(Roster(settings=Settings(routing={"encode": "prefix"}),
                                     instances=tuple(encoders(1, 2, 3)))), seed=0)
    heard: list[str] = []

    def record(role: str, decision: Decision) -> None:
        heard.append(decision.describe(role))

    images = [b"image a", b"image b", b"image c"]
    router.pick_each("encode", images, RouteRequest(), record)
    assert len(heard) == 3 and all(h.startswith("encode:prefix(") for h in heard)
    for key in images:  # later requests with one of those images meet its encoder's cache
        again = router.pick_each("encode", [key], RouteRequest(), record)[0]
        assert again == policies.rendezvous_order(
            key, policies.candidates_of(encoders(1, 2, 3)))[0]
    assert heard[-1] == "encode:prefix(hit)"


def test_pick_each_without_live_encoders_is_a_503() -> None:
    with pytest.raises(NoBackend, match="encode"):
        router_over([]).pick_each("encode", [b"x"], RouteRequest(), nobody)


def test_push_consumers_offer_each_replica_as_a_candidate() -> None:
    """An instance whose replicas encoders push to (``ec_zmq_addrs``) is one candidate per
    replica, so its policy picks the replica; any other instance is one candidate."""
    a = Instance(role="prefill_decode", url="http://a:1", dp_size=3,
                 ec_zmq_addrs=("a:1", "a:2", "a:3"))
    b = Instance(role="prefill_decode", url="http://b:1", dp_size=2, ec_zmq_addrs=("b:1", "b:2"))
    plain = Instance(role="prefill_decode", url="http://c:1", dp_size=2)
    assert [(p.url, p.dp_rank) for p in policies.candidates_of([a, b, plain])] == [
        (a.url, 0), (a.url, 1), (a.url, 2), (b.url, 0), (b.url, 1), (plain.url, None)]
    router = router_over([a, b])
    picks = [(p.url, p.dp_rank)
             for p in (router.pick("prefill_decode", RouteRequest(), nobody) for _ in range(6))]
    assert picks == [(a.url, 0), (a.url, 1), (a.url, 2), (b.url, 0), (b.url, 1), (a.url, 0)]
