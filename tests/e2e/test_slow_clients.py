"""Slow clients through real gunicorn: heads and bodies sent a byte at a time hold the worker
only for EPD_HEADER_TIMEOUT / EPD_BODY_TIMEOUT, while /health answers (/ready too: probes, like
/health, are never refused for load) and completions are served: a body still arriving holds
no in-flight slot (docs/behaviour.md#edge)."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import gevent
import pytest
import requests

from tests.bodies import completion
from tests.helpers import read_response
from tests.rosters import roster

pytestmark = pytest.mark.e2e

COMPLETION = completion("hello", max_tokens=2)
CONNECTIONS = 30  # worker_connections: the slow clients below fill every one of them
IN_FLIGHT = 4
SLOW_HEADS = CONNECTIONS - IN_FLIGHT
SLOW_BODIES = IN_FLIGHT
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
TRICKLE = 0.2  # seconds between two bytes of a slow client
WINDOW = 3.0  # how long the well-behaved traffic is measured


@dataclass
class Slow:
    """What one slow client saw: when its connection was answered or closed, and how."""

    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    answer: bytes = b""


def _trickle(url: str, head: bytes, body: bytes, out: Slow) -> None:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.setblocking(False)
    try:
        sent_head = bool(body)
        if sent_head:
            sock.sendall(head)
        data = body if body else head
        for i in range(len(data)):
            try:
                sock.send(data[i:i + 1])
            except OSError:
                break
            try:
                got = sock.recv(65536)
            except BlockingIOError:
                gevent.sleep(TRICKLE)
                continue
            out.answer += got
            break
        sock.setblocking(True)
        sock.settimeout(5)
        while True:
            try:
                got = sock.recv(65536)
            except OSError:
                break
            if not got:
                break
            out.answer += got
    finally:
        out.ended = time.monotonic()
        sock.close()


@pytest.mark.parametrize("command", [(), ("-k", "gevent")], ids=["configured", "k-gevent"])
def test_slow_heads_and_bodies_are_cut_while_health_and_completions_are_served(
        procs, command: tuple[str, ...]) -> None:
    """Also with ``-k gevent`` on the command line (the canonical ``gunicorn -k gevent
    wsgi:app``), which makes gunicorn fork its stock worker instead of ours."""
    p, d = procs["sim"]("prefill"), procs["sim"]("decode")
    gw = procs["gunicorn"](
        roster([p], [d]), *command,
        env={"EPD_WORKER_CONNECTIONS": str(CONNECTIONS), "EPD_MAX_IN_FLIGHT": str(IN_FLIGHT),
             "EPD_HEADER_TIMEOUT": str(HEADER_TIMEOUT), "EPD_BODY_TIMEOUT": str(BODY_TIMEOUT)})
    host = urlsplit(gw.url).netloc
    payload = json.dumps(COMPLETION).encode() + b" " * 2000
    slow_bodies = [Slow() for _ in range(SLOW_BODIES)]
    slow_heads = [Slow() for _ in range(SLOW_HEADS)]
    body_head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                 ).encode()
    lazy_head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Padding: "
                 + "x" * 200 + "\r\n\r\n").encode()
    attackers = [gevent.spawn(_trickle, gw.url, body_head, payload, s) for s in slow_bodies]
    gevent.sleep(0.3)  # the slow bodies hold every in-flight slot
    attackers += [gevent.spawn(_trickle, gw.url, lazy_head, b"", s) for s in slow_heads]
    gevent.sleep(0.1)  # and the slow heads every other connection

    started = time.monotonic()
    health: list[tuple[float, int, float]] = []
    completions: list[tuple[float, int, str]] = []

    def probe() -> None:
        for path in ("/health", "/ready"):
            t = time.monotonic()
            r = requests.get(gw.url + path, timeout=5)
            health.append((t - started, r.status_code, time.monotonic() - t))

    def complete() -> None:
        t = time.monotonic()
        r = requests.post(gw.url + "/v1/completions", json=COMPLETION, timeout=5)
        code = r.json()["error"]["code"] if r.status_code != 200 else "ok"
        completions.append((t - started, r.status_code, code))

    well_behaved = []
    while time.monotonic() - started < WINDOW:
        well_behaved += [gevent.spawn(probe), gevent.spawn(complete)]
        gevent.sleep(0.1)
    gevent.joinall(well_behaved, timeout=10, raise_error=True)
    gevent.joinall(attackers, timeout=10)

    served = [c for c in completions if c[1] == 200]
    refused = [c for c in completions if c[1] == 503]
    head_cut = sorted(s.ended - s.started for s in slow_heads if s.ended)
    body_cut = sorted(s.ended - s.started for s in slow_bodies if s.ended)
    print(f"\n{SLOW_HEADS} slow heads + {SLOW_BODIES} slow bodies on a worker of "
          f"{CONNECTIONS} connections, {IN_FLIGHT} in flight; over {WINDOW} s: "
          f"/health and /ready {sum(h[1] == 200 for h in health)}/{len(health)} answered "
          f"(slowest {max(h[2] for h in health) * 1000:.0f} ms); completions "
          f"{len(served)} served, {len(refused)} refused, first served at "
          f"{min((c[0] for c in served), default=float('nan')):.2f} s; slow heads closed "
          f"after {head_cut[0]:.2f}-{head_cut[-1]:.2f} s, slow bodies answered after "
          f"{body_cut[0]:.2f}-{body_cut[-1]:.2f} s")
    assert all(h[1] == 200 for h in health) and len(health) >= 20
    # Refusals here are the well-behaved requests queued behind the slow heads arriving at
    # once; the slow bodies hold no slot (the test below).
    assert len(served) >= 5 and all(c[2] == "overloaded" for c in refused)
    for s in slow_bodies:
        assert s.answer.startswith(b"HTTP/1.1 408 "), s.answer[:200]
        doc = json.loads(s.answer.split(b"\r\n\r\n", 1)[1])
        assert doc["error"]["code"] == "request_timeout"
    assert all(s.answer == b"" for s in slow_heads)  # closed without an answer
    assert head_cut[-1] < HEADER_TIMEOUT + 2 and body_cut[-1] < BODY_TIMEOUT + 2

    # A kept-alive connection may still idle longer than the header timeout (up to
    # keepalive) before its next request: nginx keeps its upstream connections that way.
    parts = urlsplit(gw.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        ask = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        sock.sendall(ask)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        gevent.sleep(HEADER_TIMEOUT * 2.5)
        sock.sendall(ask)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")



TRICKLERS = 2 * IN_FLIGHT  # twice as many bodies in progress as the cap, reopened when cut
TRICKLE_BODY_TIMEOUT = 3.0


def test_bodies_in_progress_hold_no_slot_while_clients_trickle_them_again_and_again(
        procs) -> None:
    """Clients trickling bodies, each opening a new one as soon as the last is answered: the
    first ``IN_FLIGHT`` get EPD_BODY_TIMEOUT and a 408; past that bound a body gets
    BUSY_BODY_SECONDS and a 503; completions sent whole are served all along."""
    p, d = procs["sim"]("prefill"), procs["sim"]("decode")
    gw = procs["gunicorn"](
        roster([p], [d]),
        env={"EPD_MAX_IN_FLIGHT": str(IN_FLIGHT),
             "EPD_BODY_TIMEOUT": str(TRICKLE_BODY_TIMEOUT)})
    host = urlsplit(gw.url).netloc
    payload = json.dumps(COMPLETION).encode() + b" " * 2000
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode()
    window = TRICKLE_BODY_TIMEOUT * 2.5
    started = time.monotonic()
    slow: list[Slow] = []

    def trickle_again() -> None:
        while time.monotonic() - started < window:
            s = Slow()
            slow.append(s)
            _trickle(gw.url, head, payload, s)

    tricklers = [gevent.spawn(trickle_again) for _ in range(TRICKLERS)]
    gevent.sleep(0.5)  # every trickler has a body in progress
    completions: list[int] = []
    while time.monotonic() - started < window:
        completions.append(requests.post(gw.url + "/v1/completions", json=COMPLETION,
                                         timeout=5).status_code)
        gevent.sleep(0.2)
    gevent.joinall(tricklers, timeout=TRICKLE_BODY_TIMEOUT * 2, raise_error=True)

    statuses = [s.answer[9:12] for s in slow]
    timed_out = [s.ended - s.started for s in slow if s.answer.startswith(b"HTTP/1.1 408 ")]
    busy = [s for s in slow if s.answer.startswith(b"HTTP/1.1 503 ")]
    print(f"\n{TRICKLERS} clients trickling bodies again and again, cap {IN_FLIGHT}: "
          f"completions {completions.count(200)}/{len(completions)} served; slow bodies "
          f"answered {sorted(set(statuses))}: {len(timed_out)} x 408, {len(busy)} x 503")
    assert len(completions) >= 10 and set(completions) == {200}, completions
    assert set(statuses) <= {b"408", b"503"}, statuses
    assert timed_out and min(timed_out) >= TRICKLE_BODY_TIMEOUT - 0.1
    assert busy  # beyond the bound, refused long before EPD_BODY_TIMEOUT
    for s in busy:
        doc = json.loads(s.answer.split(b"\r\n\r\n", 1)[1])
        assert doc["error"]["code"] == "overloaded"
        assert s.ended - s.started < TRICKLE_BODY_TIMEOUT
