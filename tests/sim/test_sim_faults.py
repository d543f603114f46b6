"""Injected faults, abort detection, pacing, and the /sim control surface."""

from __future__ import annotations

import gevent
import pytest
import requests

from epd_flask.sim import SimConfig, SimServer
from tests.bodies import chat, completion
from tests.helpers import eventually
from tests.sim.simclient import RawClient

CHAT = chat(max_tokens=16)
COMPLETION = completion(max_tokens=16)


def _post(url: str, body: dict = COMPLETION, **kw) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, timeout=5, **kw)


def _open_stream(url: str, body: dict, path: str = "/v1/completions",
                 timeout: float = 5.0) -> RawClient:
    client = RawClient(url, timeout=timeout)
    client.send("POST", path, {**body, "stream": True})
    return client


def test_fail_next_with_status(start_sim):
    srv = start_sim(role="decode")
    srv.state.inject(fail_next=2, fail_status=503)
    for _ in range(2):
        resp = _post(srv.url)
        assert resp.status_code == 503
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert _post(srv.url).status_code == 200
    stats = srv.state.stats()
    assert stats["failed_injected"] == 2 and stats["completions"] == 3


def test_fail_next_over_http_defaults_to_500(start_sim):
    srv = start_sim(role="decode")
    armed = requests.post(srv.url + "/sim/faults", json={"fail_next": 1}, timeout=5).json()
    assert armed["fail_next"] == 1 and armed["fail_status"] == 500
    assert requests.post(srv.url + "/v1/chat/completions", json=CHAT,
                         timeout=5).status_code == 500
    assert requests.post(srv.url + "/v1/chat/completions", json=CHAT,
                         timeout=5).status_code == 200


def test_drop_after_cuts_the_stream_without_terminator(start_sim):
    srv = start_sim(role="decode", output_tokens=8)
    srv.state.inject(drop_after=3)
    client = _open_stream(srv.url, CHAT, "/v1/chat/completions")
    try:
        resp = client.read_response()
    finally:
        client.close()
    assert resp.status == 200 and not resp.terminated
    assert len(resp.frames) == 3
    assert srv.state.stats()["streams_dropped"] == 1
    # One-shot: the next stream is whole.
    client = _open_stream(srv.url, CHAT, "/v1/chat/completions")
    try:
        assert client.read_response().terminated
    finally:
        client.close()


def test_hang_next_holds_until_the_client_leaves(start_sim):
    srv = start_sim(role="decode")
    srv.state.inject(hang_next=1)
    client = RawClient(srv.url, timeout=0.3)
    client.send("POST", "/v1/completions", COMPLETION)
    with pytest.raises(TimeoutError):
        client.read_head()
    stats = srv.state.stats()
    assert stats["hung_injected"] == 1 and stats["in_flight"] == 1
    client.close()
    assert eventually(lambda: srv.state.stats()["in_flight"] == 0)
    assert srv.state.stats()["requests_aborted"] == 1
    assert _post(srv.url).status_code == 200


def test_health_fail_and_reset(start_sim):
    srv = start_sim(role="prefill")
    requests.post(srv.url + "/sim/faults", json={"health_fail": True}, timeout=5)
    assert requests.get(srv.url + "/health", timeout=5).status_code == 503
    requests.post(srv.url + "/sim/reset", timeout=5)
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200
    stats = requests.get(srv.url + "/sim/stats", timeout=5).json()
    assert stats["health_checks"] == 1 and stats["faults"]["health_fail"] is False


def test_bad_faults_and_knobs_are_refused(start_sim):
    srv = start_sim(role="decode")
    for body in ({"fail_next": -1}, {"nope": 1}, {"fail_status": 200}, {"health_fail": 1}):
        assert requests.post(srv.url + "/sim/faults", json=body, timeout=5).status_code == 400
    for body in ({"ttft": -1}, {"role": "encode"}, {"output_tokens": "x"}):
        assert requests.post(srv.url + "/sim/config", json=body, timeout=5).status_code == 400
    assert requests.post(srv.url + "/sim/config", data=b"[1]", timeout=5).status_code == 400
    with pytest.raises(ValueError):
        srv.state.configure(port=1)


def test_live_config_changes_answers(start_sim):
    srv = start_sim(role="decode", output_tokens=16)
    cfg = requests.post(srv.url + "/sim/config", json={"output_tokens": 3}, timeout=5).json()
    assert cfg["output_tokens"] == 3
    assert _post(srv.url).json()["usage"]["completion_tokens"] == 3
    srv.state.configure(model="other")
    assert _post(srv.url, {**COMPLETION, "model": "other"}).status_code == 200
    assert requests.get(srv.url + "/sim/config", timeout=5).json()["model"] == "other"


