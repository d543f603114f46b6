"""An upstream's interim (1xx) answers never reach a client as its answer, and never leave a
connection in the pool with another request's answer still to come: through real HTTP, against
a fake instance on a raw socket that hints early (``103``) and answers when done."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
import requests

from tests.bodies import chat

EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
UPGRADE = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
#: Between the hint and the answer: long enough that the answer is not there when a pooled
#: connection would be handed to the next request.
ANSWER_AFTER = 0.1


class HintingInstance:
    """Every request gets ``interim`` at once and, ``ANSWER_AFTER`` later, a 200 whose JSON
    echoes the request's body: an answer names the request it belongs to."""

    def __init__(self, interim: bytes) -> None:
        self.interim = interim
        self.connections = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.greenlets = [gevent.spawn(self._accept)]

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            self.connections += 1
            self.greenlets.append(gevent.spawn(self._serve, conn))

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                answer = json.dumps({"echo": json.loads(body) if body else None}).encode()
                conn.sendall(self.interim)
                gevent.sleep(ANSWER_AFTER)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
        except OSError:
            return
        finally:
            conn.close()

    def stop(self) -> None:
        gevent.killall(self.greenlets, timeout=1)
        self.listener.close()


@pytest.fixture
def hinting() -> Iterator[Any]:
    started: list[HintingInstance] = []

    def start(interim: bytes) -> HintingInstance:
        instance = HintingInstance(interim)
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.stop()


def _chat(text: str) -> dict[str, Any]:
    return chat(text, max_tokens=4)


def test_early_hints_are_skipped_and_each_client_gets_its_own_answer(hinting, proxy) -> None:
    upstream = hinting(EARLY_HINTS)
    px = proxy({"instances": [{"role": "prefill_decode", "url": upstream.url}]})
    for n in range(3):
        r = requests.post(px.url + "/v1/chat/completions", json=_chat(f"question {n}"),
                          timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["echo"]["messages"][0]["content"] == f"question {n}"
    assert upstream.connections == 1  # every exchange ended cleanly: one pooled connection


def test_an_upgrade_answer_fails_the_request_and_its_connection_is_dropped(
        hinting, proxy) -> None:
    upstream = hinting(UPGRADE)
    px = proxy({"instances": [{"role": "prefill_decode", "url": upstream.url}]})
    for n in (1, 2):
        r = requests.post(px.url + "/v1/chat/completions", json=_chat(f"question {n}"),
                          timeout=10)
        assert r.status_code == 502
        assert r.json()["error"]["type"] == "upstream_error"
        assert "101 Switching Protocols" in r.json()["error"]["message"]
        assert upstream.connections == n  # never reused: its 200 was never read
