"""The usage a client is billed by: the prompt tokens prefill found in its prefix cache.

In P+D the prefix cache that matters is prefill's, yet the usage the client sees is decode's,
which knows nothing of it. Prefill reports its hits (``usage.prompt_tokens_details
.cached_tokens``, or NIXL's ``remote_prefill_cached_tokens``); these pure functions write that
number into decode's usage, in a JSON body or in the SSE events of a stream. Stream events
without a usage object are passed through untouched after one substring test.
"""

from __future__ import annotations

import json
from typing import Any

USAGE_KEY = b'"usage"'
DATA_PREFIX = b"data: "
EVENT_END = b"\n\n"


class UsageError(ValueError):
    """Prefill reported prefix-cache hits no prompt could have: a broken or hostile prefill,
    whose number must not reach the client's bill."""


def _cached(value: Any, prompt_tokens: Any, where: str) -> int:
    """A reported hit count, checked: absent or null is 0; anything else must be a whole
    number from 0 to the prompt's length."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{where} is not a non-negative integer")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
        raise UsageError(f"{where} is reported without usage.prompt_tokens to bound it")
    if value > prompt_tokens:
        raise UsageError(f"{where} ({value}) exceeds usage.prompt_tokens ({prompt_tokens})")
    return value


def prefill_cached_tokens(reply: dict[str, Any] | None) -> int:
    """Prompt tokens prefill served from its prefix cache, as it reported them (0: none);
    ``UsageError`` when the report cannot be true."""
    if not isinstance(reply, dict):
        return 0
    found = 0
    usage = reply.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            found = _cached(details.get("cached_tokens"), prompt_tokens,
                            "usage.prompt_tokens_details.cached_tokens")
    params = reply.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("remote_prefill_cached_tokens") is not None:
        found = max(found, _cached(params["remote_prefill_cached_tokens"], prompt_tokens,
                                   "kv_transfer_params.remote_prefill_cached_tokens"))
    return found


def prefill_tokens(reply: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt tokens, of them cached) as prefill reported them, for its cache-hit share;
    None when it reported no prompt length or hits that cannot be true (counting those would
    skew the share; the caller's own check decides what the request does about them)."""
    usage = reply.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0:
        return None
    try:
        return prompt, prefill_cached_tokens(reply)
    except UsageError:
        return None


_OBJECT = json.JSONDecoder()


def last_usage(data: bytes) -> tuple[int | None, int | None, int | None] | None:
    """(prompt, completion, cached prompt tokens) of the last usage object in ``data`` (a
    JSON completion body, or whole SSE events), each None when absent; None when there is
    no readable one. Decodes that object alone: the answer around it may be large."""
    at = data.rfind(USAGE_KEY)
    if at < 0:
        return None
    try:
        text = data[at + len(USAGE_KEY):].decode("utf-8").lstrip()
        if not text.startswith(":"):
            return None
        usage, _ = _OBJECT.raw_decode(text[1:].lstrip())
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    return (_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
            _count(details.get("cached_tokens")) if isinstance(details, dict) else None)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def set_cached_tokens(doc: Any, cached: int) -> bool:
    """Write ``cached`` into ``doc["usage"]["prompt_tokens_details"]``; False if no usage."""
    if not isinstance(doc, dict):
        return False
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    details["cached_tokens"] = cached
    usage["prompt_tokens_details"] = details
    return True


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def rewrite_body(data: bytes, cached: int) -> bytes:
    """A JSON completion body with prefill's cache hits in its usage (unchanged if none)."""
    if cached <= 0 or USAGE_KEY not in data:
        return data
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return data
    return _encode(doc) if set_cached_tokens(doc, cached) else data


def rewrite_events(chunk: bytes, cached: int) -> bytes:
    """Whole SSE events with prefill's cache hits in any usage object they carry."""
    if cached <= 0 or USAGE_KEY not in chunk:
        return chunk
    events = chunk.split(EVENT_END)
    for i, event in enumerate(events):
        if USAGE_KEY not in event or not event.startswith(DATA_PREFIX):
            continue
        try:
            doc = json.loads(event[len(DATA_PREFIX):])
        except (ValueError, UnicodeDecodeError):
            continue
        if set_cached_tokens(doc, cached):
            events[i] = DATA_PREFIX + _encode(doc)
    return EVENT_END.join(events)
