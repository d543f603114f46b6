"""Client-side helpers for the sim tests: a raw HTTP/1.1 client that sees chunk framing and
arrival times, the captured vLLM samples, and JSON shape comparison."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

#: Real vLLM traffic captured on this kind of machine, copied in as test data.
SAMPLES_DIR = Path(__file__).resolve().parent / "fixtures" / "realvllm"
IO_TIMEOUT = 5.0


def samples_available() -> bool:
    return SAMPLES_DIR.is_dir()


def load_sample(name: str) -> tuple[int, dict[str, str], str]:
    """(status, lower-cased headers, body text) of a captured ``.resp`` file."""
    text = (SAMPLES_DIR / f"{name}.resp").read_text(encoding="utf-8")
    head, _, body = text.partition("\n\n")
    lines = head.splitlines()
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return status, headers, body.strip("\n")


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body, in order; ``[DONE]`` kept as the string."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block.startswith("data: "):
            continue
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def shape(value: Any) -> Any:
    """Keys (recursively) without values: what must match vLLM; lists by their first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def collapse(shapes: list[Any]) -> list[Any]:
    """Runs of equally shaped chunks reduced to one, so streams of any length compare."""
    out: list[Any] = []
    for item in shapes:
        if not out or out[-1] != item:
            out.append(item)
    return out


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    frames: list[tuple[float, bytes]] = field(default_factory=list)  # chunked frames
    body: bytes = b""
    head_at: float = 0.0  # when the status line and headers had arrived
    terminated: bool = False  # the chunked terminator (or the full content-length) arrived

    @property
    def events(self) -> list[Any]:
        return sse_events(b"".join(p for _, p in self.frames).decode("utf-8"))


class RawClient:
    """One HTTP/1.1 connection driven by hand: send, read frame by frame, close at will."""

    def __init__(self, base_url: str, timeout: float = IO_TIMEOUT) -> None:
        parts = urlsplit(base_url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self.host = parts.netloc
        self._buf = b""

    def send(self, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> None:
        payload = body if isinstance(body, bytes) else (
            b"" if body is None else json.dumps(body).encode())
        head = {"host": self.host, "content-length": str(len(payload))}
        if body is not None and not isinstance(body, bytes):
            head["content-type"] = "application/json"
        head.update(headers or {})
        lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self._buf += data
        return True

    def _line(self) -> bytes | None:
        while b"\r\n" not in self._buf:
            if not self._fill():
                return None
        line, _, self._buf = self._buf.partition(b"\r\n")
        return line

    def _exact(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            if not self._fill():
                return None
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def read_head(self) -> RawResponse:
        status_line = self._line()
        if status_line is None:
            raise ConnectionError("connection closed before a response")
        headers = {}
        while True:
            line = self._line()
            if not line:
                break
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return RawResponse(int(status_line.split()[1]), headers, head_at=time.monotonic())

    def next_frame(self, resp: RawResponse) -> bytes | None:
        """One chunk of a chunked body (recorded with its arrival time); None at the end."""
        size_line = self._line()
        if size_line is None:
            return None
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            self._line()
            resp.terminated = True
            return None
        data = self._exact(size + 2)
        if data is None:
            return None
        resp.frames.append((time.monotonic(), data[:-2]))
        return data[:-2]

    def read_response(self) -> RawResponse:
        resp = self.read_head()
        if resp.headers.get("transfer-encoding", "").lower() == "chunked":
            while self.next_frame(resp) is not None:
                pass
            resp.body = b"".join(p for _, p in resp.frames)
        else:
            length = int(resp.headers.get("content-length", "0"))
            body = self._exact(length)
            resp.terminated = body is not None
            resp.body = body or b""
        return resp

    def close(self) -> None:
        self.sock.close()
