"""Several models behind one proxy against real vLLM (docs/behaviour.md#models): two NIXL P/D
pairs serving two different tiny models, discovered from their own ``/v1/models``; a LoRA
adapter built locally, loaded on one pair at run time, routed only there, then unloaded."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import requests

from tests.bodies import completion
from tests.helpers import eventually
from tests.rosters import roster
from tests.vllm.checks import kv_delta, post, unique_prompt
from tests.vllm.fleet import LORA_NAME, MODEL_NAME, MODELS, SECOND_MODEL, VllmServer

pytestmark = pytest.mark.vllm

#: The proxy reads every instance's /v1/models each probe round.
PROBE_INTERVAL = 0.5
DISCOVERY_SECONDS = 30.0
SUCCESSES = "vllm:request_success_total"


@pytest.fixture(scope="module")
def two(fleet):
    top = fleet.up("models")
    pa, da, pb, db = top.servers
    proxy = fleet.proxy(roster([pa, pb], [da, db], connector="nixl", decode_retries=0,
                               probe_interval=PROBE_INTERVAL))
    ns = SimpleNamespace(pa=pa, da=da, pb=pb, db=db, proxy=proxy)
    wait_listed(ns, lambda ids: {MODEL_NAME, SECOND_MODEL} <= ids, "both models")
    return ns


def listed(two) -> dict[str, dict]:
    r = requests.get(two.proxy.url + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return {card["id"]: card for card in r.json()["data"]}


def wait_listed(two, check, what: str) -> dict[str, dict]:
    cards: dict[str, dict] = {}

    def shown() -> bool:
        nonlocal cards
        cards = listed(two)
        return check(set(cards))
    eventually(shown, DISCOVERY_SECONDS, interval=0.2,
               what=lambda: f"{what}: the proxy lists {sorted(cards)}")
    return cards


def successes(*servers: VllmServer) -> list[float]:
    return [s.metrics().get(SUCCESSES, 0.0) for s in servers]


def body(model: str, tag: str) -> dict:
    return completion(unique_prompt(tag), model=model, max_tokens=8, temperature=0)


def test_models_are_the_union_of_both_decodes_cards(two):
    cards = listed(two)
    assert {MODEL_NAME, SECOND_MODEL} <= set(cards)
    for model in (MODEL_NAME, SECOND_MODEL):
        card = cards[model]
        # vLLM's own card, as the decode answered it: root is the model's path.
        assert card["object"] == "model" and card["owned_by"] == "vllm"
        assert card["root"] == str(MODELS / model) and card["parent"] is None
        assert card["max_model_len"] == 512


@pytest.mark.parametrize("model", [MODEL_NAME, SECOND_MODEL])
def test_each_model_is_served_by_its_own_pair(two, model):
    own, other = ((two.pa, two.da), (two.pb, two.db)) if model == MODEL_NAME else \
        ((two.pb, two.db), (two.pa, two.da))
    request = body(model, f"models {model}")
    before, others_before = own[1].metrics(), successes(*other)

    reply = post(two.proxy.url, "/v1/completions", request)

    assert reply.status == 200, reply.raw
    assert reply.json["model"] == model
    usage = reply.json["usage"]
    pulled = kv_delta(own[1], before, usage["prompt_tokens"])
    # The decode of this model's pair pulled the whole prompt's KV from its prefill.
    assert pulled.external == usage["prompt_tokens"] and pulled.local == 0, pulled
    assert successes(*other) == others_before
    # Greedy, so the answer is the one the model's own server gives alone.
    alone = post(own[0].url, "/v1/completions", request)
    assert alone.status == 200 and reply.json["choices"][0]["text"] == \
        alone.json["choices"][0]["text"]


def test_an_unknown_model_is_404_without_any_call(two):
    reply = post(two.proxy.url, "/v1/completions", body("no-such-model", "unknown"))
    assert reply.status == 404
    assert reply.json["error"]["code"] == "model_not_found"
    # The proxy's sentence: a vLLM that had been asked would add "Valid aliases: ...".
    assert reply.json["error"]["message"] == "The model `no-such-model` does not exist."


def test_an_adapter_loaded_at_run_time_is_routed_to_its_pair_only(two):
    adapter = str(MODELS / LORA_NAME)
    for server in (two.pa, two.da):
        r = requests.post(server.url + "/v1/load_lora_adapter",
                          json={"lora_name": LORA_NAME, "lora_path": adapter}, timeout=120)
        assert r.status_code == 200, r.text
    try:
        cards = wait_listed(two, lambda ids: LORA_NAME in ids, "the adapter")
        assert cards[LORA_NAME]["parent"] == MODEL_NAME
        assert cards[LORA_NAME]["root"] == adapter
        time.sleep(2 * PROBE_INTERVAL)  # its prefill is read in the same round, or the next
        request = body(LORA_NAME, "lora")
        before, others_before = two.da.metrics(), successes(two.pb, two.db)

        reply = post(two.proxy.url, "/v1/completions", request)

        assert reply.status == 200, reply.raw
        assert reply.json["model"] == LORA_NAME
        usage = reply.json["usage"]
        pulled = kv_delta(two.da, before, usage["prompt_tokens"])
        assert pulled.external == usage["prompt_tokens"] and pulled.local == 0, pulled
        assert successes(two.pb, two.db) == others_before
        # The adapter's KV and tokens: the same text as the adapter on one server, and (its
        # B matrices are far from zero) not the base model's.
        alone = post(two.pa.url, "/v1/completions", request)
        base = post(two.pa.url, "/v1/completions", {**request, "model": MODEL_NAME})
        text = reply.json["choices"][0]["text"]
        assert text == alone.json["choices"][0]["text"]
        assert text != base.json["choices"][0]["text"]
    finally:
        for server in (two.da, two.pa):
            requests.post(server.url + "/v1/unload_lora_adapter",
                          json={"lora_name": LORA_NAME}, timeout=120)
    wait_listed(two, lambda ids: LORA_NAME not in ids, "the adapter gone")
    reply = post(two.proxy.url, "/v1/completions", body(LORA_NAME, "lora gone"))
    assert reply.status == 404 and reply.json["error"]["code"] == "model_not_found"
    assert reply.json["error"]["message"] == f"The model `{LORA_NAME}` does not exist."


def test_a_missing_model_is_refused_when_two_are_served(two):
    request = body(MODEL_NAME, "no model")
    del request["model"]
    reply = post(two.proxy.url, "/v1/completions", request)
    assert reply.status == 400 and reply.json["error"]["code"] == "model_required"
