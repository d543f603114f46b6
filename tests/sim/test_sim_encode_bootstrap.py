"""The encoder role's ec_transfer_params, and the Mooncake bootstrap server."""

from __future__ import annotations

import hashlib
import json

import pytest
import requests

from tests.bodies import chat, chat_stream, image
from tests.sim.simclient import RawClient, load_sample, samples_available, shape

IMAGE_A = "data:image/png;base64," + "A" * 3000
IMAGE_B = "https://example.invalid/cat.png"
AUDIO = {"data": "UklGRg==", "format": "wav"}


def _chat(url: str, content, **extra) -> requests.Response:
    body = chat(content, **{"max_tokens": 1, **extra})
    return requests.post(url + "/v1/chat/completions", json=body, timeout=5)


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_encoder_returns_one_entry_per_item(start_sim):
    enc = start_sim(role="encode")
    content = [
        image(IMAGE_A),
        {"type": "text", "text": "what are these"},
        {"type": "image_url", "image_url": {"url": IMAGE_B}, "uuid": "my-uuid"},
        {"type": "input_audio", "input_audio": AUDIO},
    ]
    resp = _chat(enc.url, content)
    assert resp.status_code == 200
    body = resp.json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 0
    ec = body["ec_transfer_params"]
    key_a = hashlib.sha256(IMAGE_A.encode()).hexdigest()
    key_audio = hashlib.sha256(_canonical(AUDIO).encode()).hexdigest()
    assert list(ec) == [key_a, "my-uuid", key_audio]
    assert ec[key_a]["item_indices"] == [0] and ec["my-uuid"]["item_indices"] == [1]
    assert ec[key_audio]["item_indices"] == [2]
    thw = ec[key_a]["metadata"]["image_grid_thw"]
    assert thw[0] == 1 and thw[1] >= 2 and thw[1] == thw[2]
    assert enc.state.stats()["items_encoded"] == 3


def test_repeated_item_and_empty_metadata(start_sim):
    enc = start_sim(role="encode", ec_metadata="empty")
    content = [image(IMAGE_B)] * 2
    ec = _chat(enc.url, content).json()["ec_transfer_params"]
    (entry,) = ec.values()
    assert entry == {"item_indices": [0, 1], "metadata": {}}


@pytest.mark.skipif(not samples_available(), reason="captured vLLM samples not found")
def test_encoder_shape_matches_capture(start_sim):
    enc = start_sim(role="encode", ec_metadata="empty")
    body = _chat(enc.url, [image(IMAGE_A)]).json()
    theirs = json.loads(load_sample("ec-example/02-encoder-chat")[2])
    # The item keys are data (hashes), not field names: compare the entries' shape only.
    for one in (body, theirs):
        one["ec_transfer_params"] = list(one["ec_transfer_params"].values())
    assert shape(body) == shape(theirs)


def test_encoder_answers_text_only_requests_with_nothing(start_sim):
    """Real vLLM's encoder (ec-example/07): 200, empty content, ``ec_transfer_params`` null."""
    enc = start_sim(role="encode")
    resp = _chat(enc.url, "text only")
    assert resp.status_code == 200
    body = resp.json()
    assert body["ec_transfer_params"] is None
    assert body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 0
    assert enc.state.stats()["items_encoded"] == 0
    if samples_available():
        theirs = json.loads(load_sample("ec-example/07-encoder-text-only")[2])
        assert shape(body) == shape(theirs)


def test_encoder_stream_has_no_tokens(start_sim):
    enc = start_sim(role="encode")
    client = RawClient(enc.url)
    try:
        client.send("POST", "/v1/chat/completions",
                    chat_stream([image(IMAGE_B)]))
        events = client.read_response().events
    finally:
        client.close()
    # Real vLLM's encoder-only server (seen live): the role chunk, then [DONE]; no content
    # chunk and so no finish_reason.
    assert len(events) == 2 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_language_model_counts_ec_params(start_sim):
    lm = start_sim(role="prefill_decode")
    resp = _chat(lm.url, [image(IMAGE_B)],
                 ec_transfer_params={"k": {"item_indices": [0], "metadata": {}}})
    assert resp.status_code == 200
    assert lm.state.stats()["ec_params_received"] == 1


def test_bootstrap_query_shape_and_fresh_engine_ids(start_sim):
    p = start_sim(role="prefill", bootstrap_port=0, dp_size=2)
    query = requests.get(p.bootstrap_url + "/query", timeout=5)
    assert query.status_code == 200 and query.headers["content-type"] == "application/json"
    body = query.json()
    assert list(body) == ["0", "1"]
    assert body["0"]["engine_id"] == p.state.engine_id
    assert body["1"]["engine_id"] != body["0"]["engine_id"]
    assert body["0"]["worker_addr"]["0"]["0"].startswith("tcp://127.0.0.1:")
    if samples_available():
        _, _, captured = load_sample("pd-mooncake/01-mooncake-bootstrap-query")
        assert shape(body["0"]) == shape(json.loads(captured)["0"])
    again = start_sim(role="prefill", bootstrap_port=0, dp_size=2)
    ids = requests.get(again.bootstrap_url + "/query", timeout=5).json()
    assert {ids["0"]["engine_id"], ids["1"]["engine_id"]}.isdisjoint(
        {body["0"]["engine_id"], body["1"]["engine_id"]})
    assert requests.get(p.bootstrap_url + "/nope", timeout=5).status_code == 404


def test_no_bootstrap_unless_asked(start_sim):
    assert start_sim(role="prefill").bootstrap_url is None
    assert start_sim(role="decode", bootstrap_port=0).bootstrap_url is None
