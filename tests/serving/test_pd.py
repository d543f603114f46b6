"""The P+D and PD serving paths through real HTTP against the simulated fleet."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from typing import Any

import requests

from tests.bodies import chat, completion
from tests.helpers import RawStream, eventually, scrape, total
from tests.rosters import roster

CHAT = chat(max_tokens=8, temperature=0)
COMPLETION = completion(max_tokens=6)


def sse_events(resp: requests.Response) -> list[str]:
    text = resp.content.decode("utf-8")
    return [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]


def completions_seen(*servers) -> int:
    return sum(s.state.stats()["completions"] for s in servers)


def test_pd_non_stream_decode_gets_prefill_handles(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    r = requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "text_completion" and doc["choices"][0]["text"]
    assert doc["usage"]["completion_tokens"] == 6
    assert d.state.stats()["kv_handles_valid"] == 1
    assert d.state.stats()["kv_handles_absent"] == 0
    prefill_body = p.state.requests(1)[0]["body"]
    assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    decode_body = d.state.requests(1)[0]["body"]
    assert decode_body["max_tokens"] == 6
    assert decode_body["kv_transfer_params"]["remote_request_id"]


def test_stream_chat_relays_every_event_and_done(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r = requests.post(px.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers["X-Accel-Buffering"] == "no"
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    # stream_options never reached prefill, and prefill did not stream
    prefill_body = p.state.requests(1)[0]["body"]
    assert "stream_options" not in prefill_body and prefill_body["stream"] is False
    assert d.state.stats()["kv_handles_valid"] == 1


def test_relayed_bytes_equal_what_decode_sends_directly(sim, proxy) -> None:
    """Multi-byte characters split across chunks survive: the relay moves bytes, not text."""
    p, d = sim("prefill"), sim("decode", output_tokens=40)
    px = proxy(roster([p], [d]))
    body = {**COMPLETION, "max_tokens": 40, "stream": True, "temperature": 0}
    via_proxy = requests.post(px.url + "/v1/completions", json=body, timeout=10)
    direct = requests.post(d.url + "/v1/completions", json=body, timeout=10)
    texts = []
    for resp in (via_proxy, direct):
        events = [json.loads(e) for e in sse_events(resp) if e != "[DONE]"]
        texts.append("".join(c["choices"][0]["text"] for c in events if c["choices"]))
    assert texts[0] == texts[1] and texts[0]
    assert any(ord(ch) > 127 for ch in texts[0]), "sim vocabulary should exercise UTF-8"


def test_client_request_id_comes_back_and_upstream_gets_our_own(sim, proxy, caplog) -> None:
    """The client's id is for the client and the logs; instances key state on the id they
    get, so every proxied request gets a new one that both of its legs share."""
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        r = requests.post(px.url + "/v1/completions", json=COMPLETION,
                          headers={"X-Request-Id": "client-abc-1"}, timeout=10)
    assert r.headers["X-Request-Id"] == "client-abc-1"
    upstream = p.state.requests(1)[0]["headers"]["x-request-id"]
    assert d.state.requests(1)[0]["headers"]["x-request-id"] == upstream
    assert re.fullmatch(r"[0-9a-f]{32}", upstream)
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "epd_flask.requests"]
    assert f"request_id=client-abc-1 upstream_id={upstream} " in line
    again = requests.post(px.url + "/v1/completions", json=COMPLETION,
                          headers={"X-Request-Id": "client-abc-1"}, timeout=10)
    assert again.headers["X-Request-Id"] == "client-abc-1"
    assert p.state.requests(1)[0]["headers"]["x-request-id"] not in (upstream, "client-abc-1")
    generated = requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)
    rid = generated.headers["X-Request-Id"]
    assert len(rid) == 32
    assert d.state.requests(1)[0]["headers"]["x-request-id"] != rid


def test_only_allowlisted_headers_are_forwarded(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10,
                  headers={"Authorization": "Bearer sk-1", "Cookie": "session=1"})
    seen = d.state.requests(1)[0]["headers"]
    assert seen["authorization"] == "Bearer sk-1"
    assert "cookie" not in seen


def test_combined_pd_instances_get_the_request_directly(sim, proxy) -> None:
    pd1, pd2 = sim("prefill_decode"), sim("prefill_decode")
    px = proxy(roster(combined=[pd1, pd2]))
    for _ in range(4):
        r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200
    assert pd1.state.stats()["completions"] == 2 and pd2.state.stats()["completions"] == 2
    assert "kv_transfer_params" not in pd1.state.requests(1)[0]["body"]
    assert pd1.state.requests(1)[0]["body"]["max_tokens"] == 8


def test_round_robin_spreads_prefill_and_decode(sim, proxy) -> None:
    ps = [sim("prefill"), sim("prefill")]
    ds = [sim("decode"), sim("decode")]
    px = proxy(roster(ps, ds))
    for _ in range(6):
        assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    assert [s.state.stats()["completions"] for s in ps + ds] == [3, 3, 3, 3]
    assert sum(d.state.stats()["kv_handles_valid"] for d in ds) == 6


def test_decode_500_once_is_retried_with_a_fresh_prefill(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], decode_retries=1))
    d.state.inject(fail_next=1)
    r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=10)
    assert r.status_code == 200
    assert sse_events(r)[-1] == "[DONE]"
    assert d.state.stats()["failed_injected"] == 1
    # A retry runs prefill again (docs/behaviour.md#failover).
    assert p.state.stats()["completions"] == 2
    assert d.state.stats()["kv_handles_valid"] == 1


def test_decode_500_beyond_retries_reaches_the_client(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], decode_retries=1))
    d.state.inject(fail_next=5)
    r = requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 500
    assert set(r.json()["error"]) >= {"message", "type", "code"}
    assert d.state.stats()["failed_injected"] == 2


def test_decode_dying_mid_stream_ends_with_an_error_event(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", output_tokens=20)
    px = proxy(roster([p], [d], decode_retries=3))
    d.state.inject(drop_after=3)
    r = requests.post(px.url + "/v1/completions", json={**COMPLETION, "max_tokens": 20,
                                                        "stream": True}, timeout=10)
    assert r.status_code == 200
    events = sse_events(r)
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "stream_interrupted"
    assert "decode" in last["error"]["message"]
    assert all("choices" in json.loads(e) for e in events[:-1])
    # Never retried after bytes reached the client.
    assert d.state.stats()["completions"] == 1


def test_body_that_is_not_an_object_is_400_and_no_backend_is_called(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    for raw in (b"[1,2]", b"42", b"{", b""):
        r = requests.post(px.url + "/v1/chat/completions", data=raw, timeout=10,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400, raw
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.post(px.url + "/v1/completions", data=b"model=x", timeout=10,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    assert completions_seen(p, d) == 0


def test_no_decode_is_503_and_prefill_is_not_called(sim, proxy) -> None:
    p = sim("prefill")
    px = proxy(roster([p], []))
    r = requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_backend"
    assert "decode" in r.json()["error"]["message"]
    assert completions_seen(p) == 0


def test_unreachable_decode_is_503_never_partial_output(sim, proxy) -> None:
    p = sim("prefill")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    px = proxy(roster([p], [f"http://127.0.0.1:{port}"]))
    r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "upstream_unavailable"


def test_evicted_decode_is_skipped_by_the_passive_signal(sim, proxy) -> None:
    p, good = sim("prefill"), sim("decode")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    px = proxy(roster([p], [f"http://127.0.0.1:{port}", good], fail_threshold=1,
                      decode_retries=1))
    for _ in range(4):
        assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    assert good.state.stats()["completions"] == 4
    health = requests.get(px.url + "/health", timeout=5).json()
    assert health["instances"]["decode"] == {"live": 1, "evicted": 1}
    assert px.services.registry.snapshot()["decode"]["evicted"] == [f"http://127.0.0.1:{port}"]


def test_prefill_rejecting_the_request_is_relayed_and_decode_not_called(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    r = requests.post(px.url + "/v1/completions", json={**COMPLETION, "model": "nope"},
                      timeout=10)
    assert r.status_code == 404
    assert "nope" in r.json()["error"]["message"]
    assert completions_seen(d) == 0


def decode_handles_received(d) -> list[Any]:
    return [r["body"].get("kv_transfer_params") for r in d.state.requests()
            if r["path"] == "/v1/completions"]


def test_decode_gets_every_handle_prefill_answered_new_keys_included(sim, proxy) -> None:
    """A later vLLM may add keys to its handles: decode gets them verbatim, and pulls."""
    p, d = sim("prefill"), sim("decode")
    future = {"remote_dp_rank": 0, "kv_layout": {"blocks": [[1, 2]], "dtype": "fp8"}}
    p.state.configure(kv_params_extra=future)
    px = proxy(roster([p], [d]))
    r = requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 200, r.text
    (got,) = decode_handles_received(d)
    assert {k: got[k] for k in future} == future
    assert got["do_remote_prefill"] is True and got["remote_request_id"]
    assert d.state.stats()["kv_handles_valid"] == 1


def test_handles_without_a_key_decode_needs_fail_the_attempt_loudly(sim, proxy,
                                                                   caplog) -> None:
    """Real vLLM hangs a request whose handles lack remote_request_id (and its engine dies
    when the client leaves); dropping them would recompute in silence. The attempt fails with
    a 502 naming the key, an error in the log, and a count; decode never sees the request."""
    p, d = sim("prefill"), sim("decode")
    p.state.configure(kv_params_omit=["remote_request_id"])
    px = proxy(roster([p], [d]))
    before = total(scrape(px.url), "epd_upstream_errors_total", stage="prefill",
                   kind="incomplete_kv_handles")
    with caplog.at_level(logging.ERROR, logger="epd_flask.serving.connectors.nixl"):
        r = requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "incomplete_kv_handles" and "remote_request_id" in err["message"]
    assert any("remote_request_id" in m and "the attempt fails" in m
               for m in caplog.messages), caplog.messages
    assert total(scrape(px.url), "epd_upstream_errors_total", stage="prefill",
                 kind="incomplete_kv_handles") == before + 1
    assert decode_handles_received(d) == [] and not d.state.stats()["engine_dead"]


def test_first_token_arrives_before_decode_finishes(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.05, output_tokens=10)
    px = proxy(roster([p], [d]))
    body = {**CHAT, "max_tokens": 10, "stream": True}
    with requests.post(px.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=10) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: "))
        assert b"chat.completion.chunk" in first
        # Ordering, not duration: the client holds the first event while decode is still
        # producing the rest.
        assert d.state.stats()["streams_completed"] == 0
        rest = [line for line in lines if line.startswith(b"data: ")]
    assert rest[-1] == b"data: [DONE]"
    assert d.state.stats()["streams_completed"] == 1


def test_client_disconnect_aborts_the_decode_stream(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.05, output_tokens=200)
    px = proxy(roster([p], [d]))
    client = RawStream(px.url, "/v1/chat/completions", {**CHAT, "max_tokens": 200,
                                                         "stream": True})
    client.first_event()
    left_at = time.time()
    client.hang_up()
    eventually(lambda: d.state.stats()["streams_aborted"], 3)
    stats = d.state.stats()
    assert stats["streams_aborted"] == 1
    assert stats["last_abort_at"] - left_at < 1.0
    assert stats["streams_completed"] == 0


def test_get_and_other_posts_pass_through_with_query(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    r = requests.get(px.url + "/version?limit=5&x=%20y", timeout=10)
    assert r.status_code == 200 and r.json()["version"]
    seen = d.state.requests(1)[0]
    assert seen["path"] == "/version" and seen["query"] == "limit=5&x=%20y"
    # Before any instance's models are known, /v1/models is one decode's own answer.
    r = requests.get(px.url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny-llama"
    assert d.state.stats()["requests"]["/v1/models"] == 1
    r = requests.get(px.url + "/v1/nope", timeout=10)
    assert r.status_code == 404
    assert p.state.stats()["requests"].get("/v1/models", 0) == 0
    r = requests.post(px.url + "/v1/embeddings", data=b"[1]", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_health_and_readiness(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    health = requests.get(px.url + "/health", timeout=5)
    assert health.status_code == 200
    # Counts per role and state, never a URL: the shipped nginx publishes /health.
    assert health.json()["instances"] == {"prefill": {"live": 1, "evicted": 0},
                                          "decode": {"live": 1, "evicted": 0}}
    assert d.url not in health.text and p.url not in health.text
    # Not ready until an instance of each needed role has answered a probe.
    assert requests.get(px.url + "/ready", timeout=5).status_code == 503
    px.services.prober.probe_all()
    assert requests.get(px.url + "/ready", timeout=5).status_code == 200
    empty = proxy(roster())
    assert requests.get(empty.url + "/health", timeout=5).status_code == 200
    not_ready = requests.get(empty.url + "/ready", timeout=5)
    assert not_ready.status_code == 503 and "decode" in not_ready.json()["reason"]
    only_decode = proxy(roster([], [d]))
    assert requests.get(only_decode.url + "/ready", timeout=5).status_code == 503


def test_healthcheck_is_readiness_and_never_reaches_decode(sim, proxy) -> None:
    """``/healthcheck`` (a probe path other proxies in front of vLLM answer) answers like
    ``/ready``: a probe moved from one sees readiness, not decode's answer to an unknown
    route."""
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    before = requests.get(px.url + "/healthcheck", timeout=5)
    assert before.status_code == 503 and before.json()["ready"] is False
    px.services.prober.probe_all()
    after = requests.get(px.url + "/healthcheck", timeout=5)
    assert after.status_code == 200 and after.json() == {"ready": True, "reason": "ok"}
    assert "/healthcheck" not in d.state.stats()["requests"]
    assert "/healthcheck" not in p.state.stats()["requests"]


def test_probes_evict_an_unhealthy_instance_and_readmit_it(sim, proxy) -> None:
    p, d1, d2 = sim("prefill"), sim("decode"), sim("decode")
    px = proxy(roster([p], [d1, d2], probe_interval=0.05, fail_threshold=2), probes=True)
    d1.state.inject(health_fail=True)
    eventually(lambda: d1.url not in px.services.registry.snapshot()["decode"]["live"])
    assert px.services.registry.snapshot()["decode"]["evicted"] == [d1.url]
    for _ in range(3):
        assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    assert d1.state.stats()["completions"] == 0
    d1.state.inject(health_fail=False)
    assert eventually(lambda: d1.url in px.services.registry.snapshot()["decode"]["live"])