def test_client_leaving_mid_stream_is_counted(start_sim):
    srv = start_sim(role="decode", token_delay=0.05, output_tokens=100)
    client = _open_stream(srv.url, {**COMPLETION, "max_tokens": 100})
    resp = client.read_head()
    assert client.next_frame(resp) is not None
    assert srv.state.stats()["streams_started"] == 1
    client.close()
    assert eventually(lambda: srv.state.stats()["streams_aborted"] == 1)
    stats = srv.state.stats()
    assert stats["in_flight"] == 0 and stats["streams_completed"] == 0
    assert stats["last_abort_at"] is not None


def test_client_leaving_during_ttft_is_counted(start_sim):
    srv = start_sim(role="decode", ttft=30.0)
    client = _open_stream(srv.url, CHAT, "/v1/chat/completions")
    assert eventually(lambda: srv.state.stats()["streams_started"] == 1)
    client.close()
    assert eventually(lambda: srv.state.stats()["streams_aborted"] == 1)


def test_tokens_arrive_one_by_one(start_sim):
    srv = start_sim(role="decode", token_delay=0.05, output_tokens=8)
    client = _open_stream(srv.url, {**CHAT, "max_tokens": 8}, "/v1/chat/completions")
    try:
        resp = client.read_response()
    finally:
        client.close()
    # One SSE event per chunked frame: each token was its own write.
    assert all(p.startswith(b"data: ") and p.endswith(b"\n\n") and p.count(b"data: ") == 1
               for _, p in resp.frames)
    times = [t for t, _ in resp.frames]
    first_token, last_token = times[1], times[-2]  # after the role chunk, before [DONE]
    assert first_token < last_token
    assert last_token - first_token >= 0.5 * 0.05 * 7  # a lower bound, not an exact duration
    stats = srv.state.stats()
    assert stats["streams_completed"] == 1 and stats["in_flight"] == 0


def test_zero_latency_stream_still_writes_each_chunk(start_sim):
    srv = start_sim(role="prefill_decode", output_tokens=32)
    client = _open_stream(srv.url, {**COMPLETION, "max_tokens": 32})
    try:
        resp = client.read_response()
    finally:
        client.close()
    assert len(resp.frames) == 32 + 1 and resp.terminated


def test_headers_come_at_once_and_the_first_token_after_ttft(start_sim):
    srv = start_sim(role="decode", ttft=0.3, output_tokens=2)
    client = _open_stream(srv.url, {**COMPLETION, "max_tokens": 2})
    try:
        resp = client.read_head()
        client.next_frame(resp)
    finally:
        client.close()
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.frames[0][0] - resp.head_at >= 0.15  # ordering with a generous margin


def test_concurrency_is_tracked(start_sim):
    srv = start_sim(role="decode", token_delay=0.02, output_tokens=10)
    jobs = [gevent.spawn(_post, srv.url) for _ in range(3)]
    gevent.joinall(jobs, timeout=5)
    assert all(j.value is not None and j.value.status_code == 200 for j in jobs)
    stats = srv.state.stats()
    assert stats["max_in_flight"] == 3 and stats["in_flight"] == 0


def test_requests_are_recorded_with_headers(start_sim):
    srv = start_sim(role="decode", record_limit=3)
    headers = {"x-request-id": "rid-1", "authorization": "Bearer k",
               "x-data-parallel-rank": "0"}
    requests.post(srv.url + "/v1/completions?x=1", json=COMPLETION, headers=headers,
                  timeout=5)
    requests.get(srv.url + "/health", timeout=5)  # probes are not recorded by default
    (rec,) = srv.state.requests(1)
    assert rec["path"] == "/v1/completions" and rec["query"] == "x=1"
    assert rec["body"] == COMPLETION and rec["method"] == "POST"
    for key, value in headers.items():
        assert rec["headers"][key] == value
    assert rec["headers"]["content-type"] == "application/json"
    over_http = requests.get(srv.url + "/sim/requests?limit=5", timeout=5).json()
    assert over_http == srv.state.requests(5) and len(over_http) == 1
    for i in range(4):
        _post(srv.url, {**COMPLETION, "prompt": f"p{i}"})
    assert [r["body"]["prompt"] for r in srv.state.requests()] == ["p1", "p2", "p3"]
    assert srv.state.stats()["requests"]["/v1/completions"] == 5


def test_invalid_json_is_recorded_raw(start_sim):
    srv = start_sim(role="decode")
    requests.post(srv.url + "/v1/completions", data=b"{oops",
                  headers={"content-type": "application/json"}, timeout=5)
    (rec,) = srv.state.requests(1)
    assert rec["body"] is None and rec["body_raw"] == "{oops"


def test_stop_closes_hanging_connections():
    srv = SimServer(SimConfig(role="decode")).start()
    srv.state.inject(hang_next=1)
    client = RawClient(srv.url, timeout=2.0)
    client.send("POST", "/v1/completions", COMPLETION)
    gevent.sleep(0.05)
    srv.stop()
    try:
        with pytest.raises((ConnectionError, OSError)):
            client.read_head()
    finally:
        client.close()
    with pytest.raises(requests.ConnectionError):
        requests.get(srv.url + "/health", timeout=1)
