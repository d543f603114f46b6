"""WSGI plumbing shared by the sim's apps: status lines, JSON and empty responses with vLLM's
headers, reading the body, and the headers as the client sent them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from . import wire

StartResponse = Callable[..., Any]
WSGIResult = Iterable[bytes]

JSON_HEADERS = (("content-type", "application/json"), ("vary", "Origin"))
SSE_HEADERS = (("content-type", "text/event-stream; charset=utf-8"), ("vary", "Origin"))
#: Larger bodies are refused; a multimodal request with a few inline images fits easily.
MAX_BODY_BYTES = 64 * 1024 * 1024


def status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Error"


def json_response(
    start_response: StartResponse, status: int, obj: Any,
    extra_headers: Iterable[tuple[str, str]] = (), vary: bool = True,
) -> WSGIResult:
    body = wire.dumps(obj)
    headers = list(JSON_HEADERS if vary else JSON_HEADERS[:1])
    headers.append(("content-length", str(len(body))))
    headers.extend(extra_headers)
    start_response(status_line(status), headers)
    return [body]


def text_response(start_response: StartResponse, status: int, text: str) -> WSGIResult:
    """A plain string body, as FastAPI's bare ``Response(content=...)`` sends it."""
    body = text.encode()
    start_response(status_line(status), [("content-length", str(len(body)))])
    return [body]


def empty_response(start_response: StartResponse, status: int) -> WSGIResult:
    start_response(status_line(status), [("content-length", "0"), ("vary", "Origin")])
    return []


def read_body(environ: dict[str, Any]) -> bytes:
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > 0:
        return stream.read(min(length, MAX_BODY_BYTES))
    if environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked":
        return stream.read(MAX_BODY_BYTES)
    return b""


def request_headers(environ: dict[str, Any]) -> dict[str, str]:
    """Lower-cased header names; the server's raw list when it offers one, else from CGI keys."""
    raw = environ.get("sim.raw_headers")
    if raw is not None:
        out: dict[str, str] = {}
        for name, value in raw:
            key = name.lower()
            out[key] = f"{out[key]},{value}" if key in out else value
        return out
    out = {}
    for key, value in environ.items():
        if key.startswith("HTTP_"):
            out[key[5:].replace("_", "-").lower()] = value
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            out[key.replace("_", "-").lower()] = environ[key]
    return out
