"""How a simulated Mooncake decode pulls KV: it asks the bootstrap server it was given whether
the engine id is one that server announced, then waits there until the prefill holding
``transfer_id`` has computed it, as a real decode waits for the KV before its first token.

A proxy that invents an engine id, points at the wrong bootstrap server or hands the two legs
different transfer ids gets an ``invalid`` or a timed-out pull a test can count; one that gives
two requests the same transfer id gets a decode that pulls the other prompt's KV and answers
from it, as a real one does. The sim runs
without gevent's monkey patching, so the HTTP calls use gevent's own sockets.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from gevent import socket as gsocket

from . import pacing

PULLED = "pulled"
INVALID = "invalid"
TIMED_OUT = "timed_out"
ABORTED = "aborted"
GONE = "gone"

#: One long-poll at the bootstrap server; between polls the decode checks its own client.
POLL_SECONDS = 0.2
CONNECT_TIMEOUT = 2.0
TRANSFERS_PATH = "/sim/transfers/"


@dataclass(frozen=True)
class Pulled:
    outcome: str
    seconds: float
    #: The prompt whose KV arrived (``PULLED`` only): another request's if ids collided.
    prompt: str | None = None


def get_json(url: str, timeout: float) -> Any | None:
    """GET ``url`` with HTTP/1.0 and return its JSON body, or None on any failure or non-200."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        with gsocket.create_connection((parts.hostname, parts.port or 80),
                                       timeout=CONNECT_TIMEOUT) as sock:
            sock.settimeout(timeout)
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        if int(head.split(b" ", 2)[1]) != 200:
            return None
        return json.loads(body)
    except (OSError, ValueError, IndexError):
        return None


def announced_engines(doc: Any) -> set[str]:
    """Engine ids in a ``/query`` answer (today's shape keyed by rank)."""
    if not isinstance(doc, dict):
        return set()
    return {entry["engine_id"] for entry in doc.values()
            if isinstance(entry, dict) and isinstance(entry.get("engine_id"), str)}


def pull(params: dict[str, Any], sock: Any | None, timeout: float) -> Pulled:
    """Pull the KV named by Mooncake ``params``."""
    started = time.monotonic()

    def end(outcome: str, prompt: str | None = None) -> Pulled:
        return Pulled(outcome, time.monotonic() - started, prompt)

    addr = str(params["remote_bootstrap_addr"]).rstrip("/")
    engine_id = params["remote_engine_id"]
    if engine_id not in announced_engines(get_json(addr + "/query", CONNECT_TIMEOUT)):
        return end(INVALID)
    url = addr + TRANSFERS_PATH + quote(str(params["transfer_id"]), safe="")
    deadline = started + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return end(TIMED_OUT)
        if sock is not None and pacing.client_gone(sock):
            return end(GONE)
        wait = min(remaining, POLL_SECONDS)
        doc = get_json(f"{url}?wait={wait:.3f}", wait + CONNECT_TIMEOUT)
        if doc is None:
            return end(ABORTED)  # the prefill went away mid-wait
        if doc.get("state") == "ready":
            if doc.get("engine_id") != engine_id:
                return end(INVALID)
            prompt = doc.get("prompt")
            return end(PULLED, prompt if isinstance(prompt, str) else None)
        if doc.get("state") == "aborted":
            return end(ABORTED)
