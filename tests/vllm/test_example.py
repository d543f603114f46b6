"""The ``none`` connector against real vLLM's ExampleConnector (KV through shared files): no
handles travel, the decode finds the prefill's KV by the prompt alone."""

from __future__ import annotations

import pytest

from tests.vllm.checks import chat_body, completion_body, kv_delta, post, unique_prompt

pytestmark = pytest.mark.vllm

CACHE_HIT_LINE = "External Cache Hit!"


@pytest.fixture(scope="module")
def pd(fleet):
    return fleet.proxied_pd("example", "none")


@pytest.mark.parametrize(("path", "stream"), [
    pytest.param("/v1/completions", False, id="completions"),
    pytest.param("/v1/completions", True, id="completions-stream"),
    pytest.param("/v1/chat/completions", False, id="chat"),
    pytest.param("/v1/chat/completions", True, id="chat-stream"),
])
def test_decode_loads_the_stored_kv(pd, path, stream):
    prompt = unique_prompt(f"example {path} {stream}")
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = (chat_body if "chat" in path else completion_body)(prompt, **extra)
    hits_before = pd.decode.log_text().count(CACHE_HIT_LINE)
    before = pd.decode.metrics()

    reply = post(pd.proxy.url, path, body)

    assert reply.status == 200, reply.raw
    usage = reply.events[-2]["usage"] if stream else reply.json["usage"]
    pulled = kv_delta(pd.decode, before, usage["prompt_tokens"])
    # The connector stores whole 32-token blocks; the rest of the prompt is recomputed.
    assert pulled.external >= 32 and pulled.external % 32 == 0, pulled
    assert pulled.local == usage["prompt_tokens"] - pulled.external, pulled
    assert pd.decode.log_text().count(CACHE_HIT_LINE) > hits_before
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    assert reply.text == post(pd.prefill.url, path, plain).text
