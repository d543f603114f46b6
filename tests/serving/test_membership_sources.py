"""The membership sources against real etcd and dnsmasq (docs/behaviour.md#discovery): what
each hands the fleet, when, and what it keeps through an outage. One etcd and one dnsmasq
serve the whole module; each test uses its own prefix or names."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from epd_flask.control.roster import Instance
from epd_flask.control.sourcespecs import DnsName, EtcdOptions
from epd_flask.control.statedir import StateDir
from epd_flask.control.urlpolicy import URLPolicy
from epd_flask.fleet.sources.dnssource import DnsSource
from epd_flask.fleet.sources.etcdsource import MAX_BACKOFF, PING_INTERVAL, EtcdSource, member_key
from epd_flask.upstream.etcd import TIMEOUT
from tests.helpers import eventually
from tests.membership import Dnsmasq, Etcd, Fleet, Relay, needs_dnsmasq, needs_etcd

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    return f"/epd-test/{next(_prefixes)}/"


@pytest.fixture
def sources() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for source in started:
        source.stop()


def record(port: int, role: str = "decode", **fields: Any) -> dict[str, Any]:
    return {"role": role, "url": f"http://127.0.0.1:{port}", **fields}


@needs_etcd
def test_etcd_reads_the_prefix_then_follows_every_change(
        etcd: Etcd, prefix: str, sources: list[Any]) -> None:
    etcd.put_record(prefix, "a", record(9001, kv_events="tcp://127.0.0.1:5557"))
    etcd.client.put(f"{prefix}instances/broken", b"{not json")
    etcd.put_record(prefix, "bad-role", {"role": "router", "url": "http://127.0.0.1:9009"})
    etcd.put_record("/elsewhere/", "x", record(9008))
    offers = Fleet()
    source = EtcdSource(EtcdOptions(endpoints=[etcd.url], prefix=prefix), offers.context())
    sources.append(source)
    source.start()
    assert eventually(lambda: offers.urls == ["http://127.0.0.1:9001"])
    assert offers.log[-1][1][0].kv_events == "tcp://127.0.0.1:5557"
    assert source.state.up

    etcd.put_record(prefix, "b", record(9002, role="prefill"))
    assert eventually(lambda: offers.urls == ["http://127.0.0.1:9001",
                                              "http://127.0.0.1:9002"])
    etcd.client.delete(f"{prefix}instances/a")
    assert eventually(lambda: offers.urls == ["http://127.0.0.1:9002"])
    # A record that turns bad leaves: the instance it described is no longer vouched for.
    etcd.put_record(prefix, "b", {"role": "prefill", "url": "ftp://nowhere"})
    assert eventually(lambda: offers.urls == [])


@needs_etcd
def test_etcd_admin_writes_come_back_through_the_watch_before_they_answer(
        etcd: Etcd, prefix: str, sources: list[Any]) -> None:
    offers = Fleet()
    source = EtcdSource(EtcdOptions(endpoints=[etcd.url], prefix=prefix), offers.context())
    sources.append(source)
    source.start()
    assert eventually(lambda: offers.urls == [])
    inst = Instance(role="decode", url="http://127.0.0.1:9003", dp_size=2)
    assert source.register(inst) == "registered"
    assert offers.urls == ["http://127.0.0.1:9003"]  # already applied, not eventually
    stored = etcd.client.get(member_key(prefix, inst.url))
    assert stored is not None and stored.lease == 0  # no lease: it lasts until deleted
    assert json.loads(stored.value) == {"role": "decode", "url": inst.url, "dp_size": 2}
    assert source.register(inst) == "unchanged"
    assert source.register(inst.model_copy(update={"dp_size": 4})) == "updated"
    assert source.unregister(inst.url) is not None
    assert offers.urls == []
    with pytest.raises(KeyError):
        source.unregister(inst.url)


@needs_etcd
def test_etcd_cut_off_keeps_the_last_membership_and_applies_what_it_missed(
        etcd: Etcd, prefix: str, sources: list[Any]) -> None:
    relay = Relay(etcd.port)
    offers = Fleet()
    source = EtcdSource(EtcdOptions(endpoints=[relay.url], prefix=prefix), offers.context())
    sources.append(source)
    try:
        etcd.put_record(prefix, "a", record(9011))
        etcd.put_record(prefix, "b", record(9012))
        source.start()
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9011",
                                                  "http://127.0.0.1:9012"])
        relay.cut()
        assert eventually(lambda: not source.state.up)
        seen = len(offers.log)
        etcd.put_record(prefix, "c", record(9013))  # written while this source is cut off
        etcd.client.delete(f"{prefix}instances/a")
        time.sleep(0.5)
        assert len(offers.log) == seen  # nothing offered meanwhile: the last set stands
        relay.mend()
        # Back within the backoff's cap plus a read: the whole prefix again.
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9012",
                                                  "http://127.0.0.1:9013"],
                          seconds=MAX_BACKOFF + 2)
        assert source.state.up
    finally:
        relay.stop()


@needs_etcd
def test_etcd_watched_endpoint_gone_silent_fails_over_to_one_that_answers(
        etcd: Etcd, prefix: str, sources: list[Any]) -> None:
    """The ping asks the watch's own endpoint: another endpoint answering says nothing about
    a watch whose connection died without a FIN."""
    silent, other = Relay(etcd.port), Relay(etcd.port)
    offers = Fleet()
    source = EtcdSource(EtcdOptions(endpoints=[silent.url, other.url], prefix=prefix),
                        offers.context())
    sources.append(source)
    try:
        etcd.put_record(prefix, "a", record(9061))
        source.start()
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9061"])
        # The read offers before the watch is opened: wait for the watch itself.
        assert eventually(lambda: source._watch is not None)
        assert source._watch.endpoint == silent.url
        silent.freeze()
        etcd.put_record(prefix, "b", record(9062))
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9061",
                                                  "http://127.0.0.1:9062"],
                          seconds=PING_INTERVAL + 2 * TIMEOUT + MAX_BACKOFF)
        assert eventually(lambda: source._watch is not None
                          and source._watch.endpoint == other.url and not source._watch.closed)
        assert source.state.up
        etcd.client.delete(f"{prefix}instances/a")  # and it follows from there
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9062"])
    finally:
        silent.stop()
        other.stop()


@needs_etcd
def test_etcd_restarted_then_written_at_once(etcd: Etcd, prefix: str,
                                             sources: list[Any]) -> None:
    offers = Fleet()
    source = EtcdSource(EtcdOptions(endpoints=[etcd.url], prefix=prefix), offers.context())
    sources.append(source)
    etcd.put_record(prefix, "a", record(9021))
    source.start()
    assert eventually(lambda: offers.urls == ["http://127.0.0.1:9021"])
    etcd.stop()
    assert eventually(lambda: not source.state.up)
    time.sleep(2)
    assert offers.urls == ["http://127.0.0.1:9021"]
    etcd.start()
    etcd.put_record(prefix, "b", record(9022))
    etcd.client.delete(f"{prefix}instances/a")
    assert eventually(lambda: offers.urls == ["http://127.0.0.1:9022"],
                      seconds=MAX_BACKOFF + 2)


@needs_etcd
def test_etcd_down_at_start_serves_the_membership_saved_by_an_earlier_worker(
        etcd: Etcd, prefix: str, sources: list[Any], tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    relay = Relay(etcd.port)
    try:
        etcd.put_record(prefix, "a", record(9031))
        first = Fleet()
        earlier = EtcdSource(EtcdOptions(endpoints=[relay.url], prefix=prefix),
                             first.context(state))
        earlier.start()
        assert eventually(lambda: first.urls == ["http://127.0.0.1:9031"])
        earlier.stop()  # saves what it read
        relay.cut()
        offers = Fleet()
        later = EtcdSource(EtcdOptions(endpoints=[relay.url], prefix=prefix),
                           offers.context(state))
        sources.append(later)
        later.start()
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9031"])
        assert "saved" in offers.log[-1][2] and not later.state.up
        etcd.put_record(prefix, "b", record(9032))
        relay.mend()
        assert eventually(lambda: offers.urls == ["http://127.0.0.1:9031",
                                                  "http://127.0.0.1:9032"],
                          seconds=MAX_BACKOFF + 2)
    finally:
        relay.stop()


@needs_etcd
def test_etcd_records_are_checked_as_a_registration_is(
        etcd: Etcd, prefix: str, sources: list[Any]) -> None:
    """The connector's needs too: a Mooncake prefill without its bootstrap server is left
    out of the fleet, logged, and the others stay."""
    etcd.put_record(prefix, "p1", record(9041, role="prefill"))
    etcd.put_record(prefix, "p2", record(9042, role="prefill",
                                         bootstrap_url="http://127.0.0.1:8998"))
    offers = Fleet(connector="mooncake")
    source = EtcdSource(EtcdOptions(endpoints=[etcd.url], prefix=prefix), offers.context())
    sources.append(source)
    source.start()
    assert eventually(lambda: offers.served == ["http://127.0.0.1:9042"])


@needs_etcd
def test_etcd_records_the_url_policy_refuses_are_skipped_by_key(
        etcd: Etcd, prefix: str, sources: list[Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """EPD_INSTANCE_NETWORKS, the link-local metadata addresses and the proxy's own listening
    address hold for a record in etcd as for a registration (docs/behaviour.md#roster)."""
    etcd.put_record(prefix, "ok", record(9051))
    etcd.put_record(prefix, "metadata", {"role": "decode", "url": "http://169.254.169.254"})
    etcd.put_record(prefix, "itself", record(9052))
    etcd.put_record(prefix, "outside", {"role": "decode", "url": "http://10.1.2.3:8000"})
    etcd.put_record(prefix, "events", record(9053, kv_events="tcp://169.254.0.9:5557"))
    offers = Fleet()
    policy = replace(URLPolicy.build(["http"], ["127.0.0.0/8"]), own=(("127.0.0.1", 9052),))
    source = EtcdSource(EtcdOptions(endpoints=[etcd.url], prefix=prefix),
                        offers.context(policy=policy))
    sources.append(source)
    with caplog.at_level(logging.ERROR, "epd_flask.fleet.sources"):
        source.start()
        assert eventually(lambda: offers.served == ["http://127.0.0.1:9051"])
    said = "\n".join(r.getMessage() for r in caplog.records)
    for key, why in (("metadata", "outside the networks"), ("itself", "this proxy itself"),
                     ("outside", "outside the networks"), ("events", "kv_events: ")):
        assert f"etcd key {prefix}instances/{key}: " in said and why in said, (key, said)
    # The refused record put right is served at once.
    etcd.put_record(prefix, "outside", record(9054))
    assert eventually(lambda: "http://127.0.0.1:9054" in offers.served)


# -- DNS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dnsmasq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path_factory.mktemp("dnsmasq"),
                     srv=[("_http._tcp.prefill.svc.test", "p1.svc.test", 8100),
                          ("_http._tcp.prefill.svc.test", "p2.svc.test", 8101)],
                     records=BASE).start()
    yield server
    server.stop()


