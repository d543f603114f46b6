"""Prefill's prefix-cache hits written into decode's usage, as pure functions."""

from __future__ import annotations

import json

import pytest

from epd_flask.serving.usage import (
    UsageError,
    prefill_cached_tokens,
    prefill_tokens,
    rewrite_body,
    rewrite_events,
)


def test_prefill_cached_tokens_from_usage_or_nixl_params() -> None:
    assert prefill_cached_tokens(None) == 0
    assert prefill_cached_tokens({"usage": {"prompt_tokens_details": None}}) == 0
    assert prefill_cached_tokens({"usage": {"prompt_tokens": 40, "prompt_tokens_details": {
        "cached_tokens": 32}}}) == 32
    assert prefill_cached_tokens({"usage": {"prompt_tokens": 64}, "kv_transfer_params": {
        "remote_prefill_cached_tokens": 64}}) == 64
    assert prefill_cached_tokens({"usage": {"prompt_tokens": 64}, "kv_transfer_params": {
        "remote_prefill_cached_tokens": None}}) == 0
    # What the cache-hit share counts: (prompt, cached), only with a prompt length.
    assert prefill_tokens({"usage": {"prompt_tokens": 40, "prompt_tokens_details": {
        "cached_tokens": 32}}}) == (40, 32)
    assert prefill_tokens({"usage": {"prompt_tokens": 7}}) == (7, 0)
    assert prefill_tokens({"usage": None}) is None


@pytest.mark.parametrize("reply", [
    {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 10 ** 30}}},
    {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": -1}}},
    {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": "5"}}},
    {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2.5}}},
    {"usage": {"prompt_tokens": 9}, "kv_transfer_params": {"remote_prefill_cached_tokens": True}},
    {"usage": {"prompt_tokens": "9", "prompt_tokens_details": {"cached_tokens": 5}}},
    {"kv_transfer_params": {"remote_prefill_cached_tokens": 5}},
], ids=["10^30", "negative", "text", "fraction", "bool", "prompt_tokens text",
        "no prompt_tokens"])
def test_cached_tokens_no_prompt_could_have_are_refused(reply) -> None:
    with pytest.raises(UsageError):
        prefill_cached_tokens(reply)
    assert prefill_tokens(reply) is None  # never counted in the share either


def test_body_usage_gets_cached_tokens_and_keeps_other_details() -> None:
    body = {"id": "x", "usage": {"prompt_tokens": 81, "completion_tokens": 8,
                                 "prompt_tokens_details": {"audio_tokens": 0}}}
    out = json.loads(rewrite_body(json.dumps(body).encode(), 48))
    assert out["usage"]["prompt_tokens_details"] == {"audio_tokens": 0, "cached_tokens": 48}
    assert out["id"] == "x" and out["usage"]["prompt_tokens"] == 81
    raw = json.dumps(body).encode()
    assert rewrite_body(raw, 0) is raw
    assert rewrite_body(b"not json \"usage\"", 5) == b"not json \"usage\""


def test_only_events_with_usage_are_touched() -> None:
    token = b'data: {"choices":[{"delta":{"content":"\\"usage\\""}}]}\n\n'
    assert rewrite_events(token, 16) is token  # a quoted "usage" inside text is not a key
    plain = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    assert rewrite_events(plain, 16) is plain
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    out = rewrite_events(plain + usage + b"data: [DONE]\n\n", 16)
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == plain and events[2] == b"data: [DONE]"
    assert json.loads(events[1][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert out.endswith(b"\n\n")
