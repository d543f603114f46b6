"""The failover policy in one place: before the first byte a request moves to another live
instance (bounded, counted, logged); after it nothing is retried."""

from __future__ import annotations

import json
import logging

import gevent
import pytest
import requests

from tests.bodies import chat
from tests.helpers import eventually
from tests.rosters import roster

CHAT = chat(max_tokens=6, temperature=0)


def post(px, body=CHAT, **kw) -> requests.Response:
    return requests.post(px.url + "/v1/chat/completions", json=body, timeout=20, **kw)


def decode_runs(*decodes) -> dict[str, list[int]]:
    """Per request id, the statuses the decodes answered it with."""
    runs: dict[str, list[int]] = {}
    for d in decodes:
        for r in d.state.requests():
            if r["path"] == "/v1/chat/completions":
                runs.setdefault(r["headers"]["x-request-id"], []).append(r.get("status"))
    return runs


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_refused_instance_sends_the_request_to_another_one(sim, proxy, role, caplog) -> None:
    p0, p1, d0, d1 = sim("prefill"), sim("prefill"), sim("decode"), sim("decode")
    dead = {"prefill": p0, "decode": d0}[role]
    dead.stop()
    # A high threshold keeps the dead instance in rotation: every request may meet it.
    px = proxy(roster([p0, p1], [d0, d1], fail_threshold=100, decode_retries=1))
    caplog.set_level(logging.WARNING, "epd_flask.serving.pipeline")
    for _ in range(4):
        r = post(px)
        assert r.status_code == 200, r.text
    retried = px.services.pipeline.counters[f"retried_{role}"]
    assert retried >= 1  # the rotation met the dead instance at least once in four requests
    logged = [m for m in caplog.messages if "retrying on another instance" in m]
    assert len(logged) == retried and all(dead.url in m for m in logged)
    live = {"prefill": p1, "decode": d1}[role]
    assert live.state.stats()["completions"] == 4
    metrics = requests.get(px.url + "/metrics", timeout=5).text
    assert f'epd_retries_total{{cause="upstream_unavailable",stage="{role}"}}' in metrics


def test_attempts_are_bounded_by_decode_retries(sim, proxy) -> None:
    p = sim("prefill")
    decodes = [sim("decode") for _ in range(3)]
    for d in decodes:
        d.state.inject(fail_next=10, fail_status=500)
    px = proxy(roster([p], decodes, decode_retries=1))
    r = post(px)
    assert r.status_code == 500
    assert sum(d.state.stats()["failed_injected"] for d in decodes) == 2  # 1 + 1 retry
    assert p.state.stats()["completions"] == 2  # each attempt primes its own prefill
    assert px.services.pipeline.counters["retried_decode"] == 1


def test_a_decode_dying_before_its_answer_is_replaced_unseen(sim, proxy) -> None:
    """A non-streamed request whose decode dies mid-generation: the client has seen nothing,
    so another decode serves it."""
    p, slow, other = sim("prefill"), sim("decode", ttft=5.0), sim("decode")
    px = proxy(roster([p], [slow, other], decode_retries=1))
    pending = gevent.spawn(post, px)
    eventually(lambda: slow.state.stats()["in_flight"], what="the slow decode's request")
    slow.stop()
    r = pending.get(timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert other.state.stats()["completions"] == 1


def test_nothing_is_retried_after_the_first_byte(sim, proxy) -> None:
    p, d0, d1 = sim("prefill"), sim("decode", output_tokens=30), sim("decode", output_tokens=30)
    px = proxy(roster([p], [d0, d1], decode_retries=3))
    for d in (d0, d1):
        d.state.inject(drop_after=3)
    r = post(px, {**CHAT, "max_tokens": 30, "stream": True})
    assert r.status_code == 200
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == "stream_interrupted"
    assert "[DONE]" not in events
    runs = decode_runs(d0, d1)
    assert list(runs.values()) == [[200]]  # one decode ran it, and only once
    assert px.services.pipeline.counters["retried_decode"] == 0


def test_no_live_instance_answers_the_roster_status_and_message_for_every_stage(sim, proxy):
    """With ``no_backend_status``/``no_backend_message`` set, a stage with nothing live answers
    them, whichever stage it is; without, 503 and a message naming the stage."""
    body = chat("hi", max_tokens=2)
    d = sim("decode")
    custom = proxy(roster(["http://127.0.0.1:9"], [d], no_backend_status=502,
                          no_backend_message="no reachable backend, try later"))
    plain = proxy(roster(["http://127.0.0.1:9"], [d]))
    for px in (custom, plain):  # the prefill is evicted: nothing live in that stage
        for _ in range(3):
            px.services.registry.record_failure("http://127.0.0.1:9", "down")
    r = requests.post(custom.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["message"] == \
        "no reachable backend, try later" and r.json()["error"]["code"] == "no_backend"
    r = requests.post(plain.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["message"] == \
        "no live prefill instance serving model `tiny-llama` is available"
    # the decode side too: a roster with no decode at all
    nobody = proxy(roster([sim("prefill")], [], no_backend_status=502))
    r = requests.post(nobody.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 502 and "decode" in r.json()["error"]["message"]
