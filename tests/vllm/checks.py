"""What the vLLM-tier tests share: HTTP calls that read JSON or SSE, prompts that never share a
prefix (so a decode's own prefix cache cannot stand in for a KV transfer), and the decode-side
metrics that prove KV arrived from elsewhere.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import gevent
import requests

from tests.bodies import chat, completion
from tests.helpers import eventually
from tests.vllm.fleet import MODEL_NAME, VllmServer

#: Real servers on a shared 2-core machine: generous, but every call ends.
HTTP_TIMEOUT = 120.0
#: 80+ tokens: more than two 32-token KV blocks, so there is KV worth moving.
STORY = ("the quick brown fox jumps over the lazy dog and then tells me a story about cats "
         "dogs and birds one two three four five six seven eight nine ten hello world what "
         "is your name")
EXTERNAL = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
LOCAL = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
CACHED = 'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'
METRICS_SETTLE_SECONDS = 10.0
_counter = itertools.count(1)


def unique_prompt(tag: str) -> str:
    """A prompt whose first tokens are new, so no server has any of its blocks cached."""
    return f"case {tag} {next(_counter)} {STORY}"


def completion_body(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """This tier's completion: greedy, so two servers' answers compare token for token."""
    return completion(prompt, **{"model": MODEL_NAME, "max_tokens": max_tokens,
                                 "temperature": 0, **extra})


def chat_body(text: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """This tier's chat, greedy as ``completion_body``."""
    return chat(text, **{"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                         **extra})


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)

    @property
    def events(self) -> list[Any]:
        """SSE payloads in order, ``[DONE]`` kept as the string."""
        out: list[Any] = []
        for block in self.raw.decode("utf-8").split("\n\n"):
            block = block.strip()
            if block.startswith("data: "):
                data = block[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out

    @property
    def text(self) -> str:
        """The generated text, from a JSON body or from stream chunks."""
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            parts = []
            for event in self.events:
                if event == "[DONE]":
                    continue
                for choice in event.get("choices", []):
                    parts.append(choice.get("text") or
                                 (choice.get("delta") or {}).get("content") or "")
            return "".join(parts)
        choice = self.json["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]


def call(method: str, url: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    if raw is not None:
        resp = requests.request(method, url, data=raw, headers=headers, timeout=HTTP_TIMEOUT)
    else:
        resp = requests.request(method, url, json=body, headers=headers, timeout=HTTP_TIMEOUT)
    return Reply(resp.status_code, {k.lower(): v for k, v in resp.headers.items()},
                 resp.content)


def post(base: str, path: str, body: Any) -> Reply:
    return call("POST", base + path, body)


@dataclass
class Pulled:
    """What a decode's counters say about one request's prompt tokens."""

    external: float  # tokens whose KV came from another instance
    local: float  # tokens the decode computed itself
    extra: dict[str, float]


def kv_delta(server: VllmServer, before: dict[str, float], prompt_tokens: int,
             *names: str) -> Pulled:
    """Counter changes since ``before``, once the server has accounted for ``prompt_tokens``
    (its counters trail the response by a scheduler step)."""
    after: dict[str, float] = {}

    def accounted() -> bool:
        nonlocal after
        after = server.metrics()
        return sum(after.get(k, 0) - before.get(k, 0)
                   for k in (EXTERNAL, LOCAL, CACHED)) >= prompt_tokens
    eventually(accounted, METRICS_SETTLE_SECONDS, interval=0.2)
    return Pulled(
        external=after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0),
        local=after.get(LOCAL, 0) - before.get(LOCAL, 0),
        extra={n: after.get(n, 0) - before.get(n, 0) for n in names},
    )


#: Rounds of two concurrent same-id requests: with the client's id as the upstream one, real
#: Mooncake crossed answers in 2 of 3 and 2 of 5 rounds.
SAME_ID_ROUNDS = 4


def same_id_rounds(base: str, path: str, tag: str,
                   rounds: int = SAME_ID_ROUNDS) -> list[tuple[list[str], list[str]]]:
    """Per round, the answers to two different prompts sent alone and then at once, all four
    with one client ``X-Request-Id`` (greedy: each pair must match)."""
    body = chat_body if "chat" in path else completion_body
    headers = {"X-Request-Id": "same-id-" + tag.replace("/", ".")}  # a safe id: kept as sent
    out = []
    for n in range(rounds):
        bodies = [body(unique_prompt(f"{tag} round {n} client {c}")) for c in (0, 1)]
        solo = []
        for b in bodies:
            reply = call("POST", base + path, b, headers=headers)
            assert reply.status == 200, reply.raw
            assert reply.headers.get("x-request-id") == headers["X-Request-Id"], reply.headers
            solo.append(reply.text)
        together = [gevent.spawn(call, "POST", base + path, b, None, headers) for b in bodies]
        gevent.joinall(together, raise_error=True)
        for g in together:
            assert g.value.status == 200, g.value.raw
        out.append((solo, [g.value.text for g in together]))
    return out

