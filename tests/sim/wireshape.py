"""The shape of vLLM's wire format, for comparing the sim with real vLLM: every key, every
JSON type, no values. Maps keyed by content (an image's hash, a token's text) keep one entry,
and runs of equally shaped SSE chunks fold into one, so answers of any length compare."""

from __future__ import annotations

import json
import re
from typing import Any

DIGITS = re.compile(r"\d+")


def _content_keyed(key: str | None, parent: str | None) -> bool:
    """Maps keyed by content: EC handles by media hash, and the completions form's top
    logprobs by token text (chat's ``top_logprobs`` entries have fixed keys)."""
    return key == "ec_transfer_params" or (key == "top_logprobs" and parent == "logprobs")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "str"


def shape(value: Any, key: str | None = None, parent: str | None = None) -> Any:
    if isinstance(value, dict):
        if _content_keyed(key, parent):
            return {"<key>": shape(next(iter(value.values())))} if value else {}
        return {k: shape(v, k, key) for k, v in value.items()}
    if isinstance(value, list):
        if not value:
            return []
        # The richest item stands for all: one token's bytes may be an empty list.
        items = [shape(v, key, parent) for v in value]
        return [max(items, key=lambda item: len(json.dumps(item)))]
    return _scalar(value)


def sse_payloads(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _foldable(a: Any, b: Any) -> bool:
    """Two chunks of one run: same keys, where an empty list matches any list (a token can
    have no bytes) and null matches any scalar (a finish_reason is set only at the end)."""
    if isinstance(a, list) and isinstance(b, list):
        return not a or not b or _foldable(a[0], b[0])
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_foldable(a[k], b[k]) for k in a)
    if isinstance(a, str) and isinstance(b, str):
        return a == b or "null" in (a, b)
    return a == b


def _merge(a: Any, b: Any) -> Any:
    """The run's shape: the non-null and non-empty parts of both."""
    if isinstance(a, list) and isinstance(b, list):
        return [_merge(a[0], b[0])] if a and b else (a or b)
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a[k], b[k]) for k in a}
    return b if a == "null" else a


def body_shape(body: str, content_type: str) -> Any:
    """A JSON body's shape, or a stream's chunk shapes with runs of like chunks folded into
    one: vLLM puts several tokens in one chunk when its client lags, so how many chunks carry
    the text is timing, not shape."""
    if content_type.startswith("text/event-stream"):
        folded: list[Any] = []
        for payload in sse_payloads(body):
            item = payload if payload == "[DONE]" else shape(payload)
            if folded and _foldable(folded[-1], item):
                folded[-1] = _merge(folded[-1], item)
            else:
                folded.append(item)
        return folded
    return shape(json.loads(body)) if body else ""


def error_text(body: str) -> str:
    """An error body with numbers blanked: token counts depend on the tokenizer, not the shape."""
    return DIGITS.sub("N", body)
