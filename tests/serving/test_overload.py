"""The per-worker cap on concurrent requests, and ending requests when a worker stops."""

from __future__ import annotations

import json
import re

import gevent
import requests

from tests.bodies import chat
from tests.helpers import RawStream, eventually
from tests.rosters import roster

CHAT = chat(temperature=0)
LONG = {**CHAT, "max_tokens": 400, "stream": True}


def completions_seen(*servers) -> int:
    return sum(s.state.stats()["completions"] for s in servers)


def events_of(raw: bytes) -> list[bytes]:
    """SSE events in a body, chunked framing or not (the relay writes whole events)."""
    return [b"data: " + e for e in re.findall(rb"data: (.*?)\n\n", raw, re.S)]


def read_to_end(client: RawStream) -> bytes:
    while True:
        data = client.sock.recv(65536)
        if not data:
            return client.buffer
        client.buffer += data
        if client.buffer.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked body
            return client.buffer


def test_past_the_cap_requests_get_503_with_retry_after_at_once(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.05, output_tokens=400)
    px = proxy(roster([p], [d]), max_in_flight=2)
    streams = [RawStream(px.url, "/v1/chat/completions", LONG) for _ in range(2)]
    for s in streams:
        s.first_event()
    before = completions_seen(p, d)
    refused = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                            timeout=10)
    # Answered while both admitted streams are still generating: no queueing behind them.
    assert d.state.stats()["streams_completed"] == 0
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["X-Request-Id"]
    err = refused.json()["error"]
    assert err["code"] == "overloaded" and set(err) == {"message", "type", "param", "code"}
    assert completions_seen(p, d) == before, "a refused request reached a backend"
    # Probes are never refused, and they show the cap and the refusal.
    health = requests.get(px.url + "/health", timeout=5)
    assert health.status_code == 200
    load = health.json()["load"]
    assert load["in_flight"] == 2 and load["limit"] == 2 and load["rejected_overload"] == 1
    metrics = requests.get(px.url + "/metrics", timeout=5).text
    assert "epd_requests_in_flight 2.0" in metrics
    assert "epd_requests_in_flight_busiest_worker 2.0" in metrics
    assert "epd_requests_in_flight_limit 2.0" in metrics
    assert 'epd_requests_refused_total{reason="overloaded"}' in metrics
    # A client leaving frees its slot for the next request.
    streams[0].hang_up()
    eventually(lambda: px.services.inflight.count <= 1, what="the left stream's slot freed")
    ok = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                       timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    streams[1].hang_up()


def test_slots_are_released_by_errors_and_finished_streams(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", output_tokens=5)
    px = proxy(roster([p], [d]), max_in_flight=1)
    for _ in range(3):
        bad = requests.post(px.url + "/v1/chat/completions", data=b"[]", timeout=5,
                            headers={"Content-Type": "application/json"})
        assert bad.status_code == 400
        d.state.inject(fail_next=2)
        failed = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                               timeout=5)
        assert failed.status_code == 500
        done = requests.post(px.url + "/v1/chat/completions",
                             json={**CHAT, "max_tokens": 5, "stream": True}, timeout=5)
        assert events_of(done.content)[-1] == b"data: [DONE]"
    assert px.services.inflight.count == 0
    assert px.services.inflight.snapshot()["rejected_overload"] == 0


def test_drain_lets_short_streams_finish_and_ends_long_ones_in_band(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.05, output_tokens=400)
    px = proxy(roster([p], [d]))
    long = RawStream(px.url, "/v1/chat/completions", LONG)
    short = RawStream(px.url, "/v1/chat/completions", {**LONG, "max_tokens": 6})
    long.first_event()
    short.first_event()
    drain = gevent.spawn(px.services.drain.run, 1.0)
    gevent.sleep(0.05)
    # Draining: readiness says so (load balancers stop sending), and a request that still
    # arrives on an open connection is served rather than refused.
    assert requests.get(px.url + "/ready", timeout=5).status_code == 503
    late = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                         timeout=5)
    assert late.status_code == 200
    short_events = events_of(read_to_end(short))
    long_events = events_of(read_to_end(long))
    assert drain.get(timeout=10) == 1
    assert short_events[-1] == b"data: [DONE]"
    last = json.loads(long_events[-1][len(b"data: "):])
    assert last["error"]["code"] == "shutting_down"
    assert len(long_events) > 3  # it was streaming tokens until the grace period ran out
    eventually(lambda: d.state.stats()["streams_aborted"], what="the long stream aborted")
    assert d.state.stats()["streams_completed"] == 1  # only the short one ran to its end


def test_drain_turns_a_request_still_waiting_for_prefill_into_a_503(sim, proxy) -> None:
    p, d = sim("prefill", ttft=30.0), sim("decode")
    px = proxy(roster([p], [d]))
    waiting = gevent.spawn(requests.post, px.url + "/v1/chat/completions",
                           json={**CHAT, "max_tokens": 4}, timeout=20)
    eventually(lambda: p.state.stats()["in_flight"], what="the request waiting for prefill")
    assert px.services.drain.run(0.2) == 1
    resp = waiting.get(timeout=5)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"
    assert resp.headers["Retry-After"] == "1"
    assert d.state.stats()["completions"] == 0  # not retried elsewhere, not sent on
