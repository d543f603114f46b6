"""The sim answers in vLLM 0.32's exact shapes: compared key for key with captured traffic."""

from __future__ import annotations

import json

import pytest
import requests

from tests.bodies import chat, completion
from tests.sim.simclient import (
    RawClient,
    collapse,
    load_sample,
    samples_available,
    shape,
    sse_events,
)

needs_samples = pytest.mark.skipif(not samples_available(),
                                   reason="captured vLLM samples not found beside the checkout")

COMPLETION = completion(max_tokens=8, temperature=0)
CHAT = chat(max_tokens=8, temperature=0)


def _post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=5)


def _stream(url: str, path: str, body: dict) -> tuple[dict[str, str], list]:
    client = RawClient(url)
    try:
        client.send("POST", path, body)
        resp = client.read_response()
    finally:
        client.close()
    assert resp.status == 200 and resp.terminated
    return resp.headers, resp.events


def test_health_version_models(start_sim):
    srv = start_sim(role="decode", model="tiny-llama")
    health = requests.get(srv.url + "/health", timeout=5)
    assert health.status_code == 200 and health.content == b""
    assert requests.get(srv.url + "/version", timeout=5).json() == {"version": "0.32.0"}
    models = requests.get(srv.url + "/v1/models", timeout=5)
    assert models.headers["content-type"] == "application/json"
    assert models.json()["data"][0]["id"] == "tiny-llama"
    assert models.json()["data"][0]["max_model_len"] == 512


@needs_samples
def test_models_shape_matches_capture(start_sim):
    srv = start_sim(role="prefill_decode")
    _, _, body = load_sample("single/03-models")
    assert shape(requests.get(srv.url + "/v1/models", timeout=5).json()) == shape(
        json.loads(body))


@needs_samples
@pytest.mark.parametrize(("path", "body", "sample"), [
    ("/v1/completions", COMPLETION, "single/04-completion"),
    ("/v1/chat/completions", CHAT, "single/08-chat"),
])
def test_non_stream_shape_matches_capture(start_sim, path, body, sample):
    srv = start_sim(role="prefill_decode")
    resp = _post(srv.url, path, body)
    status, headers, captured = load_sample(sample)
    assert resp.status_code == status
    assert resp.headers["content-type"] == headers["content-type"]
    assert shape(resp.json()) == shape(json.loads(captured))


@needs_samples
@pytest.mark.parametrize(("path", "extra", "sample"), [
    ("/v1/completions", {"max_tokens": 5}, "single/05-completion-stream"),
    ("/v1/completions", {"max_tokens": 3, "stream_options": {"include_usage": True}},
     "single/06-completion-stream-usage"),
    ("/v1/chat/completions", {"max_tokens": 5}, "single/09-chat-stream"),
    ("/v1/chat/completions", {"max_tokens": 3, "stream_options": {"include_usage": True}},
     "single/10-chat-stream-usage"),
])
def test_stream_shape_matches_capture(start_sim, path, extra, sample):
    srv = start_sim(role="prefill_decode")
    base = COMPLETION if path == "/v1/completions" else CHAT
    headers, events = _stream(srv.url, path, {**base, **extra, "stream": True})
    _, captured_headers, captured = load_sample(sample)
    assert headers["content-type"] == captured_headers["content-type"]
    theirs = sse_events(captured)
    assert events[-1] == "[DONE]" and theirs[-1] == "[DONE]"
    assert collapse([shape(e) for e in events[:-1]]) == collapse(
        [shape(e) for e in theirs[:-1]])


def test_stream_protocol_details(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=4)
    _, events = _stream(srv.url, "/v1/chat/completions",
                        {**CHAT, "max_tokens": 4, "stream": True,
                         "stream_options": {"include_usage": True}})
    role, *tokens, usage, done = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 3 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert done == "[DONE]"
    assert len({e["id"] for e in events[:-1]}) == 1
    assert events[0]["id"].startswith("chatcmpl-") and len(events[0]["id"]) == 9 + 16


def test_finish_reason_and_token_counts(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=5)
    cut = _post(srv.url, "/v1/completions", {**COMPLETION, "max_tokens": 3}).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 3
    full = _post(srv.url, "/v1/completions", {**COMPLETION, "max_tokens": 100}).json()
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == 5
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + 5
    assert full["choices"][0]["text"].startswith(cut["choices"][0]["text"])
    assert full["id"].startswith("cmpl-") and len(full["id"]) == 5 + 16
    assert full["kv_transfer_params"] is None and full["ec_transfer_params"] is None


def test_zero_output_tokens(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=0)
    body = _post(srv.url, "/v1/completions", COMPLETION).json()
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0
    _, events = _stream(srv.url, "/v1/completions", {**COMPLETION, "stream": True})
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == ["stop"]


def test_missing_model_field_uses_served_model(start_sim):
    srv = start_sim(role="prefill_decode", model="my-model")
    resp = _post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == "my-model"


def test_text_is_deterministic_and_multibyte_survives(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=16)
    # Find a prompt whose answer holds a multi-byte character (bounded search).
    for i in range(50):
        body = {**COMPLETION, "prompt": f"prompt number {i}", "max_tokens": 16}
        text = _post(srv.url, "/v1/completions", body).json()["choices"][0]["text"]
        if len(text.encode()) > len(text):
            break
    else:
        pytest.fail("no multi-byte output in 50 prompts")
    assert _post(srv.url, "/v1/completions", body).json()["choices"][0]["text"] == text
    _, events = _stream(srv.url, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text


def test_several_prompts_give_several_choices(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=3)
    body = _post(srv.url, "/v1/completions",
                 {"prompt": ["hello", "the quick fox"], "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6
