"""Small helpers the serving and end-to-end tests share."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import gevent
from gevent.pywsgi import WSGIHandler

from tests import shards

T = TypeVar("T")
#: How long a test waits for something the proxy does in the background (probes, aborts).
EVENTUALLY = 5.0


def eventually(check: Callable[[], T], seconds: float = EVENTUALLY, *, interval: float = 0.02,
               what: str | Callable[[], str] = "",
               ignoring: tuple[type[Exception], ...] = ()) -> T:
    """Poll ``check`` every ``interval`` until its answer is truthy or ``seconds`` pass, and
    give its last answer: every wait in the tests (in-process servers, and subprocesses, which
    gevent's patched sleep waits for as well) is this one loop.

    With ``what`` (or a function giving it when needed: a log's tail), a wait that runs out
    fails the test naming what it waited for and the last answer instead of handing back the
    falsy one. Exceptions of the ``ignoring`` types mean "not yet" (a server still starting);
    if the last try raised one, it propagates."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            answer = check()
        except ignoring as exc:
            if time.monotonic() > deadline:
                if what:
                    raise AssertionError(_timed_out(what, seconds, exc)) from exc
                raise
        else:
            if answer or time.monotonic() > deadline:
                break
        gevent.sleep(interval)
    if not answer and what:
        raise AssertionError(_timed_out(what, seconds, answer))
    return answer


def _timed_out(what: str | Callable[[], str], seconds: float, last: object) -> str:
    return f"not within {seconds:.1f} s: {what if isinstance(what, str) else what()} " \
        f"(last: {last!r})"


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Stop a server started in its own process group: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


class NoDelayHandler(WSGIHandler):
    """pywsgi like gunicorn's gevent worker: without Nagle (its listener sets TCP_NODELAY;
    otherwise every small response waits ~40 ms for the client's delayed ACK), and with the
    client connection in the environ as ``gunicorn.socket``, where the proxy watches it."""

    def handle(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().handle()

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        env["gunicorn.socket"] = self.socket
        return env


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.x response with a Content-Length, read raw off ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def children(pid: int) -> set[int]:
    """Pids of ``pid``'s children (a gunicorn master's workers); Linux /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


#: Ports this process handed out (``free_port``).
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port no one listens on, never handed out before in this test run.

    The kernel's answer is free only until the process it is given to binds it, a second or
    more for a gunicorn; meanwhile another test, or another process of ``make test``, could
    be told the same port, and a client of the one that lost the race would be served by the
    other's server. So each port is handed out once: by this process (a set), and among the
    processes of ``tests/shards.py`` by claiming it in their shared directory.
    """
    claims = os.environ.get(shards.CLAIMS)
    for _ in range(10_000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        if claims is None or shards.claim(claims, f"port {port}"):
            return port
    raise RuntimeError("no loopback port left that this test run has not handed out")


class RawStream:
    """A streaming POST on a plain socket, so a test can hang up exactly like a client that
    goes away (no library keeps the connection alive behind our back)."""

    def __init__(self, base_url: str, path: str, body: dict[str, Any], timeout: float = 10):
        parts = urlsplit(base_url)
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        self.buffer = b""

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("stream ended before " + marker.decode())
            self.buffer += data
        return self.buffer

    def first_event(self) -> bytes:
        """Read headers and the first SSE event."""
        self.read_until(b"\r\n\r\n")
        return self.read_until(b"data: ")

    def hang_up(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(base_url: str, headers: dict[str, str] | None = None) -> Samples:
    """GET /metrics (with ``headers``: the metrics or admin key, when the proxy has keys) and
    parse it with the Prometheus client's own text parser."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(base_url + "/metrics", timeout=10, headers=headers or {})
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One series' value (0 when absent, as a counter that never moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def instances(base_url: str, role: str, live: bool | None = None,
              headers: dict[str, str] | None = None) -> set[str]:
    """The URLs of ``role`` a proxy reports (``live``: only those live, or only those
    evicted), read from ``epd_instance_live`` on /metrics: /health shows counts alone."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(base_url + "/metrics", timeout=10, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return {s.labels["instance"] for family in text_string_to_metric_families(resp.text)
            for s in family.samples if s.name == "epd_instance_live"
            and s.labels["role"] == role and (live is None or (s.value >= 1) == live)}
