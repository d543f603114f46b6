"""Prefill issues verifiable KV handles; decode judges the handles it gets as real vLLM would."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import gevent
import pytest
import requests

from tests import bodies
from tests.helpers import eventually
from tests.sim.simclient import RawClient, load_sample, samples_available, shape, sse_events

PROMPT = ("the quick brown fox jumps over the lazy dog and then tells me a story about cats "
          "dogs and birds one two three four five six seven eight nine ten hello world")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def _kind(chat: bool) -> tuple[str, Callable[..., dict[str, Any]]]:
    return ("/v1/chat/completions", bodies.chat) if chat else ("/v1/completions",
                                                              bodies.completion)


def _prefill(url: str, chat: bool = False, prompt: str = PROMPT, **extra) -> dict:
    path, build = _kind(chat)
    body = build(prompt, **{"max_tokens": 1, "stream": False,
                            "kv_transfer_params": PREFILL_PARAMS, **extra})
    resp = requests.post(url + path, json=body, timeout=5)
    assert resp.status_code == 200
    return resp.json()


def _decode(url: str, params: dict | None, chat: bool = False, prompt: str = PROMPT,
            **extra) -> requests.Response:
    path, build = _kind(chat)
    body = build(prompt, **{"max_tokens": 8, **extra})
    if params is not None:
        body["kv_transfer_params"] = params
    return requests.post(url + path, json=body, timeout=5)


@pytest.mark.parametrize("chat", [False, True])
def test_prefill_handle_is_valid_on_decode(start_sim, chat):
    p = start_sim(role="prefill")
    d = start_sim(role="decode")
    pre = _prefill(p.url, chat=chat)
    params = pre["kv_transfer_params"]
    assert pre["usage"]["completion_tokens"] == 1
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.state.engine_id
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_num_tokens"] == pre["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // 16)
    rid = params["remote_request_id"]
    assert rid.startswith(pre["id"] + ("-" if chat else "-0-"))
    dec = _decode(d.url, params, chat=chat)
    assert dec.status_code == 200
    assert dec.json()["kv_transfer_params"] is None
    stats = d.state.stats()
    assert stats["kv_handles_valid"] == 1 and stats["kv_handles_invalid"] == 0
    assert p.state.stats()["kv_handles_issued"] == 1
    # Disaggregated text equals what one server answers, and starts with the prefill's token.
    def text(body: dict) -> str:
        choice = body["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    single = start_sim(role="prefill_decode")
    assert text(dec.json()) == text(_decode(single.url, None, chat=chat).json())
    assert text(dec.json()).startswith(text(pre))


@pytest.mark.skipif(not samples_available(), reason="captured vLLM samples not found")
def test_prefill_response_shape_matches_nixl_capture(start_sim):
    p = start_sim(role="prefill")
    _, _, captured = load_sample("pd-nixl/03-completion-prefill")
    assert shape(_prefill(p.url)) == shape(json.loads(captured))


@pytest.mark.parametrize("tamper", [
    lambda p: p.update(remote_num_tokens=p["remote_num_tokens"] - 1),
    lambda p: p.update(remote_engine_id="0a9f1b60-0000-4000-8000-000000000000"),
    lambda p: p.update(remote_request_id=p["remote_request_id"][:-1] + "x"),
    lambda p: p.update(remote_request_id="cmpl-0123456789abcdef-0-00000000"),
])
def test_tampered_handle_is_invalid(start_sim, tamper):
    p, d = start_sim(role="prefill"), start_sim(role="decode")
    params = _prefill(p.url)["kv_transfer_params"]
    tamper(params)
    assert _decode(d.url, params).status_code == 200
    assert d.state.stats()["kv_handles_invalid"] == 1


def test_handle_for_another_prompt_is_invalid(start_sim):
    p, d = start_sim(role="prefill"), start_sim(role="decode")
    params = _prefill(p.url, prompt="a short prompt")["kv_transfer_params"]
    _decode(d.url, params)  # the decode's own prompt is longer
    assert d.state.stats()["kv_handles_invalid"] == 1


def test_other_secret_makes_handles_invalid(start_sim):
    p, d = start_sim(role="prefill", secret="a"), start_sim(role="decode", secret="b")
    _decode(d.url, _prefill(p.url)["kv_transfer_params"])
    assert d.state.stats()["kv_handles_invalid"] == 1


def test_decode_without_params_recomputes(start_sim):
    d = start_sim(role="decode")
    assert _decode(d.url, None).status_code == 200
    assert _decode(d.url, {"do_remote_decode": True}).status_code == 200
    assert d.state.stats()["kv_handles_absent"] == 2


def test_plain_server_ignores_kv_params(start_sim):
    pd = start_sim(role="prefill_decode")
    body = _prefill(pd.url)
    assert body["kv_transfer_params"] is None
    assert body["usage"]["completion_tokens"] == 1


def test_prefill_without_remote_decode_answers_plainly(start_sim):
    p = start_sim(role="prefill", output_tokens=4)
    resp = requests.post(p.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                         timeout=5).json()
    assert resp["kv_transfer_params"] is None and resp["usage"]["completion_tokens"] == 4
    assert p.state.stats()["kv_handles_issued"] == 0


def test_streamed_prefill_sends_one_chunk_without_params(start_sim):
    p = start_sim(role="prefill")
    client = RawClient(p.url)
    try:
        client.send("POST", "/v1/completions",
                    {"prompt": PROMPT, "max_tokens": 1, "stream": True,
                     "kv_transfer_params": PREFILL_PARAMS})
        events = client.read_response().events
    finally:
        client.close()
    assert len(events) == 2 and events[-1] == "[DONE]"
    assert "kv_transfer_params" not in events[0]
    assert events[0]["choices"][0]["finish_reason"] == "length"
    assert "system_fingerprint" in events[0]
    if samples_available():
        _, _, captured = load_sample("pd-nixl/13-prefill-stream-with-kv-params")
        assert shape(events[0]) == shape(sse_events(captured)[0])


def test_prefix_cache_reports_cached_blocks(start_sim):
    p = start_sim(role="prefill", prompt_tokens_details=True)
    first = _prefill(p.url)
    assert first["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    assert first["usage"]["prompt_tokens_details"] is None
    second = _prefill(p.url, prompt=PROMPT + " and again with more words")
    cached = second["kv_transfer_params"]["remote_prefill_cached_tokens"]
    assert cached > 0 and cached % 16 == 0
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert cached < second["usage"]["prompt_tokens"]


def test_prompt_details_stay_null_without_the_flag(start_sim):
    """Real vLLM reports prefix-cache hits in usage only with --enable-prompt-tokens-details;
    by default the captures show null even when the prefill had 64 tokens cached."""
    p = start_sim(role="prefill")
    _prefill(p.url)
    second = _prefill(p.url, prompt=PROMPT + " and again with more words")
    assert second["kv_transfer_params"]["remote_prefill_cached_tokens"] > 0
    assert second["usage"]["prompt_tokens_details"] is None


def test_incomplete_handle_hangs_then_kills_the_engine(start_sim):
    d = start_sim(role="decode")
    bogus = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "nope",
             "remote_block_ids": [0, 1], "remote_host": "127.0.0.1", "remote_port": 1,
             "tp_size": 1}
    client = RawClient(d.url, timeout=0.3)
    client.send("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                            "kv_transfer_params": bogus})
    with pytest.raises(TimeoutError):
        client.read_head()  # no answer while the client waits
    assert d.state.stats()["kv_handles_incomplete"] == 1
    assert requests.get(d.url + "/health", timeout=5).status_code == 200
    client.close()
    assert eventually(lambda: requests.get(d.url + "/health", timeout=5).status_code == 503)
    dead = _decode(d.url, None)
    assert dead.status_code == 500 and dead.json()["error"]["code"] == 500
    d.state.reset()
    assert requests.get(d.url + "/health", timeout=5).status_code == 200


def test_a_handle_without_block_ids_kills_the_engine_at_once(start_sim):
    """vLLM 0.32's NixlConnector: ``do_remote_prefill`` (any truthy value) with no
    ``remote_block_ids`` makes its scheduler assert that nothing is to be loaded, which is
    false for a prompt, and the EngineCore dies with the request."""
    d = start_sim(role="decode")
    p = start_sim(role="prefill")
    params = {**_prefill(p.url)["kv_transfer_params"], "do_remote_prefill": 1,
              "remote_block_ids": []}
    dead = _decode(d.url, params)
    assert dead.status_code == 500 and d.state.stats()["kv_handles_no_blocks"] == 1
    assert requests.get(d.url + "/health", timeout=5).status_code == 503


def test_decode_checks_the_keys_present_not_their_values(start_sim):
    """vLLM checks the four keys with ``in``: a null one passes the check, and the transfer
    it names fails (vLLM then computes the prompt itself); an absent one hangs."""
    p, d = start_sim(role="prefill"), start_sim(role="decode")
    params = {**_prefill(p.url)["kv_transfer_params"], "remote_host": None}
    assert _decode(d.url, params).status_code == 200
    assert d.state.stats()["kv_handles_invalid"] == 1


def test_a_prefill_can_answer_handles_of_another_vllm_release(start_sim):
    """Live knobs: ``kv_params_extra`` adds keys (one a later vLLM may send), and
    ``kv_params_omit`` leaves keys out (one an earlier or broken one may not send)."""
    p, d = start_sim(role="prefill"), start_sim(role="decode")
    p.state.configure(kv_params_extra={"remote_dp_rank": 0, "future": {"x": [1]}},
                      kv_params_omit=["tp_size"])
    params = _prefill(p.url)["kv_transfer_params"]
    assert params["future"] == {"x": [1]} and params["remote_dp_rank"] == 0
    assert "tp_size" not in params
    assert _decode(d.url, params).status_code == 200
    assert d.state.stats()["kv_handles_valid"] == 1
    with pytest.raises(ValueError, match="kv_params_omit"):
        p.state.configure(kv_params_omit="tp_size")


def test_mooncake_prefill_and_decode(start_sim):
    p = start_sim(role="prefill", bootstrap_port=0)
    d = start_sim(role="decode")
    pre = _prefill(p.url, kv_transfer_params={"do_remote_decode": True,
                                              "do_remote_prefill": False,
                                              "transfer_id": "xfer-1"})
    assert pre["kv_transfer_params"] is None
    query = requests.get(p.bootstrap_url + "/query", timeout=5).json()
    params = {"do_remote_decode": False, "do_remote_prefill": True,
              "remote_engine_id": query["0"]["engine_id"],
              "remote_bootstrap_addr": p.bootstrap_url, "transfer_id": "xfer-1"}
    assert _decode(d.url, params).status_code == 200
    assert _decode(d.url, {**params, "remote_engine_id": "not-a-uuid"}).status_code == 200
    stats = d.state.stats()
    assert stats["kv_handles_mooncake"] == 1 and stats["kv_handles_invalid"] == 1


def test_dp_rank_header(start_sim):
    p = start_sim(role="prefill", dp_size=2)
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    r1 = requests.post(p.url + "/v1/completions", json=body,
                       headers={"x-data-parallel-rank": "1"}, timeout=5).json()
    assert r1["kv_transfer_params"]["remote_engine_id"] == p.state.rank_engine_ids[1]
    assert r1["kv_transfer_params"]["remote_engine_id"] != p.state.engine_id
    bad = requests.post(p.url + "/v1/completions", json=body,
                        headers={"x-data-parallel-rank": "2"}, timeout=5)
    assert bad.status_code == 400
    assert p.state.stats()["dp_ranks"] == {"1": 1}


def test_mooncake_decode_waits_for_the_prefill_it_was_pointed_at(start_sim):
    """Decode may arrive first; it pulls once that prefill settled the same transfer id."""
    p = start_sim(role="prefill", bootstrap_port=0, ttft=0.2)
    d = start_sim(role="decode", kv_timeout=2.0)
    engine = requests.get(p.bootstrap_url + "/query", timeout=5).json()["0"]["engine_id"]
    params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine,
              "remote_bootstrap_addr": p.bootstrap_url, "transfer_id": "xfer-early"}
    early = gevent.spawn(_decode, d.url, params)
    gevent.sleep(0.05)
    assert not early.ready()  # no prefill has seen xfer-early yet
    _prefill(p.url, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                        "transfer_id": "xfer-early"})
    assert early.get(timeout=5).status_code == 200
    assert d.state.stats()["kv_handles_mooncake"] == 1


def test_mooncake_decode_with_a_transfer_nobody_computes_times_out(start_sim):
    p = start_sim(role="prefill", bootstrap_port=0)
    d = start_sim(role="decode", kv_timeout=0.3)
    engine = requests.get(p.bootstrap_url + "/query", timeout=5).json()["0"]["engine_id"]
    params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine,
              "remote_bootstrap_addr": p.bootstrap_url, "transfer_id": "xfer-never"}
    r = _decode(d.url, params)
    assert r.status_code == 500 and "KV transfer" in r.json()["error"]["message"]
    assert d.state.stats()["kv_transfers_timed_out"] == 1
    other = start_sim(role="prefill", bootstrap_port=0)  # an engine id this bootstrap never issued
    wrong = _decode(d.url, {**params, "remote_bootstrap_addr": other.bootstrap_url})
    assert wrong.status_code == 200 and d.state.stats()["kv_handles_invalid"] == 1


def test_prefill_allowed_more_tokens_hands_off_them_all(start_sim):
    """Real vLLM (seen live): a do_remote_decode prefill given max_tokens 8 generates 8
    tokens, reports remote_num_tokens = prompt + 7 and no remote_prefill_cached_tokens; a
    decode reads min(remote_num_tokens, its prompt), so the handle is still good."""
    p, d = start_sim(role="prefill"), start_sim(role="decode")
    body = {"prompt": PROMPT, "max_tokens": 8,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    doc = requests.post(p.url + "/v1/completions", json=body, timeout=5).json()
    params = doc["kv_transfer_params"]
    assert doc["usage"]["completion_tokens"] == 8
    assert params["remote_num_tokens"] == doc["usage"]["prompt_tokens"] + 7
    assert "remote_prefill_cached_tokens" not in params
    assert _decode(d.url, params).status_code == 200
    assert d.state.stats()["kv_handles_valid"] == 1


def test_mooncake_transfer_id_shared_by_two_prompts_crosses_answers(start_sim):
    """A transfer table keyed by id: a second prefill under the same id takes the slot over,
    and a decode pulling it answers from that prompt's KV, as a real decode would."""
    p = start_sim(role="prefill", bootstrap_port=0, ttft=0.5)
    d = start_sim(role="decode")
    engine = requests.get(p.bootstrap_url + "/query", timeout=5).json()["0"]["engine_id"]
    prefill_params = {"do_remote_decode": True, "do_remote_prefill": False,
                      "transfer_id": "xfer-shared"}
    params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine,
              "remote_bootstrap_addr": p.bootstrap_url, "transfer_id": "xfer-shared"}

    def decode(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 6, "kv_transfer_params": params}
        return requests.post(d.url + "/v1/completions", json=body,
                             timeout=5).json()["choices"][0]["text"]

    alone = requests.post(d.url + "/v1/completions", json={"prompt": "other", "max_tokens": 6},
                          timeout=5).json()["choices"][0]["text"]
    # One after the other: "other" must be the second to take the slot, which two requests
    # sent at once do not promise on a loaded machine.
    prefills = []
    for n, prompt in enumerate((PROMPT, "other"), start=1):
        prefills.append(gevent.spawn(_prefill, p.url, prompt=prompt,
                                     kv_transfer_params=prefill_params))
        eventually(lambda n=n: p.state.stats()["in_flight"] >= n, what=f"{n} prefills in flight")
    crossed = decode(PROMPT)
    gevent.joinall(prefills, raise_error=True)
    assert crossed == alone  # the KV it pulled was the other prompt's
    assert d.state.stats()["kv_transfers_crossed"] == 1
