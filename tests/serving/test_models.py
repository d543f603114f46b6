"""Several models behind one proxy (docs/behaviour.md#models): two simulated P/D pairs serving
different model names, a LoRA adapter loaded and unloaded at run time, through real HTTP."""

from __future__ import annotations

from typing import Any

import gevent
import requests

from tests.fakes import response
from tests.helpers import eventually, scrape, total
from tests.rosters import roster

PROBE = 0.05


def chat(model: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 4, **extra}
    if model is not None:
        body["model"] = model
    return body


def paired(pairs: list[tuple[Any, Any]], **settings: Any) -> dict[str, Any]:
    """Prefill/decode pairs probed often, evicted after two failures."""
    return roster([p for p, _ in pairs], [d for _, d in pairs],
                  **{"probe_interval": PROBE, "fail_threshold": 2, **settings})


def listed(px: Any) -> dict[str, dict[str, Any]]:
    r = requests.get(px.url + "/v1/models", timeout=5)
    assert r.status_code == 200, r.text
    return {card["id"]: card for card in r.json()["data"]}


def knows(px: Any, server: Any, model: str) -> bool:
    """Whether the proxy has read that ``server`` serves ``model``."""
    return model in (px.services.registry.get(server.url).served() or ())


def models_seen(*servers: Any) -> list[dict[str, int]]:
    return [s.state.stats()["models"] for s in servers]


def completions(*servers: Any) -> int:
    return sum(s.state.stats()["completions"] for s in servers)


def two_pairs(sim: Any, proxy: Any, **settings: Any) -> tuple[Any, ...]:
    p1, d1 = sim("prefill", model="alpha"), sim("decode", model="alpha")
    p2, d2 = sim("prefill", model="beta"), sim("decode", model="beta")
    px = proxy(paired([(p1, d1), (p2, d2)], **settings), probes=True)
    eventually(lambda: all(knows(px, s, m) for s, m in ((p1, "alpha"), (d1, "alpha"),
                                                         (p2, "beta"), (d2, "beta"))),
               what="every instance's models read")
    return px, p1, d1, p2, d2


def load(server: Any, name: str, path: str = "/adapters/x") -> None:
    r = requests.post(server.url + "/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": path}, timeout=5)
    assert r.status_code == 200, r.text


def unload(server: Any, name: str) -> None:
    r = requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name},
                      timeout=5)
    assert r.status_code == 200, r.text


def test_each_model_reaches_only_its_own_pair(sim, proxy) -> None:
    px, p1, d1, p2, d2 = two_pairs(sim, proxy)
    for i in range(6):
        model = "alpha" if i % 2 == 0 else "beta"
        r = requests.post(px.url + "/v1/chat/completions", json=chat(model, stream=i % 3 == 0),
                          timeout=5)
        assert r.status_code == 200, r.text
    r = requests.post(px.url + "/v1/completions",
                      json={"model": "beta", "prompt": "hi", "max_tokens": 3}, timeout=5)
    assert r.status_code == 200 and r.json()["model"] == "beta"
    assert models_seen(p1, d1) == [{"alpha": 3}, {"alpha": 3}]
    assert models_seen(p2, d2) == [{"beta": 4}, {"beta": 4}]
    # Every decode got its own prefill's KV, never the other pair's.
    assert d1.state.stats()["kv_handles_valid"] == 3
    assert d2.state.stats()["kv_handles_valid"] == 4


def test_models_lists_the_union_once_with_vllm_cards(sim, proxy) -> None:
    p1, d1 = sim("prefill", model="alpha"), sim("decode", model="alpha")
    p2, d2, d3 = sim("prefill", model="beta"), sim("decode", model="beta"), \
        sim("decode", model="beta")
    doc = paired([(p1, d1), (p2, d2)])
    doc["instances"].append({"role": "decode", "url": d3.url})
    px = proxy(doc, probes=True)
    eventually(lambda: knows(px, d3, "beta") and set(listed(px)) == {"alpha", "beta"},
               what="both models discovered")
    doc = requests.get(px.url + "/v1/models", timeout=5).json()
    assert doc["object"] == "list"
    assert sorted(c["id"] for c in doc["data"]) == ["alpha", "beta"]  # beta once, two decodes
    card = listed(px)["alpha"]
    assert card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["root"] == "models/alpha" and card["parent"] is None
    assert card["max_model_len"] == 512
    assert card["permission"][0]["object"] == "model_permission"
    # Only the probes ask the instances; the proxy answers clients itself.
    px.services.prober.stop()
    gevent.sleep(PROBE * 3)
    before = [s.state.stats()["requests"].get("/v1/models", 0) for s in (d1, d2, d3)]
    for _ in range(3):
        assert set(listed(px)) == {"alpha", "beta"}
    assert [s.state.stats()["requests"].get("/v1/models", 0) for s in (d1, d2, d3)] == before


