"""The live fleet's merge of its sources (docs/behaviour.md#discovery): one URL is one
instance, the file's record wins, then admin, etcd, dns; what cannot be served is left out
and said once."""

from __future__ import annotations

import logging

import pytest

from epd_flask.control.roster import Instance, Roster, Settings, parse
from epd_flask.fleet.live import FleetView, LiveFleet


def inst(port: int, role: str = "decode", **fields: object) -> Instance:
    return Instance.model_validate({"role": role, "url": f"http://127.0.0.1:{port}", **fields})


def file_roster(*instances: Instance, **settings: object) -> Roster:
    return parse({"settings": settings, "instances": [i.record() for i in instances]})


def test_the_file_wins_a_url_over_every_source_and_the_conflict_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    live = LiveFleet(file_roster(inst(1), inst(2, "prefill")))
    caplog.set_level(logging.WARNING, "epd_flask.fleet.live")
    live.offer("dns", [inst(1, dp_size=8), inst(3, dp_size=2), inst(4)])
    live.offer("etcd", [inst(1, dp_size=4), inst(3, dp_size=3)])
    live.offer("admin", [inst(3, dp_size=5)])
    view = live.view
    by_url = {i.url: i for i in view.instances}
    assert by_url["http://127.0.0.1:1"].dp_size == 1  # the file's
    assert by_url["http://127.0.0.1:3"].dp_size == 5  # admin's over etcd's and dns'
    assert dict(view.sources) == {"http://127.0.0.1:1": "file", "http://127.0.0.1:2": "file",
                                  "http://127.0.0.1:3": "admin", "http://127.0.0.1:4": "dns"}
    said = [r.getMessage() for r in caplog.records]
    assert any("127.0.0.1:1 from etcd differs from the record file has" in m for m in said)
    assert any("127.0.0.1:3 from etcd differs from the record admin has" in m for m in said)
    before = len(said)
    live.offer("dns", [inst(1, dp_size=8), inst(3, dp_size=2), inst(4), inst(5)])
    assert len(caplog.records) == before  # the same conflicts are not said again
    # The file's instance leaves the file: the source's record is served from then on.
    live.adopt(file_roster(inst(2, "prefill")), 2)
    assert {i.url: i.dp_size for i in live.view.instances}["http://127.0.0.1:1"] == 4
    assert live.view.sources["http://127.0.0.1:1"] == "etcd"


def test_what_the_connector_cannot_use_or_would_mix_serving_is_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    live = LiveFleet(file_roster(inst(1), connector="mooncake"))
    caplog.set_level(logging.WARNING, "epd_flask.fleet.live")
    live.offer("etcd", [inst(2, "prefill"),
                        inst(3, "prefill", bootstrap_url="http://127.0.0.1:8998"),
                        inst(4, "prefill_decode")])
    assert [i.url for i in live.view.instances] == ["http://127.0.0.1:1", "http://127.0.0.1:3"]
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "instance http://127.0.0.1:2" in said and "left out (from etcd)" in said
    assert "http://127.0.0.1:4 (prefill_decode) would mix combined and split" in said


def test_subscribers_hear_each_swap_and_a_source_emptied_takes_its_instances_away() -> None:
    live = LiveFleet(Roster(settings=Settings()))
    heard: list[tuple[FleetView, FleetView]] = []
    live.subscribe(lambda old, new: heard.append((old, new)))
    live.offer("dns", [inst(1), inst(2)])
    live.offer("dns", [inst(2)])
    live.offer("dns", [])
    assert [sorted(new.urls()) for _, new in heard] == [
        ["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://127.0.0.1:2"], []]
    assert [s.instance.url for s in live.registry.states()] == []
    with pytest.raises(ValueError, match="adopt"):
        live.offer("file", [inst(1)])



def test_a_consumer_that_takes_no_encoder_pushes_does_not_join_a_fleet_whose_do(
        caplog: pytest.LogCaptureFixture) -> None:
    """E+P+D with pushes to the prefills: a discovered prefill without ec_zmq_addrs would get
    requests whose embeddings were pushed nowhere it can read; it is left out, as the roster
    check refuses such a file."""
    pushing = inst(1, "prefill", ec_zmq_addrs=["tcp://127.0.0.1:17000"])
    live = LiveFleet(file_roster(pushing, inst(2)))
    caplog.set_level(logging.WARNING, "epd_flask.fleet.live")
    live.offer("dns", [inst(3, "prefill"),
                       inst(4, "prefill", ec_zmq_addrs=["tcp://127.0.0.1:17001"]),
                       inst(5, "decode", ec_zmq_addrs=["tcp://127.0.0.1:17002"])])
    assert [i.url for i in live.view.instances] == [
        "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:4"]
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "http://127.0.0.1:3 (prefill): the fleet's prefill instances take encoder pushes" \
        in said
    assert "http://127.0.0.1:5 (decode): ec_zmq_addrs belong on" in said
