"""NIXL P+D through the proxy against real vLLM: the answer is the one a single server gives,
and the decode server's own counters show it pulled the prompt's KV instead of computing it."""

from __future__ import annotations

import pytest

from tests.vllm.checks import (
    chat_body,
    completion_body,
    kv_delta,
    post,
    same_id_rounds,
    unique_prompt,
)

pytestmark = pytest.mark.vllm

NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"


@pytest.fixture(scope="module")
def pd(fleet):
    return fleet.proxied_pd("nixl", "nixl")


def _reference(pd, path: str, body: dict) -> str:
    """The same request on one server, no disaggregation: greedy, so the text must match."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    reply = post(pd.prefill.url, path, plain)
    assert reply.status == 200, reply.raw
    return reply.text


CASES = [
    pytest.param("/v1/completions", False, id="completions"),
    pytest.param("/v1/completions", True, id="completions-stream"),
    pytest.param("/v1/chat/completions", False, id="chat"),
    pytest.param("/v1/chat/completions", True, id="chat-stream"),
]


@pytest.mark.parametrize(("path", "stream"), CASES)
def test_decode_pulls_the_prefilled_kv(pd, path, stream):
    prompt = unique_prompt(f"nixl {path} {stream}")
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = (chat_body if "chat" in path else completion_body)(prompt, **extra)
    before = pd.decode.metrics()

    reply = post(pd.proxy.url, path, body)

    assert reply.status == 200, reply.raw
    if stream:
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.events[-1] == "[DONE]"
        usage = reply.events[-2]["usage"]
    else:
        usage = reply.json["usage"]
    assert usage["completion_tokens"] == 8
    pulled = kv_delta(pd.decode, before, usage["prompt_tokens"], NIXL_TRANSFERS, NIXL_BYTES)
    # Every prompt token's KV came over NIXL; the decode computed none of the prompt.
    assert pulled.external == usage["prompt_tokens"], pulled
    assert pulled.local == 0, pulled
    assert pulled.extra[NIXL_TRANSFERS] >= 1 and pulled.extra[NIXL_BYTES] > 0, pulled
    # Greedy decoding over the transferred KV says what one server would have said.
    assert reply.text == _reference(pd, path, body)


def test_prefill_only_primed_the_kv(pd):
    """The proxy asked prefill for one token, not a stream: prefill generated exactly one
    token per P+D request (visible in its own counters)."""
    before = pd.prefill.metrics()
    reply = post(pd.proxy.url, "/v1/completions",
                 completion_body(unique_prompt("prefill-count"), max_tokens=6, stream=True))
    assert reply.status == 200
    after = pd.prefill.metrics()
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_same_id_concurrent_requests_get_their_solo_answers(pd, path):
    """Two clients sending one X-Request-Id at once: each gets the answer its prompt gets
    alone (vLLM names its engine request, and NIXL its handles, after the id it is sent)."""
    rounds = same_id_rounds(pd.proxy.url, path, f"nixl{path}")
    print(f"\nnixl {path}: {sum(s == t for s, t in rounds)} of {len(rounds)} rounds exact")
    for solo, together in rounds:
        assert together == solo

