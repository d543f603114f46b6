"""The benchmark's load generator: a separate process that drives one target over HTTP/1.1.

Plain gevent sockets and a small hand-written response reader, so the client costs as little
CPU per request and per chunk as we can manage in Python and never hides the target's cost.
Reads a JSON spec of request groups on stdin, prints one JSON result per group on stdout.

A spec: ``{"url": "http://127.0.0.1:8000", "deadline": 60, "groups": [{"name": "a32",
"path": "/v1/chat/completions", "body": {...}, "concurrency": 32, "requests": 3000,
"ramp": 0, "delay": 0, "timeout": 30}]}``. ``body_file`` may replace ``body`` (raw bytes).
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402

RECV_SIZE = 65536
SSE_DONE = b"data: [DONE]\n\n"


class ResponseError(Exception):
    pass


class Conn:
    """One kept-alive client connection; reconnects when the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.sock: socket.socket | None = None
        self.buf = b""
        # Every gap between body chunks of the last answer, in seconds (replay.py's ITL).
        self.gaps: list[float] = []
        # The last answer's headers, names in lower case (replay.py reads Retry-After).
        self.headers: dict[bytes, bytes] = {}

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _recv(self) -> bytes:
        assert self.sock is not None
        data = self.sock.recv(RECV_SIZE)
        if not data:
            raise ResponseError("connection closed mid-response")
        return data

    def request(self, head: bytes, body: bytes) -> tuple[int, bytes, float, float, float]:
        """Send one request; (status, body, time of the first body chunk, the largest gap
        between body chunks, time of the whole answer), in seconds from the send."""
        fresh = self.sock is None
        if fresh:
            self.sock = self._connect()
        t0 = time.perf_counter()
        try:
            self.sock.sendall(head + body if len(body) < RECV_SIZE else head)
            if len(body) >= RECV_SIZE:
                self.sock.sendall(body)
            return self._read(t0)
        except (OSError, ResponseError):
            self.close()
            if fresh:
                raise
            # A kept-alive connection the server had already closed: one honest retry.
            self.sock = self._connect()
            t0 = time.perf_counter()
            self.sock.sendall(head)
            self.sock.sendall(body)
            return self._read(t0)

    def _read(self, t0: float) -> tuple[int, bytes, float, float, float]:
        buf = self.buf
        while b"\r\n\r\n" not in buf:
            buf += self._recv()
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers
        parts: list[bytes] = []
        self.gaps = []
        first = 0.0
        last = 0.0
        gap = 0.0
        chunks = 0
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                while b"\r\n" not in buf:
                    buf += self._recv()
                line, _, buf = buf.partition(b"\r\n")
                size = int(line.split(b";", 1)[0], 16)
                while len(buf) < size + 2:
                    buf += self._recv()
                if size == 0:
                    buf = buf[2:]
                    break
                now = time.perf_counter() - t0
                if chunks:
                    gap = max(gap, now - last)
                    self.gaps.append(now - last)
                else:
                    first = now
                last = now
                chunks += 1
                parts.append(buf[:size])
                buf = buf[size + 2:]
        else:
            length = int(headers.get(b"content-length", b"0"))
            while len(buf) < length:
                buf += self._recv()
            parts.append(buf[:length])
            buf = buf[length:]
            first = time.perf_counter() - t0
            chunks = 1
        self.buf = buf
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, b"".join(parts), first, gap, time.perf_counter() - t0


def check(status: int, body: bytes, stream: bool) -> str | None:
    """Why this answer is not a complete success, or None."""
    if status != 200:
        return f"status {status}: {body[:200]!r}"
    if stream:
        if not body.endswith(SSE_DONE):
            return f"stream did not end with [DONE]: {body[-200:]!r}"
        if b'data: {"error"' in body:
            return "in-band error event"
        return None
    if b'"choices"' not in body[:4096] and b'"choices"' not in body:
        return f"no choices in the answer: {body[:200]!r}"
    return None


def run_group(url: str, group: dict[str, Any], deadline: float) -> dict[str, Any]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if "body_file" in group:
        with open(group["body_file"], "rb") as f:
            body = f.read()
        stream = bool(group.get("stream"))
    else:
        body = json.dumps(group["body"], separators=(",", ":")).encode()
        stream = bool(group["body"].get("stream"))
    head = (f"POST {group['path']} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    concurrency = int(group["concurrency"])
    total = int(group["requests"])
    ramp = float(group.get("ramp", 0))
    timeout = float(group.get("timeout", 60))
    issued = 0
    latencies: list[float] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    errors: list[str] = []

    def user(index: int) -> None:
        nonlocal issued
        gevent.sleep(float(group.get("delay", 0)) + ramp * index / concurrency)
        conn = Conn(host, port)
        try:
            while issued < total and time.monotonic() < deadline:
                issued += 1
                try:
                    with gevent.Timeout(timeout, ResponseError(f"no answer in {timeout} s")):
                        status, data, first, gap, elapsed = conn.request(head, body)
                except (OSError, ResponseError, ValueError) as exc:
                    conn.close()
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                why = check(status, data, stream)
                if why:
                    errors.append(why)
                    continue
                latencies.append(elapsed)
                ttfts.append(first)
                if stream:
                    gaps.append(gap)
        finally:
            conn.close()

    started = time.perf_counter()
    workers = [gevent.spawn(user, i) for i in range(concurrency)]
    gevent.joinall(workers)
    wall = time.perf_counter() - started
    return {
        "name": group["name"],
        "completed": len(latencies),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": wall,
        "latency_s": latencies,
        "ttft_s": ttfts,
        "max_gap_s": gaps,
    }


def main() -> int:
    spec = json.load(sys.stdin)
    deadline = time.monotonic() + float(spec.get("deadline", 120))
    jobs = [gevent.spawn(run_group, spec["url"], g, deadline) for g in spec["groups"]]
    gevent.joinall(jobs)
    results = [job.get() for job in jobs]
    json.dump({"groups": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
