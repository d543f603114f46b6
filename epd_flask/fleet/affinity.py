"""A request's affinity keys and estimated prompt length, from its body alone: the
``RouteRequest`` every routing choice of the request starts from
(docs/behaviour.md#routing-policies).

The prefix key hashes the part of the prompt every turn of one conversation repeats and other
conversations do not:
- chat: the messages up to and including the first ``user`` message (system prompt + opening
  question). Turn 5 of a conversation starts with exactly these, so it goes where turns 1-4
  left their KV; two conversations sharing a system prompt differ in their first question and
  spread out, each instance computing the shared system prompt once and caching it. Hashing
  the *leading blocks* alone would put every conversation with the same long system prompt on
  one instance, relieved only by spill-over, which then scatters that instance's later turns.
- completions: the first ``PREFIX_BLOCKS`` blocks of ``PREFIX_BLOCK_CHARS`` characters of
  the prompt (the first prompt of a batch), where no message structure says where a
  conversation begins. A prompt shorter than one block is hashed whole.
A chat's system prompt (the messages before the first ``user`` one) is also hashed on its
own (``shared``): the conversations of one system prompt are kept on half of the instances
(``policies.tiered_order``), so each of those computes it once, not every instance.
At most ``MAX_ANCHOR_CHARS`` characters are hashed, so the cost per request is bounded
(blake2b: ~1 µs per KiB).

The token estimate is UTF-8 bytes / 4: BPE tokenizers of current models (Llama 3, Qwen,
GPT-4's cl100k) average about four characters per token on English text; for code and
non-Latin scripts it underestimates bytes per token and so errs towards keeping a prompt on
the disaggregated path. vLLM's own ``/tokenize`` would be exact but costs a round trip.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from epd_flask.fleet.policies import RouteRequest

PREFIX_BLOCK_CHARS = 256
PREFIX_BLOCKS = 16
MAX_ANCHOR_CHARS = 65536
BYTES_PER_TOKEN = 4
#: Per-message overhead of a chat template (role markers, separators), in tokens.
TEMPLATE_TOKENS_PER_MESSAGE = 4


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:  # media: its reference identifies it; bounded by the caller's cap
                parts.append(json.dumps(part, sort_keys=True, default=str)[:MAX_ANCHOR_CHARS])
        return "\x1f".join(parts)
    return "" if content is None else json.dumps(content, sort_keys=True, default=str)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt[:MAX_ANCHOR_CHARS // 4])
    return prompt if isinstance(prompt, str) else ""


def _hash(text: str) -> bytes:
    return hashlib.blake2b(text[:MAX_ANCHOR_CHARS].encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


def chat_anchor(messages: list[Any]) -> str:
    pieces: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        piece = f"{message.get('role')}\x1e{_text(message.get('content'))}\x1d"
        pieces.append(piece)
        size += len(piece)
        if message.get("role") == "user" or size >= MAX_ANCHOR_CHARS:
            break
    return "".join(pieces)


def chat_shared(messages: list[Any]) -> str:
    """The messages before the first ``user`` one (system or developer prompts): what many
    conversations share; empty when there are none."""
    pieces: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") == "user":
            break
        pieces.append(f"{message.get('role')}\x1e{_text(message.get('content'))}\x1d")
    return "".join(pieces)[:MAX_ANCHOR_CHARS]


def completion_anchor(prompt: Any) -> str:
    text = _prompt_text(prompt)
    blocks = min(len(text) // PREFIX_BLOCK_CHARS, PREFIX_BLOCKS)
    return text[:blocks * PREFIX_BLOCK_CHARS] if blocks else text


def estimate_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            if isinstance(message, dict):
                text = _text(message.get("content"))
                total += len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN
                total += TEMPLATE_TOKENS_PER_MESSAGE
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    text = _prompt_text(prompt)
    return len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN


def route_request(body: dict[str, Any], session: str | None = None,
                  model: str | None = None) -> RouteRequest:
    """The keys and estimate for one completion body (already validated); ``session``, the
    value of the roster's ``session_header``, keys session affinity before ``user`` does;
    ``model``, the model the request is routed by."""
    messages = body.get("messages")
    anchor = chat_anchor(messages) if isinstance(messages, list) \
        else completion_anchor(body.get("prompt"))
    shared = chat_shared(messages) if isinstance(messages, list) else ""
    user = body.get("user")
    if session:
        session_key: bytes | None = _hash("header\x1e" + session)
    else:
        session_key = _hash("user\x1e" + user) if isinstance(user, str) and user else None
    return RouteRequest(model=model, prefix=_hash(anchor) if anchor else None,
                        shared=_hash(shared) if shared else None, session=session_key,
                        prompt_tokens=estimate_tokens(body))
