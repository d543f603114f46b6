"""Header hygiene, request ids and the error shape (docs/behaviour.md#edge)."""

from __future__ import annotations

import json

import pytest

from epd_flask.core import errors
from epd_flask.core.headers import client_headers, request_id, upstream_headers
from epd_flask.web.api import parse_object


def test_upstream_headers_keep_only_the_allowlist_and_set_the_request_id() -> None:
    out = upstream_headers(
        [("Authorization", "Bearer k"), ("Cookie", "s=1"), ("Connection", "keep-alive"),
         ("X-Request-Id", "client"), ("Traceparent", "00-ab-cd-01"), ("Host", "proxy")],
        "rid-1",
    )
    assert out == {"Authorization": "Bearer k", "Traceparent": "00-ab-cd-01",
                   "X-Request-Id": "rid-1"}


def test_client_headers_drop_hop_by_hop_and_length() -> None:
    kept = client_headers([("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"),
                           ("Content-Length", "10"), ("Connection", "close"), ("Vary", "Origin"),
                           ("X-Custom", "a\u00e9")])
    assert kept == [("Content-Type", "text/event-stream"), ("Vary", "Origin"),
                    ("X-Custom", "a\u00e9")]


@pytest.mark.parametrize("value", ["abc-123", "a.b:c_d", "x" * 128])
def test_safe_client_request_ids_are_kept(value: str) -> None:
    assert request_id(value) == value


@pytest.mark.parametrize("value", [None, "", "has space", "x" * 129, "new\nline", "é"])
def test_unsafe_request_ids_are_replaced(value: str | None) -> None:
    rid = request_id(value)
    assert rid != value and len(rid) == 32


@pytest.mark.parametrize(("raw", "words"), [
    (b"[1,2]", "JSON array"), (b"3", "JSON number"), (b'"s"', "JSON string"),
    (b"null", "JSON null"), (b"{", "not valid JSON"), (b"", "empty"), (b"\xff\xfe", "UTF-8"),
    (b'{"a": "\xc3"}', "UTF-8"),
])
def test_non_object_bodies_are_client_errors(raw: bytes, words: str) -> None:
    with pytest.raises(errors.ClientError) as info:
        parse_object(raw)
    assert words in info.value.message
    assert info.value.status == 400


def test_render_uses_the_openai_shape() -> None:
    status, body, ctype = errors.render(errors.NoBackend("no live decode instance"))
    doc = json.loads(body)
    assert status == 503 and ctype == "application/json"
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == "no_backend"


def test_render_passes_an_upstream_openai_error_through() -> None:
    upstream = b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError",' \
               b'"param":"model","code":404}}'
    err = errors.BackendStatus("decode answered 404", upstream_status=404, body=upstream,
                               content_type="application/json")
    assert errors.render(err) == (404, upstream, "application/json")
    assert not err.retryable


def test_render_wraps_a_non_json_upstream_error() -> None:
    err = errors.BackendStatus("decode answered 500", upstream_status=500, body=b"oops",
                               content_type="text/plain")
    status, body, _ = errors.render(err)
    assert status == 500 and err.retryable
    assert json.loads(body)["error"]["message"] == "decode answered 500"


def test_sse_error_event_is_one_data_line() -> None:
    event = errors.sse_event(errors.StreamInterrupted("decode closed the connection"))
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[6:])["error"]["code"] == "stream_interrupted"
