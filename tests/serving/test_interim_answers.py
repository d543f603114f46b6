"""An upstream's interim (1xx) answers never reach a client as its answer, and never leave a
connection in the pool with another request's answer still to come: through real HTTP, against
a fake instance on a raw socket that hints early (``103``) and answers when done."""

from __future__ import annotations

import json
from typing import Any

import requests

from tests.bodies import chat
from tests.fakes import Handler, hints_then, response
from tests.rosters import roster

EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
UPGRADE = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
#: Between the hint and the answer: long enough that the answer is not there when a pooled
#: connection would be handed to the next request.
ANSWER_AFTER = 0.1


def echoing(interim: bytes) -> Handler:
    """Every request gets ``interim`` at once and, ``ANSWER_AFTER`` later, a 200 whose JSON
    echoes the request's body: an answer names the request it belongs to."""
    def echo(request: bytes) -> bytes:
        body = request.partition(b"\r\n\r\n")[2]
        return response(body=json.dumps({"echo": json.loads(body) if body else None}).encode())
    return hints_then(interim, echo, ANSWER_AFTER)


def _chat(text: str) -> dict[str, Any]:
    return chat(text, max_tokens=4)


def test_early_hints_are_skipped_and_each_client_gets_its_own_answer(fake, proxy) -> None:
    upstream = fake(echoing(EARLY_HINTS))
    px = proxy(roster(combined=[upstream]))
    for n in range(3):
        r = requests.post(px.url + "/v1/chat/completions", json=_chat(f"question {n}"),
                          timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["echo"]["messages"][0]["content"] == f"question {n}"
    assert len(upstream.connections) == 1  # every exchange ended cleanly: one pooled connection


def test_an_upgrade_answer_fails_the_request_and_its_connection_is_dropped(
        fake, proxy) -> None:
    upstream = fake(echoing(UPGRADE))
    px = proxy(roster(combined=[upstream]))
    for n in (1, 2):
        r = requests.post(px.url + "/v1/chat/completions", json=_chat(f"question {n}"),
                          timeout=10)
        assert r.status_code == 502
        assert r.json()["error"]["type"] == "upstream_error"
        assert "101 Switching Protocols" in r.json()["error"]["message"]
        assert len(upstream.connections) == n  # never reused: its 200 was never read
