"""Requests vLLM refuses are refused the same way: status, error JSON shape, routing errors."""

from __future__ import annotations

import json

import pytest
import requests

from tests.sim.simclient import load_sample, samples_available, shape

CASES = [
    # (path, raw body, content type, sample, expected status)
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi",', "application/json",
     "single/12-err-invalid-json", 400),
    ("/v1/completions", b'[{"model":"tiny-llama","prompt":"hi"}]', "application/json",
     "single/13-err-json-array", 400),
    ("/v1/chat/completions", b'[{"model":"tiny-llama","messages":[]}]', "application/json",
     "single/14-err-chat-json-array", 400),
    ("/v1/completions", b'{"model":"no-such-model","prompt":"hi","max_tokens":2}',
     "application/json", "single/15-err-unknown-model", 404),
    ("/v1/completions", b'{"model":"tiny-llama","max_tokens":2}', "application/json",
     "single/17-err-missing-prompt", 400),
    ("/v1/chat/completions", b'{"model":"tiny-llama","max_tokens":2}', "application/json",
     "single/18-err-chat-missing-messages", 400),
    ("/v1/completions", b'{"model":"tiny-llama","prompt":"hello","max_tokens":100000}',
     "application/json", "single/19-err-too-long", 400),
    ("/v1/completions", b"", None, "single/20-err-empty-body", 400),
    ("/v1/completions", b'{"model":"tiny-llama","prompt":"hi","max_tokens":"ten"}',
     "application/json", "single/21-err-wrong-type", 400),
]


@pytest.mark.parametrize(("path", "raw", "ctype", "sample", "status"), CASES,
                         ids=[c[3].split("/")[1] for c in CASES])
def test_error_status_and_body(start_sim, path, raw, ctype, sample, status):
    srv = start_sim(role="prefill_decode")
    headers = {"content-type": ctype} if ctype else {}
    resp = requests.post(srv.url + path, data=raw, headers=headers, timeout=5)
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if samples_available():
        _, _, captured = load_sample(sample)
        theirs = json.loads(captured)
        assert shape(resp.json()) == shape(theirs)
        # Content may differ in principle, but these are deterministic and match exactly.
        assert error["type"] == theirs["error"]["type"]
        assert error["param"] == theirs["error"]["param"]
        assert error["message"] == theirs["error"]["message"]


def test_unknown_path_and_wrong_method(start_sim):
    srv = start_sim(role="decode")
    missing = requests.get(srv.url + "/v1/nope", timeout=5)
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    wrong = requests.get(srv.url + "/v1/completions", timeout=5)
    assert wrong.status_code == 405 and wrong.json() == {"detail": "Method Not Allowed"}
    assert wrong.headers["allow"] == "POST"


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 1.5},
    {"prompt": "hi", "max_tokens": [1]},
    {"prompt": "hi", "stream": "maybe"},
    {"prompt": "hi", "stream": 2},
    {"prompt": "", "max_tokens": 2},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "x" * 4000, "max_tokens": 2},
    {"prompt": "x" * 1600, "max_tokens": 200},
])
def test_more_invalid_completions(start_sim, body):
    srv = start_sim(role="prefill_decode")
    resp = requests.post(srv.url + "/v1/completions", json=body, timeout=5)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == 400


def test_digit_string_max_tokens_is_accepted_like_pydantic(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=8)
    resp = requests.post(srv.url + "/v1/completions",
                         json={"prompt": "hi", "max_tokens": "2"}, timeout=5)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("spelling", "streams"), [
    ("yes", True), ("true", True), (1, True), ("on", True),
    ("no", False), ("false", False), (0, False), ("off", False)])
def test_stream_is_a_lax_boolean_like_pydantic(start_sim, spelling, streams):
    """vLLM's ``stream: bool | None`` in lax mode: "yes" streams, "false" does not."""
    srv = start_sim(role="prefill_decode", output_tokens=4)
    resp = requests.post(srv.url + "/v1/completions", timeout=5, json={
        "prompt": "hi", "max_tokens": "2.0", "stream": spelling})
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream") == streams


def test_errors_are_counted(start_sim):
    srv = start_sim(role="prefill_decode")
    requests.post(srv.url + "/v1/completions", json={"max_tokens": 2}, timeout=5)
    stats = srv.state.stats()
    assert stats["errors"] == 1 and stats["completions"] == 1 and stats["in_flight"] == 0
