"""A real prefill and decode that register themselves in etcd with `epd-flask register`
(docs/behaviour.md#discovery), served through a proxy whose roster lists no instance: the
request is disaggregated over NIXL as with a static roster, and stopping the decode's vLLM
withdraws its record, so the proxy drops it (and says it has no decode) instead of failing
requests against it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from epd_flask.fleet.sources.etcdsource import member_key
from tests.helpers import eventually
from tests.membership import Etcd, needs_etcd
from tests.vllm.checks import completion_body, kv_delta, post, unique_prompt
from tests.vllm.fleet import LOG_DIR, Process

pytestmark = [pytest.mark.vllm, needs_etcd]

PREFIX = "/vllm-registered/"
KEY = "vllm-registered-admin-key"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
#: Checks of /health a second apart, two failures withdraw: a stopped vLLM leaves in ~2 s.
INTERVAL, FAIL_THRESHOLD = "1", "2"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def registrant(etcd: Etcd, role: str, url: str) -> Process:
    """`epd-flask register` beside one server, as etc/epd-flask-register@.service runs it."""
    return Process(f"register-{role}",
                   [sys.executable, "-m", "epd_flask.control.cli", "register",
                    "--etcd", etcd.url, "--prefix", PREFIX, "--role", role, "--url", url,
                    "--ttl", "10", "--interval", INTERVAL, "--fail-threshold", FAIL_THRESHOLD],
                   {}, url)


@pytest.fixture(scope="module")
def registered(fleet, etcd: Etcd):
    top = fleet.up("nixl-registered")
    prefill, decode = top.by_role("prefill"), top.by_role("decode")
    registrants = [registrant(etcd, "prefill", prefill.url),
                   registrant(etcd, "decode", decode.url)]
    try:
        eventually(lambda: all(etcd.client.get(member_key(PREFIX, s.url)) is not None
                               for s in (prefill, decode)), 60,
                   what=lambda: "both records in etcd: "
                   + "\n".join(r.tail(1500) for r in registrants))
        proxy = fleet.proxy({"settings": {"connector": "nixl", "decode_retries": 0},
                             "discovery": {"etcd": {"endpoints": [etcd.url],
                                                    "prefix": PREFIX}}},
                            env={"ADMIN_API_KEY": KEY})
        yield prefill, decode, proxy, registrants
    finally:
        for r in registrants:
            r.stop()
        fleet.down()  # the decode is stopped below: nobody else may use this pair


def listed(proxy: Process) -> dict[str, str]:
    doc = requests.get(proxy.url + "/instances", headers={"X-API-Key": KEY}, timeout=10).json()
    return {row["url"]: row["source"] for row in doc["data"]}


def test_registered_pair_serves_then_a_stopped_decode_leaves(registered, etcd: Etcd):
    prefill, decode, proxy, registrants = registered
    assert listed(proxy) == {prefill.url: "etcd", decode.url: "etcd"}
    assert json.loads(etcd.client.get(member_key(PREFIX, decode.url)).value) == {
        "role": "decode", "url": decode.url}

    body = completion_body(unique_prompt("registered"))
    before = decode.metrics()
    reply = post(proxy.url, "/v1/completions", body)
    assert reply.status == 200, reply.raw
    usage = reply.json["usage"]
    assert usage["completion_tokens"] == 8
    pulled = kv_delta(decode, before, usage["prompt_tokens"], NIXL_TRANSFERS, NIXL_BYTES)
    assert pulled.external == usage["prompt_tokens"] and pulled.local == 0, pulled

    decode.process.stop()
    eventually(lambda: etcd.client.get(member_key(PREFIX, decode.url)) is None, 30,
               what=lambda: "the decode's record withdrawn: " + registrants[1].tail(1500))
    eventually(lambda: decode.url not in listed(proxy), 10, what="the proxy dropping it")
    assert listed(proxy) == {prefill.url: "etcd"}
    assert registrants[1].proc.poll() is None  # it waits for the decode to come back
    refused = post(proxy.url, "/v1/completions", body)
    assert refused.status == 503, refused.raw
    ready = requests.get(proxy.url + "/ready", timeout=10)
    assert ready.status_code == 503
    assert "decode" in ready.text
    log = Path(LOG_DIR / "register-decode.log").read_text(errors="replace")
    assert "withdr" in log, log[-2000:]
