"""The P1 prefill body and the NIXL/none decode bodies, as pure functions."""

from __future__ import annotations

import copy
import logging

import pytest

from epd_flask.connectors import get_connector, prime_body
from epd_flask.connectors.nixl import complete_handles

CHAT = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 64,
    "temperature": 0,
}
HANDLES = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "2033d88b-a27f-47b8-a92d-42c4256519c1",
    "remote_request_id": "cmpl-b10ac896ac4a061b-0-98623f46", "remote_host": "localhost",
    "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 81,
}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, {"max_tokens": 1, "stream": False}),
        ({"max_completion_tokens": 200}, {"max_completion_tokens": 1}),
        ({"min_tokens": 5}, {"min_tokens": 1}),
        ({"min_tokens": 0}, {"min_tokens": 0}),
        ({"min_completion_tokens": 9}, {"min_completion_tokens": 1}),
        ({"stream": False, "max_tokens": None}, {"stream": False, "max_tokens": 1}),
    ],
)
def test_prime_body_follows_p1(extra: dict, expected: dict) -> None:
    body = {**CHAT, **extra}
    primed = prime_body(body)
    for key, value in expected.items():
        assert primed[key] == value
    assert "stream_options" not in primed
    assert primed["messages"] == CHAT["messages"]
    assert primed["temperature"] == 0


def test_prime_body_never_mutates_the_client_body() -> None:
    body = copy.deepcopy(CHAT)
    get_connector("nixl").prefill_body(body, "rid")
    assert body == CHAT


def test_prime_body_does_not_invent_max_completion_tokens() -> None:
    assert "max_completion_tokens" not in prime_body(CHAT)


def test_nixl_prefill_asks_for_remote_decode() -> None:
    out = get_connector("nixl").prefill_body(CHAT, "rid")
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["kv_transfer_params"]["do_remote_prefill"] is False


def test_nixl_decode_gets_complete_handles_verbatim() -> None:
    out = get_connector("nixl").decode_body(CHAT, {"kv_transfer_params": HANDLES}, "rid")
    assert out["kv_transfer_params"] == HANDLES
    assert out["stream"] is True and out["max_tokens"] == 64
    assert "kv_transfer_params" not in CHAT


@pytest.mark.parametrize("missing", ["remote_request_id", "remote_engine_id", "remote_block_ids",
                                     "remote_host", "remote_port"])
def test_nixl_decode_drops_incomplete_handles(missing: str, caplog: pytest.LogCaptureFixture,
                                              ) -> None:
    partial = {k: v for k, v in HANDLES.items() if k != missing}
    assert not complete_handles(partial)
    with caplog.at_level(logging.WARNING, logger="epd_flask"):
        out = get_connector("nixl").decode_body(CHAT, {"kv_transfer_params": partial}, "r-1")
    assert "kv_transfer_params" not in out
    assert missing in caplog.text and "r-1" in caplog.text


@pytest.mark.parametrize("reply", [None, {}, {"kv_transfer_params": None},
                                   {"kv_transfer_params": "junk"}])
def test_nixl_decode_without_handles_recomputes(reply: dict | None) -> None:
    out = get_connector("nixl").decode_body(CHAT, reply, "rid")
    assert "kv_transfer_params" not in out


def test_client_supplied_kv_params_never_reach_decode_unchecked() -> None:
    body = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True}}
    out = get_connector("nixl").decode_body(body, None, "rid")
    assert "kv_transfer_params" not in out


def test_none_connector_sends_no_handles() -> None:
    conn = get_connector("none")
    body = {**CHAT, "kv_transfer_params": {"x": 1}}
    assert "kv_transfer_params" not in conn.prefill_body(body, "rid")
    assert conn.prefill_body(body, "rid")["max_tokens"] == 1
    decode = conn.decode_body(body, {"kv_transfer_params": HANDLES}, "rid")
    assert "kv_transfer_params" not in decode
    assert decode["messages"] == CHAT["messages"]


def test_unknown_connector_is_refused() -> None:
    with pytest.raises(ValueError, match="not available"):
        get_connector("carrier-pigeon")
