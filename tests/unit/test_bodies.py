"""Every connector's leg bodies and headers, as pure functions: the prefill body, nixl,
mooncake, none and p2p_nccl (docs/behaviour.md#prefill-and-decode)."""

from __future__ import annotations

import copy
import logging
import re

import pytest

from epd_flask.control.roster import Instance
from epd_flask.serving.connectors import CONNECTORS, Placement, Route, get_connector, prime_body
from epd_flask.serving.connectors.nixl import BadHandles, IncompleteHandles, complete_handles
from tests.bodies import chat_stream

CHAT = chat_stream("hi", stream_options={"include_usage": True}, max_tokens=64, temperature=0)
HANDLES = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "2033d88b-a27f-47b8-a92d-42c4256519c1",
    "remote_request_id": "cmpl-b10ac896ac4a061b-0-98623f46", "remote_host": "localhost",
    "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 81,
}
ENGINE = "7e353bae-55be-4d98-bec2-c552d3f1625f"
PREFILL = Instance(role="prefill", url="http://p:8100", bootstrap_url="http://p:8998",
                   kv_zmq_addr="10.0.0.1:21001")
DECODE = Instance(role="decode", url="http://d:8200", kv_zmq_addr="10.0.0.2:22001")


def route_of(name: str, attempt: int = 0, rank: int | None = None) -> tuple:
    conn = get_connector(name)
    placed = Placement(PREFILL, rank, ENGINE if rank is not None else None)
    return conn, conn.route(DECODE, placed, "rid-1", attempt)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, {"max_tokens": 1, "stream": False}),
        ({"max_completion_tokens": 200}, {"max_completion_tokens": 1}),
        ({"min_tokens": 5}, {"min_tokens": 1}),
        ({"min_tokens": 0}, {"min_tokens": 0}),
        ({"min_tokens": 1}, {"min_tokens": 1}),
        # vLLM's lax int: "5" and 5.0 are 5, which a one-token prefill would refuse.
        ({"min_tokens": "5"}, {"min_tokens": 1}),
        ({"min_tokens": 5.0}, {"min_tokens": 1}),
        ({"min_tokens": "0"}, {"min_tokens": "0"}),
        ({"min_completion_tokens": 9}, {"min_completion_tokens": 1}),
        ({"stream": False, "max_tokens": None}, {"stream": False, "max_tokens": 1}),
    ],
)
@pytest.mark.parametrize("name", sorted(CONNECTORS))
def test_every_prefill_leg_follows_p1(name: str, extra: dict, expected: dict) -> None:
    body = {**CHAT, **extra}
    conn, route = route_of(name, rank=0)
    primed = conn.prefill_leg(body, route).body
    for key, value in expected.items():
        assert primed[key] == value
    assert "stream_options" not in primed
    assert primed["messages"] == CHAT["messages"] and primed["temperature"] == 0
    assert {k: v for k, v in primed.items() if k != "kv_transfer_params"} == {
        k: v for k, v in prime_body(body).items() if k != "kv_transfer_params"}


@pytest.mark.parametrize("name", sorted(CONNECTORS))
def test_decode_leg_keeps_the_clients_generation_settings(name: str) -> None:
    body = {**CHAT, "max_completion_tokens": 50, "min_tokens": 3, "min_completion_tokens": 4}
    conn, route = route_of(name, rank=0)
    out = conn.decode_leg(body, route, {"kv_transfer_params": HANDLES}).body
    assert (out["stream"], out["max_tokens"], out["max_completion_tokens"]) == (True, 64, 50)
    assert (out["min_tokens"], out["min_completion_tokens"]) == (3, 4)
    assert out["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("name", sorted(CONNECTORS))
def test_no_leg_mutates_the_client_body(name: str) -> None:
    body = copy.deepcopy({**CHAT, "kv_transfer_params": {"x": 1}})
    conn, route = route_of(name, rank=0)
    conn.prefill_leg(body, route)
    conn.decode_leg(body, route, {"kv_transfer_params": HANDLES})
    assert body == {**CHAT, "kv_transfer_params": {"x": 1}}


def test_prime_body_does_not_invent_max_completion_tokens() -> None:
    assert "max_completion_tokens" not in prime_body(CHAT)
    assert "min_tokens" not in prime_body(CHAT)


def test_nixl_prefill_asks_for_remote_decode() -> None:
    conn, route = route_of("nixl")
    leg = conn.prefill_leg(CHAT, route)
    assert leg.body["kv_transfer_params"]["do_remote_decode"] is True
    assert leg.body["kv_transfer_params"]["do_remote_prefill"] is False
    assert leg.headers == {}


def test_nixl_decode_gets_complete_handles_verbatim() -> None:
    conn, route = route_of("nixl")
    out = conn.decode_leg(CHAT, route, {"kv_transfer_params": HANDLES}).body
    assert out["kv_transfer_params"] == HANDLES
    assert out["stream"] is True and out["max_tokens"] == 64
    assert "kv_transfer_params" not in CHAT


def test_nixl_decode_gets_keys_it_does_not_know_and_the_proxy_s_own_fields() -> None:
    conn, route = route_of("nixl")
    answered = {**HANDLES, "do_remote_prefill": "yes", "do_remote_decode": True,
                "next_release_key": {"a": [1, None]}}
    out = conn.decode_leg(CHAT, route, {"kv_transfer_params": answered}).body
    assert out["kv_transfer_params"] == {**answered, "do_remote_prefill": True,
                                         "do_remote_decode": False}


@pytest.mark.parametrize("missing", ["remote_request_id", "remote_engine_id", "remote_block_ids",
                                     "remote_host", "remote_port"])
@pytest.mark.parametrize("how", ["absent", "null", "empty"])
def test_nixl_handles_without_a_key_decode_needs_fail_loudly(
        missing: str, how: str, caplog: pytest.LogCaptureFixture) -> None:
    partial = {k: v for k, v in HANDLES.items() if k != missing}
    if how != "absent":
        partial[missing] = None if how == "null" else [] if missing == "remote_block_ids" \
            else ""
    if how == "empty" and missing == "remote_port":
        partial[missing] = None  # a port has no empty value of its type
    assert not complete_handles(partial)
    conn = get_connector("nixl")
    route = conn.route(DECODE, Placement(PREFILL), "r-1", 0)
    with caplog.at_level(logging.ERROR, logger="epd_flask"), \
            pytest.raises(IncompleteHandles, match=missing) as raised:
        conn.decode_leg(CHAT, route, {"kv_transfer_params": partial})
    assert raised.value.code == "incomplete_kv_handles"
    assert missing in caplog.text and "r-1" in caplog.text and PREFILL.url in caplog.text


@pytest.mark.parametrize("reply", [None, {}, {"kv_transfer_params": None}])
def test_nixl_decode_without_handles_recomputes(reply: dict | None) -> None:
    conn, route = route_of("nixl")
    assert "kv_transfer_params" not in conn.decode_leg(CHAT, route, reply).body


@pytest.mark.parametrize("params, why", [
    ("junk", "not an object"), ([HANDLES], "not an object"),
    ({**HANDLES, "padding": "x" * (1024 * 1024)}, r"bytes \(more than"),
])
def test_nixl_handles_that_are_no_object_or_too_large_are_a_bad_answer(params: object,
                                                                      why: str) -> None:
    conn, route = route_of("nixl")
    with pytest.raises(BadHandles, match=why) as raised:
        conn.decode_leg(CHAT, route, {"kv_transfer_params": params})
    assert raised.value.code == "bad_prefill_answer"


def test_client_supplied_kv_params_never_reach_decode_unchecked() -> None:
    body = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True}}
    conn, route = route_of("nixl")
    assert "kv_transfer_params" not in conn.decode_leg(body, route, None).body


