"""SIGTERM to a real gunicorn master: short streams finish, long ones end with an error event."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest
import requests

from tests.bodies import chat_stream
from tests.helpers import RawStream
from tests.rosters import roster

pytestmark = pytest.mark.e2e

CHAT = chat_stream(temperature=0)
GRACEFUL_TIMEOUT = 4
IDLE_GRACE = 0.2  # short, so the idle connection is closed well before the short stream ends


def events_until_closed(client: RawStream) -> tuple[list[bytes], float]:
    """Every SSE event until the server ends the response; and when it did."""
    while not client.buffer.endswith(b"0\r\n\r\n"):
        data = client.sock.recv(65536)
        if not data:
            break
        client.buffer += data
    return re.findall(rb"data: (.*?)\n\n", client.buffer, re.S), time.monotonic()


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def test_sigterm_drains_streams_then_ends_them_in_band(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--token-delay-ms", "50", "--output-tokens", "400")
    gw = procs["gunicorn"](roster([p], [d]), "-k", "gevent",
                           env={"EPD_GRACEFUL_TIMEOUT": str(GRACEFUL_TIMEOUT),
                                "EPD_DRAIN_IDLE_GRACE": str(IDLE_GRACE)})
    long = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 400}, timeout=30)
    short = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 20}, timeout=30)
    long.first_event()
    short.first_event()
    idle = socket.create_connection((gw.url.split(":")[1][2:], int(gw.url.rsplit(":", 1)[1])),
                                    timeout=30)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(idle).startswith(b"HTTP/1.1 200")  # and now idle, kept alive
    signalled = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)

    assert idle.recv(65536) == b""  # the idle keep-alive connection is closed after the grace
    idle_closed = time.monotonic()
    short_events, short_done = events_until_closed(short)
    long_events, long_done = events_until_closed(long)
    exit_code = gw.proc.wait(timeout=GRACEFUL_TIMEOUT + 10)
    exited = time.monotonic()

    assert short_events[-1] == b"[DONE]"  # finished inside the grace period
    last = json.loads(long_events[-1])
    assert last["error"]["code"] == "shutting_down", last
    assert long.buffer.endswith(b"0\r\n\r\n"), "the stream was cut instead of ended"
    assert len(long_events) > 20  # it kept streaming while the worker drained
    assert idle_closed < short_done < long_done < exited
    assert exit_code == 0
    assert exited - signalled < GRACEFUL_TIMEOUT + 2  # the master never had to SIGKILL it
    assert d.stats()["streams_aborted"] == 1  # the ended stream was cancelled upstream too
    log = gw.log.read_text()
    assert "Worker exiting" in log and "SIGKILL" not in log
    assert "Traceback" not in log and "[ERROR]" not in log
    with pytest.raises(requests.ConnectionError):
        requests.get(gw.url + "/health", timeout=2)
    print(f"\nSIGTERM: idle connection closed after {idle_closed - signalled:.2f} s, "
          f"short stream done after {short_done - signalled:.2f} s, long one ended "
          f"in band after {long_done - signalled:.2f} s, master gone after "
          f"{exited - signalled:.2f} s (graceful_timeout {GRACEFUL_TIMEOUT} s)")