def test_adapter_loaded_at_run_time_is_routed_only_where_it_is(sim, proxy) -> None:
    px, p1, d1, p2, d2 = two_pairs(sim, proxy)
    r = requests.post(px.url + "/v1/chat/completions", json=chat("sql-lora"), timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    load(d1, "sql-lora", "/adapters/sql")
    load(p1, "sql-lora", "/adapters/sql")
    eventually(lambda: knows(px, p1, "sql-lora") and "sql-lora" in listed(px),
               what="the adapter discovered on both")
    card = listed(px)["sql-lora"]
    assert card["parent"] == "alpha" and card["root"] == "/adapters/sql"
    for stream in (False, True, False):
        r = requests.post(px.url + "/v1/chat/completions", json=chat("sql-lora", stream=stream),
                          timeout=5)
        assert r.status_code == 200, r.text
        if not stream:
            assert r.json()["model"] == "sql-lora"
    assert models_seen(p1, d1) == [{"sql-lora": 3}, {"sql-lora": 3}]
    assert completions(p2, d2) == 0
    # Unloaded from decode: nobody serves it to clients any more, within one probe interval.
    unload(d1, "sql-lora")
    eventually(lambda: "sql-lora" not in listed(px), what="the adapter gone")
    before = completions(p1, d1, p2, d2)
    r = requests.post(px.url + "/v1/chat/completions", json=chat("sql-lora"), timeout=5)
    assert r.status_code == 404
    assert completions(p1, d1, p2, d2) == before


def test_adapter_on_decode_but_on_no_prefill_is_503_for_prefill(sim, proxy) -> None:
    px, p1, d1, p2, d2 = two_pairs(sim, proxy)
    load(d2, "chat-lora")
    eventually(lambda: "chat-lora" in listed(px), what="the adapter discovered")
    r = requests.post(px.url + "/v1/chat/completions", json=chat("chat-lora"), timeout=5)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_backend" and "chat-lora" in err["message"]
    assert "prefill" in err["message"]
    assert completions(p1, d1, p2, d2) == 0
    # The adapter's own base model is not enough: the KV must be computed with the adapter.
    load(p2, "chat-lora")
    eventually(lambda: knows(px, p2, "chat-lora"), what="prefill has it")
    r = requests.post(px.url + "/v1/chat/completions", json=chat("chat-lora"), timeout=5)
    assert r.status_code == 200, r.text
    assert models_seen(p2, d2) == [{"chat-lora": 1}, {"chat-lora": 1}]


def test_prefill_must_run_the_adapter_on_the_decodes_base_model(sim, proxy) -> None:
    px, p1, d1, p2, d2 = two_pairs(sim, proxy)
    # The same adapter name on both bases, but alpha's prefill lacks it: a request decoded on
    # beta must not be prefilled on alpha, and vice versa.
    for server in (d1, d2, p2):
        load(server, "shared-lora")
    eventually(lambda: all(knows(px, s, "shared-lora") for s in (d1, d2, p2)), what="discovery")
    codes = []
    for _ in range(4):
        r = requests.post(px.url + "/v1/chat/completions", json=chat("shared-lora"), timeout=5)
        codes.append(r.status_code)
    assert sorted(codes) == [200, 200, 503, 503]  # decode alternates; alpha has no prefill
    assert completions(p1) == 0
    assert models_seen(p2, d2) == [{"shared-lora": 2}, {"shared-lora": 2}]
    assert completions(d1) == 0


def test_unknown_model_is_404_without_calling_any_instance(sim, proxy) -> None:
    px, p1, d1, p2, d2 = two_pairs(sim, proxy)
    for path, body in (("/v1/chat/completions", chat("gamma", stream=True)),
                       ("/v1/completions", {"model": "gamma", "prompt": "x"})):
        r = requests.post(px.url + path, json=body, timeout=5)
        assert r.status_code == 404
        assert r.json() == {"error": {"message": "The model `gamma` does not exist.",
                                      "type": "invalid_request_error", "param": "model",
                                      "code": "model_not_found"}}
    assert completions(p1, d1, p2, d2) == 0


def test_model_served_only_by_evicted_instances_is_503(sim, proxy) -> None:
    px, _p1, _d1, p2, d2 = two_pairs(sim, proxy)
    d2.state.inject(health_fail=True)
    eventually(lambda: not px.services.registry.get(d2.url).live, what="beta's decode evicted")
    r = requests.post(px.url + "/v1/chat/completions", json=chat("beta"), timeout=5)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "no_backend" and "beta" in err["message"] and "evicted" in err["message"]
    assert set(listed(px)) == {"alpha"}  # /v1/models lists what live instances serve
    r = requests.post(px.url + "/v1/chat/completions", json=chat("alpha"), timeout=5)
    assert r.status_code == 200
    assert completions(p2, d2) == 0
    d2.state.inject(health_fail=False)
    eventually(lambda: px.services.registry.get(d2.url).live, what="beta's decode back")
    r = requests.post(px.url + "/v1/chat/completions", json=chat("beta"), timeout=5)
    assert r.status_code == 200


def test_missing_model_needs_exactly_one_model(sim, proxy) -> None:
    px, p1, d1, p2, d2 = two_pairs(sim, proxy)
    r = requests.post(px.url + "/v1/chat/completions", json=chat(None), timeout=5)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "model_required" and err["param"] == "model"
    assert "`alpha`" in err["message"] and "`beta`" in err["message"]
    assert completions(p1, d1, p2, d2) == 0


def test_missing_model_in_a_one_model_fleet_is_forwarded_unchanged(sim, proxy) -> None:
    p, d = sim("prefill", model="alpha"), sim("decode", model="alpha")
    px = proxy(paired([(p, d)]), probes=True)
    eventually(lambda: "alpha" in listed(px), what="discovery")
    load(d, "a-lora")  # an adapter does not make the fleet ambiguous: vLLM serves its base
    eventually(lambda: "a-lora" in listed(px), what="the adapter discovered")
    r = requests.post(px.url + "/v1/chat/completions", json=chat(None), timeout=5)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "alpha"
    assert "model" not in d.state.requests(1)[0]["body"]
    assert "model" not in p.state.requests(1)[0]["body"]


def test_roster_models_route_without_discovery(sim, proxy) -> None:
    p1, d1 = sim("prefill", model="alpha"), sim("decode", model="alpha")
    p2, d2 = sim("prefill", model="beta"), sim("decode", model="beta")
    alpha, beta = {"models": ["alpha"]}, {"models": ["beta"]}
    # No probes: the roster alone says who serves what.
    px = proxy(roster([(p1, alpha), (p2, beta)], [(d1, alpha), (d2, beta)]))
    for model in ("beta", "alpha", "beta"):
        r = requests.post(px.url + "/v1/chat/completions", json=chat(model), timeout=5)
        assert r.status_code == 200, r.text
    assert models_seen(d1, d2) == [{"alpha": 1}, {"beta": 2}]
    assert models_seen(p1, p2) == [{"alpha": 1}, {"beta": 2}]
    assert requests.post(px.url + "/v1/chat/completions", json=chat("gamma"),
                         timeout=5).status_code == 404
    ids = [c["id"] for c in requests.get(px.url + "/v1/models", timeout=5).json()["data"]]
    assert sorted(ids) == ["alpha", "beta"]


def test_combined_fleet_routes_by_model(sim, proxy) -> None:
    a, b = sim("prefill_decode", model="alpha"), sim("prefill_decode", model="beta")
    px = proxy(roster(combined=[a, b], probe_interval=PROBE), probes=True)
    eventually(lambda: set(listed(px)) == {"alpha", "beta"}, what="discovery")
    for model in ("alpha", "beta", "beta"):
        r = requests.post(px.url + "/v1/completions",
                          json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 200 and r.json()["model"] == model
    assert models_seen(a, b) == [{"alpha": 1}, {"beta": 2}]


def test_per_model_metrics_never_label_unknown_names(sim, proxy) -> None:
    px, _p1, _d1, _p2, d2 = two_pairs(sim, proxy)
    for model in ("alpha", "beta", "beta", "no-such-model", "x" * 50):
        requests.post(px.url + "/v1/chat/completions", json=chat(model), timeout=5)
    d2.state.inject(fail_next=2)  # decode fails, and fails its one retry
    assert requests.post(px.url + "/v1/chat/completions", json=chat("beta"),
                         timeout=5).status_code == 500
    after = scrape(px.url)
    assert total(after, "epd_model_requests_total", model="alpha") == 1
    assert total(after, "epd_model_requests_total", model="beta") == 3
    assert total(after, "epd_model_requests_total", model="") == 2
    assert total(after, "epd_model_errors_total", model="beta") == 1
    assert total(after, "epd_model_errors_total", model="alpha") == 0
    assert total(after, "epd_model_first_byte_seconds_count", model="beta") == 2
    labels = {dict(k).get("model") for (name, k) in after if name.startswith("epd_model_")}
    assert "no-such-model" not in labels and "x" * 50 not in labels


def test_status_page_has_a_row_per_served_model(sim, proxy) -> None:
    px, *_ = two_pairs(sim, proxy)
    for model in ("alpha", "beta", "beta", "<b>nope</b>"):
        requests.post(px.url + "/v1/chat/completions", json=chat(model), timeout=5)
    page = requests.get(px.url + "/status", timeout=5).text
    section = page.split("<h2>Models</h2>", 1)[1].split("</table>", 1)[0]
    assert '<td class="l">alpha</td>' in section and '<td class="l">beta</td>' in section
    assert "(not served)" in section and "nope" not in page


def model_reads(upstream: Any) -> int:
    return sum(r.startswith(b"GET /v1/models") for r in upstream.requests)


def test_an_unreadable_model_list_keeps_the_last_known_one(fake, proxy) -> None:
    answers = [b'{"object":"list","data":[{"id":"alpha","object":"model","parent":null}]}']

    def handle(conn, request: bytes) -> None:
        if request.startswith(b"GET /v1/models"):
            body = answers[-1]
            status = "500 Internal Server Error" if body == b"boom" else "200 OK"
            conn.sendall(response(status, body))
        else:
            conn.sendall(response("200 OK", b""))

    d = fake(handle)
    px = proxy(roster(combined=[d], probe_interval=PROBE), probes=True)
    state = px.services.registry.get(d.url)
    # The probes' read, not the listing: until they have read it, /v1/models passes through
    # to the instance and would show "alpha" before the proxy knows it.
    eventually(lambda: state.cards is not None, what="discovery by the probes")
    assert set(listed(px)) == {"alpha"}
    for bad in (b"boom", b"not json", b'{"data": [{"object": "model"}]}'):
        answers.append(bad)
        seen = model_reads(d)
        eventually(lambda seen=seen: model_reads(d) > seen + 1, what="two more reads")
        assert state.models_error and set(listed(px)) == {"alpha"}
        assert state.live  # /health alone decides liveness
    r = requests.post(px.url + "/v1/completions", json={"model": "beta", "prompt": "x"},
                      timeout=5)
    assert r.status_code == 404  # the list it kept still says what it serves


def test_other_routes_naming_a_model_reach_an_instance_serving_it(sim, proxy) -> None:
    px, _p1, d1, _p2, d2 = two_pairs(sim, proxy)
    for _ in range(3):
        r = requests.post(px.url + "/v1/embeddings", json={"model": "beta", "input": "x"},
                          timeout=5)
        assert r.status_code == 404  # the sim has no embeddings route; it was asked anyway
    assert d2.state.stats()["requests"].get("/v1/embeddings") == 3
    assert d1.state.stats()["requests"].get("/v1/embeddings") is None
