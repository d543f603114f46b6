"""The sim's runtime LoRA adapters, as vLLM serves them with VLLM_ALLOW_RUNTIME_LORA_UPDATING
(``vllm/entrypoints/openai/models/serving.py``): load, list with the base as parent, serve
under the adapter's name, unload."""

from __future__ import annotations

import requests


def test_load_list_serve_and_unload_an_adapter(sim) -> None:
    s = sim("prefill_decode", model="base-m")
    r = requests.post(s.url + "/v1/load_lora_adapter",
                      json={"lora_name": "sql", "lora_path": "/a/sql"}, timeout=5)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    cards = requests.get(s.url + "/v1/models", timeout=5).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("base-m", None, "models/base-m"), ("sql", "base-m", "/a/sql")]
    assert cards[1]["max_model_len"] is None and cards[1]["object"] == "model"
    r = requests.post(s.url + "/v1/completions",
                      json={"model": "sql", "prompt": "hi", "max_tokens": 2}, timeout=5)
    assert r.status_code == 200 and r.json()["model"] == "sql"
    r = requests.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      timeout=5)
    assert r.json()["model"] == "base-m"  # no model: the base serves, as vLLM
    assert s.state.stats()["models"] == {"sql": 1, "base-m": 1}
    r = requests.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=5)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    r = requests.post(s.url + "/v1/completions",
                      json={"model": "sql", "prompt": "hi", "max_tokens": 2}, timeout=5)
    assert r.status_code == 404
    assert r.json()["error"]["message"].startswith("The model `sql` does not exist.")


def test_adapter_refusals_are_vllms(sim) -> None:
    s = sim("decode", model="base-m")
    load = s.url + "/v1/load_lora_adapter"
    r = requests.post(load, json={"lora_name": "x"}, timeout=5)
    assert r.status_code == 400 and "Both 'lora_name' and 'lora_path'" in r.json()["error"][
        "message"]
    r = requests.post(load, json={"lora_name": "base-m", "lora_path": "/p"}, timeout=5)
    assert r.status_code == 400 and "conflicts with a served base model" in r.text
    assert requests.post(load, json={"lora_name": "x", "lora_path": "/p"},
                         timeout=5).status_code == 200
    r = requests.post(load, json={"lora_name": "x", "lora_path": "/p"}, timeout=5)
    assert r.status_code == 400 and "has already been loaded" in r.text
    assert requests.post(load, json={"lora_name": "x", "lora_path": "/q", "load_inplace": True},
                         timeout=5).status_code == 200
    r = requests.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=5)
    assert r.status_code == 404 and "cannot be found" in r.text
    assert r.json()["error"]["type"] == "NotFoundError"
