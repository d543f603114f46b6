"""Idle kept-alive connections through real gunicorn: when they fill a worker's
EPD_WORKER_CONNECTIONS, the longest-idle one is closed so a new client is served at once
instead of waiting for gunicorn's keepalive (docs/behaviour.md#edge)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest
import requests

from tests.helpers import read_response

pytestmark = pytest.mark.e2e

CONNECTIONS = 20
WAIT = 10.0  # far below the keepalive set below, which would close them all
KEEPALIVE = 60


def _idle(url: str, version: str) -> socket.socket:
    """A connection that asked for /health once and stays open, idle."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=WAIT)
    keep = "Connection: keep-alive\r\n" if version == "1.0" else ""
    sock.sendall(f"GET /health HTTP/{version}\r\nHost: {parts.netloc}\r\n{keep}\r\n".encode())
    answer = read_response(sock)
    assert answer.split(b"\r\n", 1)[0].endswith(b" 200 OK"), answer[:200]
    return sock



def _closed(sock: socket.socket) -> bool:
    sock.settimeout(WAIT)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_idle_connections_make_room_for_a_new_client(procs, version: str) -> None:
    p, d = procs["sim"]("prefill"), procs["sim"]("decode")
    gw = procs["gunicorn"](
        {"settings": {}, "instances": [{"role": "prefill", "url": p.url},
                                       {"role": "decode", "url": d.url}]},
        env={"EPD_WORKER_CONNECTIONS": str(CONNECTIONS), "EPD_KEEPALIVE": str(KEEPALIVE)})
    idle = []
    try:
        for _ in range(CONNECTIONS):
            idle.append(_idle(gw.url, version))
            time.sleep(0.01)  # an order of idleness
        started = time.monotonic()
        fresh = requests.get(gw.url + "/health", timeout=WAIT)
        served_after = time.monotonic() - started
        assert fresh.status_code == 200
        # The longest-idle connection made the room; the most recent ones are still served.
        assert _closed(idle[0])
        newest = idle[-1]
        newest.sendall(f"GET /health HTTP/{version}\r\nHost: x\r\n"
                       f"{'Connection: keep-alive' + chr(13) + chr(10) if version == '1.0' else ''}"
                       "\r\n".encode())
        assert b" 200 OK" in read_response(newest).split(b"\r\n", 1)[0]
        print(f"\n{CONNECTIONS} idle HTTP/{version} connections fill the worker: a new client "
              f"served after {served_after * 1000:.0f} ms")
    finally:
        for sock in idle:
            sock.close()
