"""Discovered instances through the proxy (docs/behaviour.md#discovery): routed by, shown with
their source, written by the admin API to etcd, and drained when their DNS name drops them."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
import requests
import yaml

from epd_flask.fleet.sources.etcdsource import member_key
from tests.helpers import eventually, free_port
from tests.membership import Dnsmasq, Etcd, needs_dnsmasq, needs_etcd

KEY = "admin-key"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4}
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def listed(px: Any) -> dict[str, dict[str, Any]]:
    doc = requests.get(px.url + "/instances", headers={"X-API-Key": KEY}, timeout=5).json()
    return {row["url"]: row for row in doc["data"]}


def served_by(decodes: list[Any]) -> list[int]:
    return [d.state.stats()["completions"] for d in decodes]


@needs_etcd
def test_an_instance_registered_in_etcd_is_routed_and_listed_with_its_source(
        etcd: Etcd, sim: Any, proxy: Any) -> None:
    prefix = f"/serving/{next(_prefixes)}/"
    static, found = sim("prefill_decode"), sim("prefill_decode")
    px = proxy({"discovery": {"etcd": {"endpoints": [etcd.url], "prefix": prefix}},
                "instances": [{"role": "prefill_decode", "url": static.url}]},
               probes=True, admin_api_key=KEY)
    etcd.put_record(prefix, "d2", {"role": "prefill_decode", "url": found.url})
    assert eventually(lambda: found.url in listed(px))
    rows = listed(px)
    assert (rows[static.url]["source"], rows[found.url]["source"]) == ("file", "etcd")
    for _ in range(4):
        r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200, r.text
    assert served_by([static, found]) == [2, 2]

    # The file's record wins a URL both list, once the worker has seen etcd's.
    source = px.services.sources["etcd"]
    revision = etcd.client.put(f"{prefix}instances/dup", json.dumps(
        {"role": "prefill_decode", "url": static.url, "dp_size": 3}).encode())
    assert eventually(lambda: source.offered >= revision)
    assert listed(px)[static.url]["source"] == "file"
    assert "dp_size" not in listed(px)[static.url]
    assert px.services.live.view.sources[static.url] == "file"
    # Each source's state, in the listing and on the status page.
    doc = requests.get(px.url + "/instances", headers={"X-API-Key": KEY}, timeout=5).json()
    assert [(s["source"], s["up"], s["members"]) for s in doc["sources"]] == [("etcd", True, 2)]
    page = requests.get(px.url + "/status", headers={"X-API-Key": KEY}, timeout=5).text
    assert "<h2>Membership sources</h2>" in page
    assert re.search(r"<td class=\"l\">etcd</td><td class=\"l live\">UP</td>", page)


@needs_etcd
def test_the_admin_api_writes_to_etcd_when_etcd_is_the_store(
        etcd: Etcd, sim: Any, proxy: Any, tmp_path: Any) -> None:
    prefix = f"/serving/{next(_prefixes)}/"
    decode, other = sim("prefill_decode"), sim("prefill_decode")
    roster = tmp_path / "roster.yaml"
    roster.write_text("instances: []\n")
    px = proxy({"discovery": {"etcd": {"endpoints": [etcd.url], "prefix": prefix}}},
               probes=True, admin_api_key=KEY, roster_path=str(roster))
    answer = requests.post(px.url + "/instances",
                           json={"role": "prefill_decode", "url": decode.url},
                           headers={"X-API-Key": KEY}, timeout=5)
    assert answer.status_code == 201 and answer.json()["status"] == "registered"
    stored = etcd.client.get(member_key(prefix, decode.url))
    assert stored is not None and json.loads(stored.value)["url"] == decode.url
    assert roster.read_text() == "instances: []\n"  # the file is not the store
    assert listed(px)[decode.url]["source"] == "etcd"  # applied before the answer
    assert requests.post(px.url + "/v1/chat/completions", json=CHAT,
                         timeout=10).status_code == 200
    # What the fleet would leave out is refused, not written.
    mixed = requests.post(px.url + "/instances", json={"role": "decode", "url": other.url},
                          headers={"X-API-Key": KEY}, timeout=5)
    assert mixed.status_code == 409 and mixed.json()["error"]["code"] == "role_conflict"
    assert etcd.client.get(member_key(prefix, other.url)) is None
    gone = requests.delete(px.url + "/instances", params={"url": decode.url},
                           headers={"X-API-Key": KEY}, timeout=5)
    assert gone.status_code == 200 and gone.json()["instance"]["url"] == decode.url
    assert etcd.client.get(member_key(prefix, decode.url)) is None
    assert decode.url not in listed(px)
    again = requests.delete(px.url + "/instances", params={"url": decode.url},
                            headers={"X-API-Key": KEY}, timeout=5)
    assert again.status_code == 404


@needs_etcd
def test_with_etcd_as_the_store_an_instance_the_file_lists_is_edited_in_the_file(
        etcd: Etcd, sim: Any, proxy: Any, tmp_path: Any) -> None:
    """The file's record is the one served: writing etcd's would change nothing."""
    prefix = f"/serving/{next(_prefixes)}/"
    static = sim("prefill_decode")
    doc = {"discovery": {"etcd": {"endpoints": [etcd.url], "prefix": prefix}},
           "instances": [{"role": "prefill_decode", "url": static.url}]}
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump(doc))
    px = proxy(doc, probes=True, admin_api_key=KEY, roster_path=str(roster))
    assert eventually(lambda: px.services.sources["etcd"].state.up)
    answer = requests.post(px.url + "/instances",
                           json={"role": "prefill_decode", "url": static.url, "dp_size": 2},
                           headers={"X-API-Key": KEY}, timeout=5)
    assert answer.status_code == 200 and answer.json()["status"] == "updated"
    assert yaml.safe_load(roster.read_text())["instances"][0]["dp_size"] == 2
    assert etcd.client.get(member_key(prefix, static.url)) is None
    assert listed(px)[static.url]["source"] == "file" and listed(px)[static.url]["dp_size"] == 2
    gone = requests.delete(px.url + "/instances", params={"url": static.url},
                           headers={"X-API-Key": KEY}, timeout=5)
    assert gone.status_code == 200
    assert yaml.safe_load(roster.read_text())["instances"] == []
    assert static.url not in listed(px)


def drains(px: Any, decodes: list[Any], remove: Callable[[], None]) -> None:
    """Ten streams run on ``decodes[0]`` when ``remove`` takes it out of its source: from the
    next decision on it gets no request, and every stream it was serving ends whole."""
    leaving, staying = decodes

    def stream() -> bytes:
        with requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True,
                           "max_tokens": 40}, stream=True, timeout=30) as r:
            assert r.status_code == 200
            return b"".join(r.iter_content(None))

    streams: list[gevent.Greenlet] = []
    while leaving.state.stats()["completions"] < 10 and len(streams) < 40:
        streams.append(gevent.spawn(stream))
        gevent.sleep(0.01)
    assert leaving.state.stats()["completions"] >= 10
    assert eventually(lambda: sum(served_by(decodes)) == len(streams))  # all routed
    remove()
    assert eventually(lambda: set(listed(px)) == {staying.url})
    assert not all(g.ready() for g in streams)  # removed while its streams ran
    before = served_by(decodes)
    for _ in range(6):
        assert requests.post(px.url + "/v1/chat/completions", json=CHAT,
                             timeout=10).status_code == 200
    assert served_by(decodes) == [before[0], before[1] + 6]
    gevent.joinall(streams, timeout=30)
    assert all(g.value is not None and g.value.rstrip().endswith(b"data: [DONE]")
               for g in streams), [g.exception for g in streams if g.exception]


@needs_dnsmasq
def test_a_decode_dropped_from_dns_finishes_its_streams_and_gets_no_new_request(
        sim: Any, proxy: Any, tmp_path: Any) -> None:
    port = free_port()
    decodes = [sim("prefill_decode", host=f"127.0.0.{n}", port=port, token_delay=0.05,
                   output_tokens=40) for n in (11, 12)]
    dnsmasq = Dnsmasq(tmp_path, records=[("127.0.0.11", "decode.svc.test"),
                                         ("127.0.0.12", "decode.svc.test")]).start()
    try:
        px = proxy({"discovery": {"dns": [{"name": "decode.svc.test", "role": "prefill_decode",
                                           "port": port, "interval": 0.2,
                                           "nameserver": dnsmasq.nameserver}]}},
                   probes=True, admin_api_key=KEY)
        assert eventually(lambda: len(listed(px)) == 2)
        drains(px, decodes, lambda: dnsmasq.reload([("127.0.0.12", "decode.svc.test")]))
        # The admin API removes only what it writes: a DNS instance goes from DNS.
        refused = requests.delete(px.url + "/instances", params={"url": decodes[1].url},
                                  headers={"X-API-Key": KEY}, timeout=5)
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "instance_not_writable"
        assert set(listed(px)) == {decodes[1].url}
    finally:
        dnsmasq.stop()


@needs_etcd
def test_a_decode_deleted_from_etcd_finishes_its_streams_and_gets_no_new_request(
        etcd: Etcd, sim: Any, proxy: Any) -> None:
    prefix = f"/serving/{next(_prefixes)}/"
    decodes = [sim("prefill_decode", token_delay=0.05, output_tokens=40) for _ in range(2)]
    for n, decode in enumerate(decodes):
        etcd.put_record(prefix, f"d{n}", {"role": "prefill_decode", "url": decode.url})
    px = proxy({"discovery": {"etcd": {"endpoints": [etcd.url], "prefix": prefix}}},
               probes=True, admin_api_key=KEY)
    assert eventually(lambda: len(listed(px)) == 2)
    drains(px, decodes, lambda: etcd.client.delete(f"{prefix}instances/d0"))
