"""Mooncake P‖D against real vLLM (TCP transport): the decode finds the prefill through its
bootstrap server and pulls the KV while prefill runs.

The first case does a router's job by hand, proving the real pair works here; the others go
through the proxy's ``mooncake`` connector.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import gevent
import pytest
import requests

from tests.rosters import roster
from tests.vllm.checks import (
    chat_body,
    completion_body,
    kv_delta,
    post,
    same_id_rounds,
    unique_prompt,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pd(fleet):
    top = fleet.up("mooncake")
    return SimpleNamespace(fleet=fleet, prefill=top.by_role("prefill"),
                           decode=top.by_role("decode"))


def _bootstrap(pd) -> dict:
    return requests.get(pd.prefill.bootstrap_url + "/query", timeout=10).json()


def test_bootstrap_query_shape(pd):
    """Today's shape: per DP rank, the engine id and its workers' addresses."""
    doc = _bootstrap(pd)
    assert list(doc) == ["0"]
    assert uuid.UUID(doc["0"]["engine_id"])
    addr = doc["0"]["worker_addr"]["0"]["0"]
    assert addr.startswith("tcp://127.0.0.1:")


def test_real_pair_moves_kv_by_hand(pd):
    """Prefill and decode at once, with one transfer id; decode names the prefill's engine."""
    prompt = unique_prompt("mooncake-by-hand")
    transfer = f"xfer-{uuid.uuid4().hex}"
    engine = _bootstrap(pd)["0"]["engine_id"]
    p_body = completion_body(prompt, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer})
    d_body = completion_body(prompt, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine,
        "remote_bootstrap_addr": pd.prefill.bootstrap_url, "transfer_id": transfer})
    before = pd.decode.metrics()
    legs = [gevent.spawn(post, pd.prefill.url, "/v1/completions", p_body),
            gevent.spawn(post, pd.decode.url, "/v1/completions", d_body)]
    gevent.joinall(legs, raise_error=True)
    prefill_reply, decode_reply = (g.value for g in legs)
    assert prefill_reply.status == 200 and decode_reply.status == 200
    assert prefill_reply.json["kv_transfer_params"] is None  # Mooncake: the router's job
    tokens = decode_reply.json["usage"]["prompt_tokens"]
    pulled = kv_delta(pd.decode, before, tokens)
    assert pulled.external == tokens and pulled.local == 0, pulled


@pytest.fixture(scope="module")
def proxy(pd):
    return pd.fleet.proxy(roster([(pd.prefill, {"bootstrap_url": pd.prefill.bootstrap_url})],
                                 [pd.decode], connector="mooncake", decode_retries=0))


@pytest.mark.parametrize(("path", "stream"), [
    pytest.param("/v1/completions", False, id="completions"),
    pytest.param("/v1/completions", True, id="completions-stream"),
    pytest.param("/v1/chat/completions", False, id="chat"),
    pytest.param("/v1/chat/completions", True, id="chat-stream"),
])
def test_proxy_mooncake_pulls_kv(pd, proxy, path, stream):
    prompt = unique_prompt(f"mooncake {path}")
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = (chat_body if "chat" in path else completion_body)(prompt, **extra)
    before = pd.decode.metrics()
    reply = post(proxy.url, path, body)
    assert reply.status == 200, reply.raw
    usage = reply.events[-2]["usage"] if stream else reply.json["usage"]
    pulled = kv_delta(pd.decode, before, usage["prompt_tokens"])
    assert pulled.external == usage["prompt_tokens"] and pulled.local == 0, pulled
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    assert reply.text == post(pd.prefill.url, path, plain).text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_same_id_concurrent_requests_get_their_solo_answers(pd, proxy, path):
    """Two clients sending one X-Request-Id at once: each gets the answer its prompt gets
    alone (with the client's id as transfer id, decode read the other's KV)."""
    rounds = same_id_rounds(proxy.url, path, f"mooncake{path}")
    print(f"\nmooncake {path}: {sum(s == t for s, t in rounds)} of {len(rounds)} rounds exact")
    for solo, together in rounds:
        assert together == solo

