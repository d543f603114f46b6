"""Request framing gunicorn lets through to the application: a chunked body whose chunk size
is not a size, and a body that ends before its Content-Length. Both are the client's fault and
must be a 400 in OpenAI's shape with a request log line, never a 500 or a forwarded fragment."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest

from tests.bodies import completion
from tests.helpers import eventually
from tests.rosters import roster

pytestmark = pytest.mark.e2e

BODY = json.dumps(completion(max_tokens=4)).encode()


def exchange(url: str, head: bytes, body: bytes, half_close: bool = False) -> bytes:
    """Send raw bytes, optionally shut the sending side, read the answer until the server
    closes or a complete response with Content-Length arrived."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(head + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = b""

        def ended() -> bool:
            nonlocal data
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return True
            data += chunk
            head_end = data.find(b"\r\n\r\n")
            if not chunk or head_end < 0:
                return not chunk
            length = next((int(line.split(b":", 1)[1]) for line in
                           data[:head_end].split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            return length is not None and len(data) >= head_end + 4 + length
        eventually(ended, 10, interval=0)
        return data


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"] if body.strip() else {}


def test_bad_chunk_sizes_and_short_bodies_are_400s(procs) -> None:
    p, d = procs["sim"]("prefill"), procs["sim"]("decode")
    gw = procs["gunicorn"](roster([p], [d]), "-k", "gevent")
    host = urlsplit(gw.url).netloc.encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: " + host +
               b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
               b"Connection: close\r\n\r\n")
    for framing in (b"-5\r\nhello\r\n0\r\n\r\n", b"5\r\n" + BODY[:5] + b"\r\n-1\r\n"):
        status, err = status_and_error(exchange(gw.url, chunked, framing))
        assert status == 400, (framing, status, err)
        assert err["code"] == "invalid_body" and err["type"] == "invalid_request_error"

    short = (b"POST /v1/completions HTTP/1.1\r\nHost: " + host +
             b"\r\nContent-Type: application/json\r\nContent-Length: " +
             str(len(BODY) + 40).encode() + b"\r\nConnection: close\r\n\r\n")
    status, err = status_and_error(exchange(gw.url, short, BODY, half_close=True))
    assert status == 400, (status, err)
    assert err["code"] == "invalid_body" and "Content-Length" in err["message"]
    for sim in (p, d):  # nothing of the fragments reached an instance
        assert "/v1/completions" not in sim.stats()["requests"]
    log = gw.tail()
    assert "Traceback" not in log
    assert log.count("status=400") >= 3, log