BASE = [("127.0.0.11", "decode.svc.test"), ("127.0.0.12", "decode.svc.test"),
        ("127.0.0.21", "p1.svc.test"), ("127.0.0.22", "p2.svc.test")]


def dns_entry(server: Dnsmasq, **fields: Any) -> DnsName:
    return DnsName(**{"interval": 0.2, "nameserver": server.nameserver, **fields})


@needs_dnsmasq
def test_dns_names_follow_their_answers(dnsmasq: Dnsmasq, sources: list[Any]) -> None:
    offers = Fleet()
    source = DnsSource((
        dns_entry(dnsmasq, name="decode.svc.test", role="decode", port=8200,
                  instance={"kv_events": "tcp://{host}:5557", "models": ["m"]}),
        dns_entry(dnsmasq, name="_http._tcp.prefill.svc.test", role="prefill"),
    ), offers.context())
    sources.append(source)
    try:
        source.start()
        assert eventually(lambda: offers.urls == [
            "http://127.0.0.11:8200", "http://127.0.0.12:8200",
            "http://127.0.0.21:8100", "http://127.0.0.22:8101"])
        decode = offers.log[-1][1][0]
        assert (decode.role, decode.kv_events, decode.models) == \
            ("decode", "tcp://127.0.0.11:5557", ("m",))
        assert source.state.up
        dnsmasq.reload([*BASE, ("127.0.0.13", "decode.svc.test")])
        assert eventually(lambda: "http://127.0.0.13:8200" in (offers.urls or []))
        dnsmasq.reload([r for r in BASE if r[0] != "127.0.0.11"])
        assert eventually(lambda: offers.urls == [
            "http://127.0.0.12:8200", "http://127.0.0.21:8100", "http://127.0.0.22:8101"])
        dnsmasq.reload([r for r in BASE if r[1] != "decode.svc.test"])  # NXDOMAIN now
        assert eventually(lambda: offers.urls == [
            "http://127.0.0.21:8100", "http://127.0.0.22:8101"])
        assert source.state.up
    finally:
        dnsmasq.reload(BASE)


