"""What every KV connector shares: the interface, and the P1 rules for a prefill body."""

from __future__ import annotations

from typing import Any, Protocol

Body = dict[str, Any]


def prime_body(body: Body) -> Body:
    """The prefill leg's body (P1): compute the prompt's KV, generate one token, don't stream.

    A new dict is returned; the client's body is never mutated, so a retry starts from it.
    """
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("min_tokens", "min_completion_tokens"):
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            out[key] = 1
    out.pop("stream_options", None)
    return out


class Connector(Protocol):
    """How one KV connector shapes the prefill and decode legs of a P+D request."""

    name: str

    def prefill_body(self, body: Body, request_id: str) -> Body:
        """The body sent to the prefill instance."""

    def decode_body(self, body: Body, prefill_reply: Body | None, request_id: str) -> Body:
        """The body sent to decode, given what prefill answered (None if it was not read)."""
