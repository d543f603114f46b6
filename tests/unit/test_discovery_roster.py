"""The roster's ``discovery:`` as the master checks it (docs/behaviour.md#discovery), without
importing any source."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from epd_flask.control import sourcespecs
from epd_flask.control.roster import RosterError, parse
from epd_flask.control.sourcespecs import nameserver_address, render

GOOD = {"discovery": {
    "etcd": {"endpoints": ["http://127.0.0.1:2379", "https://etcd-2:2379/"],
             "prefix": "/epd-flask/prod/"},
    "dns": [{"name": "decode.vllm.svc.cluster.local", "role": "decode", "port": 8000,
             "instance": {"kv_events": "tcp://{host}:5557", "models": ["m"]}},
            {"name": "_http._tcp.prefill.vllm.svc.cluster.local", "role": "prefill",
             "nameserver": "10.96.0.10:53", "interval": 1}]},
    "instances": [{"role": "decode", "url": "http://10.0.0.9:8000"}]}


def test_a_roster_with_sources_beside_static_instances() -> None:
    roster = parse(GOOD)
    assert set(roster.sources) == {"etcd", "dns"}
    assert roster.sources["etcd"].endpoints == ("http://127.0.0.1:2379", "https://etcd-2:2379")
    srv = roster.sources["dns"][1]
    assert srv.srv and srv.port is None and srv.interval == 1
    assert roster.sources["dns"][0].interval == 5 and roster.sources["dns"][0].scheme == "http"
    assert parse({"instances": []}).sources == {}


@pytest.mark.parametrize(("discovery", "said"), [
    ({"zookeeper": {}}, "discovery.zookeeper: unknown key"),
    ({"etcd": {"endpoints": [], "prefix": "/a/"}}, "at least 1 item"),
    ({"etcd": {"endpoints": ["127.0.0.1:2379"], "prefix": "/a/"}}, "http://host:port"),
    ({"etcd": {"endpoints": ["http://h:2379"], "prefix": "a"}}, "start and end with '/'"),
    ({"dns": [{"name": "d.svc", "role": "decode"}]}, "give port"),
    ({"dns": [{"name": "_http._tcp.d.svc", "role": "decode", "port": 80}]}, "remove port"),
    ({"dns": [{"name": "d.svc", "role": "router", "port": 80}]}, "discovery.dns[0].role"),
    ({"dns": [{"name": "d svc", "role": "decode", "port": 80}]}, "must be a DNS name"),
    ({"dns": [{"name": "d.svc", "role": "decode", "port": 80, "nameserver": "dns.local"}]},
     "IP address"),
    ({"dns": [{"name": "d.svc", "role": "decode", "port": 80,
               "instance": {"url": "http://x:1"}}]}, "must not set url"),
    ({"dns": [{"name": "d.svc", "role": "decode", "port": 80,
               "instance": {"dp_sise": 2}}]}, "dp_sise"),
    ({"dns": [{"name": "d.svc", "role": "decode", "port": 80,
               "instance": {"kv_events": "tcp://*:5557"}}]}, "instance template"),
])
def test_bad_sources_are_refused_naming_where(discovery: dict[str, Any], said: str) -> None:
    with pytest.raises(RosterError, match="discovery") as err:
        parse({"discovery": discovery})
    assert said in str(err.value)


def test_a_template_is_held_to_the_connector_needs() -> None:
    doc = {"settings": {"connector": "mooncake"},
           "discovery": {"dns": [{"name": "_b._tcp.p.svc", "role": "prefill"}]}}
    with pytest.raises(RosterError, match="bootstrap_url"):
        parse(doc)
    doc["discovery"]["dns"][0]["instance"] = {"bootstrap_url": "http://{host}:8998"}
    parse(doc)


def test_templates_and_nameservers() -> None:
    assert render({"a": "tcp://{host}:1", "b": ["{host}", 2], "c": 3}, "10.0.0.7") == \
        {"a": "tcp://10.0.0.7:1", "b": ["10.0.0.7", 2], "c": 3}
    assert render("http://{host}:1", "fd00::7") == "http://[fd00::7]:1"
    assert nameserver_address("10.96.0.10") == ("10.96.0.10", 53)
    assert nameserver_address("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert nameserver_address("[::1]:5353") == ("::1", 5353)
    assert nameserver_address("::1") == ("::1", 53)


def test_every_source_is_a_class_its_spec_names() -> None:
    import importlib

    for name, spec in sourcespecs.SOURCES.items():
        module, _, cls = spec.implementation.partition(":")
        assert getattr(importlib.import_module(module), cls).name == name


def test_the_master_checks_discovery_without_loading_a_source() -> None:
    code = (f"import sys; from epd_flask.control.roster import parse; parse({GOOD!r}); "
            "bad = [m for m in sys.modules if m.startswith(('dns', 'gevent', 'ssl', "
            "'epd_flask.fleet', 'urllib3'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
