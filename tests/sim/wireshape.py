"""The shape of vLLM's wire format, for comparing the sim with real vLLM: every key, every
JSON type, no values. Maps keyed by content (an image's hash, a token's text) keep one entry,
and runs of equally shaped SSE chunks fold into one, so answers of any length compare."""

from __future__ import annotations

import json
import re
from typing import Any

#: Keys whose value is a map keyed by content rather than by field names.
CONTENT_KEYED = frozenset({"ec_transfer_params", "top_logprobs"})
DIGITS = re.compile(r"\d+")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "str"


def shape(value: Any, content_keyed: bool = False) -> Any:
    if isinstance(value, dict):
        if content_keyed:
            return {"<key>": shape(next(iter(value.values())))} if value else {}
        return {k: shape(v, k in CONTENT_KEYED) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0], content_keyed)] if value else []
    return _scalar(value)


def sse_payloads(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def body_shape(body: str, content_type: str) -> Any:
    """A JSON body's shape, or a stream's chunk shapes with repeats folded."""
    if content_type.startswith("text/event-stream"):
        folded: list[Any] = []
        for payload in sse_payloads(body):
            item = payload if payload == "[DONE]" else shape(payload)
            if not folded or folded[-1] != item:
                folded.append(item)
        return folded
    return shape(json.loads(body)) if body else ""


def error_text(body: str) -> str:
    """An error body with numbers blanked: token counts depend on the tokenizer, not the shape."""
    return DIGITS.sub("N", body)
