"""``Expect: 100-continue`` through real gunicorn: the proxy's refusals from the head alone
(401, 413, 415) come without a ``100 Continue`` first, so the client never sends a body that
is refused unread; a request that passes gets its ``100 Continue`` when the body is read
(docs/behaviour.md#edge)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.e2e.conftest import Launcher

pytestmark = pytest.mark.e2e

KEY = "sk-serving"
LIMIT = 1000
BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
WAIT = 10.0


def _ask(url: str, headers: dict[str, str], length: int = len(BODY),
         path: str = "/v1/completions") -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=WAIT)
    lines = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": parts.netloc, "Content-Length": str(length), "Expect": "100-continue",
        **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode())
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    launcher = Launcher(tmp_path_factory.mktemp("expect"))
    try:
        p, d = launcher.sim("prefill"), launcher.sim("decode")
        yield launcher.gunicorn(
            {"settings": {}, "instances": [{"role": "prefill", "url": p.url},
                                           {"role": "decode", "url": d.url}]},
            env={"EPD_API_KEYS": KEY, "EPD_MAX_BODY_BYTES": str(LIMIT)}).url
    finally:
        launcher.stop_all()


@pytest.mark.parametrize(("headers", "length", "status", "code"), [
    ({"Content-Type": "application/json"}, len(BODY), 401, None),
    ({"Authorization": "Bearer wrong", "Content-Type": "application/json"}, len(BODY), 401,
     "invalid_api_key"),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, LIMIT + 1, 413,
     "payload_too_large"),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}, len(BODY), 415,
     "unsupported_media_type"),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
      "Content-Encoding": "br"}, len(BODY), 415, "unsupported_media_type"),
], ids=["no-key", "wrong-key", "too-large", "content-type", "content-encoding"])
def test_refusals_from_the_head_come_without_a_100_continue(
        gateway: str, headers: dict[str, str], length: int, status: int,
        code: str | None) -> None:
    sock = _ask(gateway, headers, length)
    try:
        # The body is never sent: the answer must come anyway, and be the final one.
        answer = _until_closed(sock)  # and the connection closes after it
    finally:
        sock.close()
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert b"100 Continue" not in answer
    assert b"connection: close" in answer.lower()
    doc = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert doc["error"]["code"] == code


def test_an_accepted_request_gets_its_100_continue_then_its_answer(gateway: str) -> None:
    sock = _ask(gateway, {"Authorization": f"Bearer {KEY}",
                          "Content-Type": "application/json"})
    try:
        got = b""
        while len(got) < len(CONTINUE):
            got += sock.recv(len(CONTINUE) - len(got))
        assert got == CONTINUE
        sock.sendall(BODY)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    finally:
        sock.close()
