"""A small bounded load for end-to-end tests: clients in greenlets sending streamed chat
completions one after another, each answer checked to the last token."""

from __future__ import annotations

import json
import time
from types import TracebackType

import gevent
import requests

from tests.bodies import chat_stream

MAX_REQUESTS_PER_CLIENT = 2000
MAX_SECONDS = 60.0
CHAT = chat_stream(temperature=0)


def stream_chat(session: requests.Session, url: str, max_tokens: int) -> str:
    """``ok``, or why not: ``failed: ...`` (no answer) or ``truncated: ...`` (a stream that
    started and did not carry every token to ``[DONE]``)."""
    try:
        r = session.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens},
                         stream=True, timeout=30)
    except requests.RequestException as exc:
        return f"failed: {exc!r}"
    with r:
        if r.status_code != 200:
            return f"failed: {r.status_code} {r.text[:200]}"
        tokens, finish, last = 0, None, b""
        try:
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                last = line
                if line == b"data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    return f"truncated: in-band error {doc['error']}"
                choice = doc["choices"][0]
                tokens += bool(choice["delta"].get("content"))
                finish = choice.get("finish_reason") or finish
        except requests.RequestException as exc:
            return f"truncated: after {tokens} tokens: {exc!r}"
    if last != b"data: [DONE]" or tokens != max_tokens or finish != "length":
        return f"truncated: {tokens}/{max_tokens} tokens, finish {finish}, last {last[:60]!r}"
    return "ok"


class Load:
    """``clients`` greenlets in a loop until the ``with`` block ends (bounded in count and
    time). Outcomes are counted; ``mark`` names a moment so later counts can start there."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.clients = clients
        self.completed = 0
        self.failed: list[str] = []
        self.truncated: list[str] = []
        self.marks: dict[str, float] = {}
        self._done_at: list[float] = []
        self._stopping = False
        self._greenlets: list[gevent.Greenlet] = []
        self._started = 0.0

    def __enter__(self) -> Load:
        self._started = time.monotonic()
        self._greenlets = [gevent.spawn(self._client) for _ in range(self.clients)]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stopping = True
        gevent.joinall(self._greenlets, timeout=30)
        gevent.killall(self._greenlets, block=False)

    def spawn_streams(self, n: int, max_tokens: int) -> list[gevent.Greenlet]:
        """``n`` longer streams alongside the load; each greenlet's value is the outcome."""
        greenlets = [gevent.spawn(stream_chat, requests.Session(), self.url, max_tokens)
                     for _ in range(n)]
        gevent.sleep(0.1)  # let them reach the proxy before the test moves on
        self._greenlets += greenlets
        return greenlets

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()

    def completed_since(self, name: str) -> int:
        return sum(t >= self.marks[name] for t in self._done_at)

    def summary(self) -> str:
        elapsed = time.monotonic() - self._started
        return (f"{self.completed} streams ok, {len(self.failed)} failed, "
                f"{len(self.truncated)} truncated in {elapsed:.1f} s "
                f"({self.clients} clients, {self.max_tokens} tokens each)")

    def _client(self) -> None:
        session = requests.Session()
        deadline = time.monotonic() + MAX_SECONDS
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if self._stopping or time.monotonic() > deadline:
                break
            outcome = stream_chat(session, self.url, self.max_tokens)
            if outcome == "ok":
                self.completed += 1
                self._done_at.append(time.monotonic())
            elif outcome.startswith("failed"):
                self.failed.append(outcome)
            else:
                self.truncated.append(outcome)
        session.close()
