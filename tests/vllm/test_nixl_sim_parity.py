"""The simulator against real vLLM, request for request: the same request to a real server and
to a sim in the same role must give the same status, content type and wire shape (keys and
JSON types, not values), and error bodies word for word apart from numbers."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from epd_flask.sim import SimConfig, SimServer
from tests.sim.wireshape import body_shape, error_text
from tests.vllm.checks import Reply, call, chat_body, completion_body, post, unique_prompt
from tests.vllm.fleet import MODEL_NAME

pytestmark = pytest.mark.vllm

JSON = {"content-type": "application/json"}
NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}
STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def pair(fleet) -> Iterator[SimpleNamespace]:
    top = fleet.up("nixl")
    sims = {role: SimServer(SimConfig(role=role, model=MODEL_NAME)).start()
            for role in ("prefill", "decode")}
    try:
        yield SimpleNamespace(real={"prefill": top.by_role("prefill").url,
                                    "decode": top.by_role("decode").url},
                              sim={role: s.url for role, s in sims.items()})
    finally:
        for s in sims.values():
            s.stop()


def _compare(real: Reply, sim: Reply) -> None:
    assert sim.status == real.status, (real.raw, sim.raw)
    ctype = real.headers.get("content-type", "")
    assert sim.headers.get("content-type", "") == ctype
    real_text, sim_text = real.raw.decode("utf-8"), sim.raw.decode("utf-8")
    assert body_shape(sim_text, ctype) == body_shape(real_text, ctype)
    if real.status >= 400:
        assert error_text(sim_text) == error_text(real_text)


def _story(**extra: Any) -> dict[str, Any]:
    return completion_body(unique_prompt("parity"), **extra)


POSTS = [
    pytest.param("/v1/completions", _story(), id="completion"),
    pytest.param("/v1/completions", _story(stream=True), id="completion-stream"),
    pytest.param("/v1/completions", _story(**STREAM_USAGE), id="completion-stream-usage"),
    pytest.param("/v1/completions",
                 completion_body(["hello", "the quick fox"], max_tokens=3, logprobs=2),
                 id="completion-2-prompts-logprobs"),
    pytest.param("/v1/completions", _story(stream=True, logprobs=1),
                 id="completion-stream-logprobs"),
    pytest.param("/v1/completions", _story(n=2, temperature=0.5), id="completion-n2"),
    pytest.param("/v1/chat/completions", chat_body("tell me a story"), id="chat"),
    pytest.param("/v1/chat/completions", chat_body("tell me a story", stream=True),
                 id="chat-stream"),
    pytest.param("/v1/chat/completions", chat_body("tell me a story", **STREAM_USAGE),
                 id="chat-stream-usage"),
    pytest.param("/v1/chat/completions", chat_body("hi", logprobs=True, top_logprobs=2),
                 id="chat-logprobs"),
    pytest.param("/v1/chat/completions",
                 chat_body("hi", stream=True, logprobs=True, top_logprobs=2),
                 id="chat-stream-logprobs"),
    pytest.param("/v1/chat/completions",
                 {"model": MODEL_NAME, "max_completion_tokens": 4,
                  "messages": [{"role": "system", "content": "you are tiny"},
                               {"role": "user", "content": "hello"}]},
                 id="chat-max-completion-tokens"),
    pytest.param("/v1/completions", {"prompt": "hi", "max_tokens": 2}, id="no-model-field"),
    pytest.param("/v1/completions", completion_body("hi", model="no-such-model"),
                 id="err-unknown-model"),
    pytest.param("/v1/completions", {"model": MODEL_NAME, "max_tokens": 2},
                 id="err-missing-prompt"),
    pytest.param("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2},
                 id="err-missing-messages"),
    pytest.param("/v1/completions", completion_body("hello", max_tokens=100000),
                 id="err-max-tokens"),
    pytest.param("/v1/completions", completion_body("hi", max_tokens="ten"),
                 id="err-wrong-type"),
    pytest.param("/v1/completions", completion_body("hi", max_tokens=0), id="err-zero-tokens"),
    pytest.param("/v1/completions", completion_body("hi", kv_transfer_params=NIXL_PREFILL_PARAMS),
                 id="prefill-handles"),
    pytest.param("/v1/completions",
                 completion_body(unique_prompt("p-stream"), max_tokens=1, stream=True,
                                 kv_transfer_params=NIXL_PREFILL_PARAMS),
                 id="prefill-stream-handles"),
    pytest.param("/v1/chat/completions",
                 chat_body(unique_prompt("p-chat"), kv_transfer_params=NIXL_PREFILL_PARAMS,
                           max_tokens=1),
                 id="prefill-chat-handles"),
]


@pytest.mark.parametrize(("path", "body"), POSTS)
def test_post_matches_real_vllm(pair, path, body):
    _compare(post(pair.real["prefill"], path, body), post(pair.sim["prefill"], path, body))


RAW_POSTS = [
    pytest.param("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi",', JSON,
                 id="err-invalid-json"),
    pytest.param("/v1/completions", b'[{"model": "tiny-llama", "prompt": "hi"}]', JSON,
                 id="err-json-array"),
    pytest.param("/v1/chat/completions", b'[]', JSON, id="err-chat-json-array"),
    pytest.param("/v1/completions", b"", {}, id="err-empty-body"),
]


@pytest.mark.parametrize(("path", "raw", "headers"), RAW_POSTS)
def test_raw_post_matches_real_vllm(pair, path, raw, headers):
    real = call("POST", pair.real["prefill"] + path, raw=raw, headers=headers)
    sim = call("POST", pair.sim["prefill"] + path, raw=raw, headers=headers)
    _compare(real, sim)


@pytest.mark.parametrize("path", ["/health", "/version", "/v1/models", "/v1/nope",
                                  "/v1/completions"])
def test_get_matches_real_vllm(pair, path):
    _compare(call("GET", pair.real["prefill"] + path), call("GET", pair.sim["prefill"] + path))


@pytest.mark.parametrize("stream", [False, True], ids=["decode", "decode-stream"])
def test_decode_with_handles_matches_real_vllm(pair, stream):
    """Each decode gets the handles its own kind of prefill issued for the same prompt."""
    prompt = unique_prompt(f"parity-decode {stream}")
    replies = []
    for side in (pair.real, pair.sim):
        primed = post(side["prefill"], "/v1/completions", completion_body(
            prompt, max_tokens=1, kv_transfer_params=NIXL_PREFILL_PARAMS))
        assert primed.status == 200
        body = completion_body(prompt, kv_transfer_params=primed.json["kv_transfer_params"],
                               **(STREAM_USAGE if stream else {}))
        replies.append(post(side["decode"], "/v1/completions", body))
    _compare(*replies)