def test_none_connector_sends_no_handles() -> None:
    conn, route = route_of("none")
    body = {**CHAT, "kv_transfer_params": {"x": 1}}
    assert "kv_transfer_params" not in conn.prefill_leg(body, route).body
    decode = conn.decode_leg(body, route, {"kv_transfer_params": HANDLES})
    assert "kv_transfer_params" not in decode.body and decode.headers == {}
    assert decode.body["messages"] == CHAT["messages"]
    assert conn.recomputes and not conn.concurrent


def test_mooncake_legs_meet_on_one_transfer_id() -> None:
    conn, route = route_of("mooncake", rank=1)
    assert conn.concurrent and not conn.recomputes
    prefill = conn.prefill_leg({**CHAT, "kv_transfer_params": {"x": 1}}, route)
    decode = conn.decode_leg({**CHAT, "kv_transfer_params": {"x": 1}}, route, None)
    assert prefill.body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-rid-1"}
    assert prefill.headers == {"X-data-parallel-rank": "1"}
    assert decode.body["kv_transfer_params"] == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": ENGINE,
        "remote_bootstrap_addr": "http://p:8998", "transfer_id": "xfer-rid-1"}
    assert decode.headers == {}
    assert decode.body["stream"] is True and decode.body["max_tokens"] == 64


def test_mooncake_transfer_id_is_the_routes_own_id() -> None:
    """The route's id is new per attempt (the pipeline's ``attempt_id``), so a retry gets a
    fresh transfer id without the connector counting attempts."""
    conn, route = route_of("mooncake", attempt=2, rank=0)
    retry = Route(route.prefill, route.decode, "rid-1-retry2", 2)
    ids = {conn.prefill_leg(CHAT, retry).body["kv_transfer_params"]["transfer_id"],
           conn.decode_leg(CHAT, retry, None).body["kv_transfer_params"]["transfer_id"]}
    assert ids == {"xfer-rid-1-retry2"}


def test_p2p_nccl_request_id_names_both_kv_addresses() -> None:
    conn, route = route_of("p2p_nccl")
    assert not conn.recomputes and not conn.concurrent
    prefill = conn.prefill_leg({**CHAT, "kv_transfer_params": {"x": 1}}, route)
    decode = conn.decode_leg({**CHAT, "kv_transfer_params": {"x": 1}}, route, None)
    rid = prefill.headers["X-Request-Id"]
    assert decode.headers == {"X-Request-Id": rid}
    assert re.fullmatch(r"___prefill_addr_10\.0\.0\.1:21001___decode_addr_10\.0\.0\.2:22001_"
                        r"[0-9a-f]{32}", rid)
    assert "kv_transfer_params" not in prefill.body and "kv_transfer_params" not in decode.body
    again = conn.route(DECODE, route.prefill, "rid-1", 1)
    assert again.request_id != route.request_id  # a retry never reuses a failed try's id


def test_unknown_connector_is_refused() -> None:
    with pytest.raises(ValueError, match="not available"):
        get_connector("carrier-pigeon")
