"""Encoder topology: the roster's EC consumer rules (docs/behaviour.md#roster), encoder settings,
and the encoder rotation and replica cursors (docs/behaviour.md#routing)."""

from __future__ import annotations

import pytest

from epd_flask.control.roster import Instance, RosterError, Settings, parse
from epd_flask.core.errors import NoBackend
from epd_flask.fleet.registry import Registry
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


@pytest.mark.parametrize("instances, words", [
    # E+P+D: the push would have to name the prefill replica, and decode runs elsewhere
    ([{"role": "prefill", "url": "http://p:1", "ec_zmq_addrs": ["tcp://p:1"]},
      {"role": "decode", "url": "http://d:1"}], ["http://p:1 (prefill)", "E+PD"]),
    ([{"role": "prefill", "url": "http://p:1"},
      {"role": "decode", "url": "http://d:1", "ec_zmq_addrs": ["tcp://d:1"]}],
     ["http://d:1 (decode)", "prefill_decode"]),
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


def test_encoder_assignment_continues_across_requests() -> None:
    router = Router(Registry(encoders(1, 2, 3)))
    first = [i.url[-1] for i in router.pick_many("encode", 2)]
    second = [i.url[-1] for i in router.pick_many("encode", 4)]
    assert first == ["1", "2"] and second == ["3", "1", "2", "3"]
    assert router.pick("encode").url[-1] == "1"  # one cursor per role, shared


def test_pick_many_without_live_encoders_is_a_503() -> None:
    with pytest.raises(NoBackend, match="encode"):
        Router(Registry([])).pick_many("encode", 1)


def test_replicas_rotate_per_instance() -> None:
    a = Instance(role="prefill_decode", url="http://a:1", dp_size=3)
    b = Instance(role="prefill_decode", url="http://b:1", dp_size=2)
    single = Instance(role="prefill_decode", url="http://c:1")
    router = Router(Registry([a, b, single]))
    assert [router.next_replica(a) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.next_replica(b) for _ in range(3)] == [0, 1, 0]
    assert router.next_replica(single) == 0
