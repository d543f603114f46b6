"""The completion fast path (web/fastpath.py) answers as Flask's route does, through real HTTP.

Each case goes to two servers over the same app and services: the app as served (completion
POSTs skip Flask) and a twin whose WSGI chain has the same middlewares but sends everything
to Flask. Status line, every header (in order; only ``Date`` differs), body, and the request's
log line must match; simulator answers carry a fresh id and timestamp, which are compared by
shape.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from gevent.pywsgi import WSGIServer

from tests.bodies import chat, completion
from tests.conftest import Proxy
from tests.helpers import NoDelayHandler
from tests.rosters import roster

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT: dict[str, Any] = chat("hello", max_tokens=3)
KEY = "sk-fastpath-test"
Answer = tuple[int, str, list[tuple[str, str]], bytes]


def fast_path(px: Proxy) -> Any:
    from epd_flask.web.fastpath import FastPath
    layer = px.app.wsgi_app
    while not isinstance(layer, FastPath):
        layer = layer.app
    return layer


@pytest.fixture
def twins(sim, proxy) -> Iterator[tuple[Proxy, int, int, list[str]]]:
    """(proxy, port of the app as served, port of its Flask-only twin, paths Flask saw)."""
    from epd_flask.web.inflight import InFlightMiddleware
    from epd_flask.web.slowbody import BodyDeadline
    px = proxy(roster([sim("prefill")], [sim("decode", output_tokens=4)]),
               max_body_bytes=4096, api_keys=(KEY,))
    fast = fast_path(px)
    flask_saw: list[str] = []
    inner = fast.inner

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        flask_saw.append(environ["PATH_INFO"])
        return inner(environ, start_response)

    fast.inner = counted
    svc = px.services
    twin = WSGIServer(("127.0.0.1", 0), InFlightMiddleware(
        BodyDeadline(counted, svc.config.body_timeout), svc.inflight),
        log=None, handler_class=NoDelayHandler)
    twin.start()
    try:
        yield px, px.server.server_port, twin.server_port, flask_saw
    finally:
        twin.stop(timeout=1)


def ask(port: int, method: str, path: str, body: bytes | Iterator[bytes] | None,
        headers: dict[str, str]) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        if body is not None and not isinstance(body, bytes):
            conn.putrequest(method, path)
            for name, value in {**headers, "Transfer-Encoding": "chunked"}.items():
                conn.putheader(name, value)
            conn.endheaders()
            for part in body:
                conn.send(b"%x\r\n%s\r\n" % (len(part), part))
            conn.send(b"0\r\n\r\n")
        else:
            conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        head = [(k, v) for k, v in resp.getheaders() if k.lower() != "date"]
        return resp.status, resp.reason, head, resp.read()
    finally:
        conn.close()


def both(twins: tuple[Proxy, int, int, list[str]], caplog: pytest.LogCaptureFixture,
         method: str, path: str, body: Any = None, **headers: str) -> tuple[Answer, Answer]:
    """The same request to the served app and to the Flask twin; their request log lines
    must match too (upstream ids and timings aside, which are fresh per request)."""
    _, fast_port, flask_port, _ = twins
    answers, lines = [], []
    for port in (fast_port, flask_port):
        caplog.clear()
        sent = body() if callable(body) else body
        answers.append(ask(port, method, path, sent, {"X-Request-Id": "rid-fastpath", **headers}))
        lines.append([_comparable(r.getMessage()) for r in caplog.records
                      if r.name == "epd_flask.requests"])
    assert lines[0] == lines[1]
    return answers[0], answers[1]


def _comparable(line: str) -> str:
    line = re.sub(r"upstream_id=\S+", "upstream_id=-", line)
    line = re.sub(r"(\w+_ms|chunks_per_s)=\S+", r"\1=-", line)
    return re.sub(r"(prefill|decode)=http://127\.0\.0\.1:\d+", r"\1=-", line)


def _without_fresh_fields(body: bytes) -> Any:
    if body.startswith(b"data: "):
        events = [e for e in body.split(b"\n\n") if e]
        return [_without_fresh_fields(e[len(b"data: "):]) if e != b"data: [DONE]" else "DONE"
                for e in events]
    doc = json.loads(body)
    for name in ("id", "created"):
        doc.pop(name, None)
    return doc


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.mark.parametrize(("path", "doc"), [
    (CHAT, GOOD_CHAT),
    (COMPLETIONS, completion("hello", max_tokens=3)),
    (CHAT, {**GOOD_CHAT, "stream": True}),
    (CHAT, {**GOOD_CHAT, "kv_transfer_params": {"remote_host": "10.0.0.1"}}),
])
def test_good_requests_get_the_same_answer(twins, caplog, path: str, doc: Any) -> None:
    caplog.set_level(logging.INFO)
    fast, flask = both(twins, caplog, "POST", path, json.dumps(doc).encode(), **AUTH)
    assert fast[:3] == flask[:3] and fast[0] == 200
    assert _without_fresh_fields(fast[3]) == _without_fresh_fields(flask[3])
    assert ("X-Request-Id", "rid-fastpath") in fast[2]
    assert twins[3] == [path]  # only the twin's request reached Flask


def _gzipped() -> bytes:
    return gzip.compress(json.dumps(GOOD_CHAT).encode())


@pytest.mark.parametrize(("body", "headers"), [
    (b"{not json", AUTH),
    (b"[]", AUTH),
    (b"", AUTH),
    (json.dumps({"model": "tiny-llama"}).encode(), AUTH),
    (json.dumps({**GOOD_CHAT, "max_tokens": "many"}).encode(), AUTH),
    (json.dumps(GOOD_CHAT).encode(), {**AUTH, "Content-Type": "text/plain"}),
    (json.dumps(GOOD_CHAT).encode(), {"Content-Type": "application/json"}),
    (json.dumps(GOOD_CHAT).encode(), {**AUTH, "Authorization": "Bearer sk-wrong-key-123"}),
    (b"{" + b" " * 5000 + b"}", AUTH),
    (lambda: iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]), AUTH),
    (_gzipped(), {**AUTH, "Content-Encoding": "gzip"}),
    (b"not gzip", {**AUTH, "Content-Encoding": "gzip"}),
    (b"{}", {**AUTH, "Content-Encoding": "br"}),
    (json.dumps(GOOD_CHAT).encode() + b"\xff", AUTH),
], ids=["invalid-json", "array", "empty", "no-messages", "bad-field", "text-plain", "no-key",
        "wrong-key", "too-large", "chunked-too-large", "gzip", "bad-gzip", "brotli",
        "not-utf8"])
def test_refusals_and_edge_cases_get_the_same_answer(twins, caplog, body: Any,
                                                      headers: dict[str, str]) -> None:
    caplog.set_level(logging.INFO)
    fast, flask = both(twins, caplog, "POST", CHAT, body, **headers)
    if fast[0] == 200:
        assert fast[:3] == flask[:3]
        assert _without_fresh_fields(fast[3]) == _without_fresh_fields(flask[3])
    else:
        assert fast == flask
        assert fast[3].startswith(b'{"error": ')


def test_other_methods_and_spellings_stay_on_flask(twins, caplog) -> None:
    for method, path in (("GET", CHAT), ("POST", CHAT + "/"), ("PUT", COMPLETIONS)):
        fast, flask = both(twins, caplog, method, path, b"{}" if method != "GET" else None,
                           **AUTH)
        assert fast == flask and fast[0] in (404, 405)
    assert len(twins[3]) == 6  # every one of them went to Flask, on both servers


def test_an_unexpected_failure_is_flasks_logged_500(twins, caplog, monkeypatch) -> None:
    px = twins[0]

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug in the pipeline")

    monkeypatch.setattr(px.services.pipeline, "completion", broken)
    caplog.set_level(logging.INFO)
    answers, logged = [], []
    for port in twins[1:3]:
        caplog.clear()
        answers.append(ask(port, "POST", CHAT, json.dumps(GOOD_CHAT).encode(), AUTH))
        logged.append([(r.name, r.levelname, r.getMessage(), r.exc_info[0] if r.exc_info
                        else None) for r in caplog.records if r.name == "epd_flask"])
    assert answers[0] == answers[1] and answers[0][0] == 500
    assert logged[0] == logged[1] == [
        ("epd_flask", "ERROR", f"Exception on {CHAT} [POST]", RuntimeError)]