@needs_dnsmasq
def test_dns_addresses_the_url_policy_refuses_are_skipped_by_name(
        dnsmasq: Dnsmasq, sources: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    offers = Fleet()
    policy = URLPolicy.build(["http"], ["127.0.0.12/32", "127.0.0.21/32"])
    source = DnsSource((dns_entry(dnsmasq, name="decode.svc.test", role="decode", port=8200),
                        dns_entry(dnsmasq, name="p1.svc.test", role="prefill", port=8300,
                                  scheme="https")),
                       offers.context(policy=policy))
    sources.append(source)
    refused = ("DNS decode.svc.test (127.0.0.11): url: host '127.0.0.11'",
               "DNS p1.svc.test (127.0.0.21): url: scheme 'https' is not allowed")
    with caplog.at_level(logging.ERROR, "epd_flask.fleet.sources"):
        source.start()
        assert eventually(lambda: all(any(r.getMessage().startswith(m) for r in caplog.records)
                                      for m in refused), what=lambda: caplog.text)
    assert offers.served == ["http://127.0.0.12:8200"]


@needs_dnsmasq
def test_dns_keeps_the_last_answer_while_the_nameserver_is_away(
        tmp_path: Path, sources: list[Any]) -> None:
    server = Dnsmasq(tmp_path, records=[("127.0.0.31", "d.svc.test")]).start()
    offers = Fleet()
    source = DnsSource((dns_entry(server, name="d.svc.test", role="decode", port=8000),),
                       offers.context())
    sources.append(source)
    source.start()
    assert eventually(lambda: offers.urls == ["http://127.0.0.31:8000"])
    server.stop()
    assert eventually(lambda: not source.state.up)
    assert offers.urls == ["http://127.0.0.31:8000"]
