"""What a client sees through the proxy compared with what vLLM answers directly: the model
list, and errors raised by the backend (passed through as vLLM wrote them) or by the proxy
itself before any backend (same status and OpenAI error shape)."""

from __future__ import annotations

import pytest

from tests.bodies import chat
from tests.vllm.checks import call, completion_body, post, unique_prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pd(fleet):
    return fleet.proxied_pd("nixl", "nixl")


def _without_created(doc: dict) -> dict:
    for model in doc["data"]:
        model.pop("created")
        for perm in model["permission"]:
            perm.pop("created")
            perm.pop("id")
    return doc


def test_models_list_is_vllms(pd):
    direct = call("GET", pd.decode.url + "/v1/models")
    proxied = call("GET", pd.proxy.url + "/v1/models")
    assert proxied.status == direct.status == 200
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    assert _without_created(proxied.json) == _without_created(direct.json)


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/completions", completion_body("hi", model="no-such-model"),
                 id="unknown-model"),
    pytest.param("/v1/chat/completions",
                 chat("hi", model="no-such-model"),
                 id="chat-unknown-model"),
])
def test_an_unknown_model_is_refused_by_the_proxy_as_vllm_words_it(pd, path, body):
    """Once the proxy has read the decode's /v1/models, it knows nobody serves the model: 404
    with vLLM's sentence in OpenAI's shape (docs/behaviour.md#models). The proxy answered
    itself, no backend: vLLM's own answer adds "Valid aliases: ..." to the sentence."""
    direct = post(pd.decode.url, path, body)
    proxied = post(pd.proxy.url, path, body)
    assert proxied.status == direct.status == 404
    assert set(proxied.json["error"]) == set(direct.json["error"])
    assert proxied.json["error"]["param"] == direct.json["error"]["param"] == "model"
    assert proxied.json["error"]["code"] == "model_not_found"
    message = "The model `no-such-model` does not exist."
    assert proxied.json["error"]["message"] == message
    assert direct.json["error"]["message"].startswith(message + " Valid aliases")


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/completions", completion_body("hello", max_tokens=100000),
                 id="max-tokens-too-large"),
    pytest.param("/v1/completions", completion_body("hi", max_tokens=2, temperature=-1),
                 id="bad-temperature"),
])
def test_backend_errors_pass_through_verbatim(pd, path, body):
    direct = post(pd.decode.url, path, body)
    proxied = post(pd.proxy.url, path, body)
    assert 400 <= direct.status < 500
    assert proxied.status == direct.status
    assert proxied.json == direct.json


@pytest.mark.parametrize(("path", "raw"), [
    pytest.param("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi",', id="bad-json"),
    pytest.param("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [',
                 id="chat-bad-json"),
    pytest.param("/v1/completions", b'[{"model": "tiny-llama", "prompt": "hi"}]',
                 id="json-array"),
    pytest.param("/v1/completions", b'{"model": "tiny-llama", "max_tokens": 2}',
                 id="missing-prompt"),
    pytest.param("/v1/chat/completions", b'{"model": "tiny-llama", "max_tokens": 2}',
                 id="missing-messages"),
    pytest.param("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": "ten"}',
                 id="wrong-type"),
])
def test_proxy_refuses_bad_input_like_vllm(pd, path, raw):
    """What the proxy must read to route (the JSON itself, prompt, messages, token counts)
    it checks itself (epd_flask/validation.py): same status and error shape as vLLM (the
    wording is the proxy's), and no backend is bothered."""
    headers = {"content-type": "application/json"}
    direct = call("POST", pd.decode.url + path, raw=raw, headers=headers)
    before = pd.prefill.metrics().get("vllm:request_success_total", 0)
    proxied = call("POST", pd.proxy.url + path, raw=raw, headers=headers)
    assert proxied.status == direct.status == 400
    assert set(proxied.json) == set(direct.json) == {"error"}
    assert set(proxied.json["error"]) == set(direct.json["error"])
    assert pd.prefill.metrics().get("vllm:request_success_total", 0) == before


def test_unknown_path_passes_through(pd):
    direct = call("GET", pd.decode.url + "/v1/nope")
    proxied = call("GET", pd.proxy.url + "/v1/nope")
    assert (proxied.status, proxied.json) == (direct.status, direct.json) == (
        404, {"detail": "Not Found"})


def test_a_long_prompt_error_is_the_backends(pd):
    """Too long a prompt for the model: refused by prefill, relayed unchanged."""
    body = completion_body(" ".join([unique_prompt("long")] * 12), max_tokens=4)
    direct = post(pd.decode.url, "/v1/completions", body)
    proxied = post(pd.proxy.url, "/v1/completions", body)
    assert direct.status == 400
    assert (proxied.status, proxied.json) == (direct.status, direct.json)
