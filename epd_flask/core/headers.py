"""Which headers cross the proxy, in each direction (docs/behaviour.md#edge).

Inbound, only an allowlist of end-to-end headers reaches an upstream: anything else (cookies,
proxy credentials, hop-by-hop headers) stays at the edge. Outbound, hop-by-hop headers and
``content-length`` are dropped because the relay re-frames the body.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping

REQUEST_ID_HEADER = "X-Request-Id"
AUTHORIZATION_HEADER = "Authorization"
#: Which data-parallel rank of an instance takes a call (Mooncake prefill, an encoder's consumer).
DP_RANK_HEADER = "X-data-parallel-rank"
FORWARDED_REQUEST_HEADERS = frozenset({
    "accept",
    "accept-language",
    "authorization",
    "cache-control",
    "idempotency-key",
    "openai-organization",
    "openai-project",
    "traceparent",
    "tracestate",
    "user-agent",
})
#: The W3C trace-context headers: they name the span an instance's own spans nest under.
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
#: The allowlist of a request the proxy traces itself: each upstream call carries the
#: trace-context headers of its own span instead (docs/behaviour.md#tracing).
FORWARDED_WHEN_TRACED = FORWARDED_REQUEST_HEADERS - TRACE_HEADERS
HOP_BY_HOP = frozenset({
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
})
DROPPED_RESPONSE_HEADERS = HOP_BY_HOP | {"content-length", "date", "server", "x-request-id"}
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id(client_value: str | None) -> str:
    """The client's id when it is safe to put in upstream headers and logs, else a fresh one."""
    if client_value and _SAFE_REQUEST_ID.fullmatch(client_value):
        return client_value
    return uuid.uuid4().hex


def new_upstream_id() -> str:
    """The id one proxied request is known by upstream.

    Never the client's ``X-Request-Id``: instances key state on it (vLLM names the engine's
    request after it, Mooncake transfers and NIXL handles follow), and a client id is not
    unique: a library that sends a constant one, a retrying gateway, or a client that has seen
    another's id would make two requests share that state and read each other's KV.
    """
    return uuid.uuid4().hex


def upstream_headers(client: Iterable[tuple[str, str]], rid: str,
                     backend_api_key: str | None = None,
                     client_trace: bool = True) -> dict[str, str]:
    """Headers for every upstream call of one request: the allowlist plus ``rid``, the id
    it is known by upstream (``new_upstream_id``, never the client's). ``client_trace``
    off: the client's ``traceparent`` and ``tracestate`` stay here, the proxy tracing the
    request itself.

    With a backend key configured, the client's ``Authorization`` (in any spelling) is dropped
    and ours sent instead: an instance must never see two credentials, nor the client's
    credential for the proxy when the fleet has its own.
    """
    allowed = FORWARDED_REQUEST_HEADERS if client_trace else FORWARDED_WHEN_TRACED
    out = {name: value for name, value in client if name.lower() in allowed
           and not (backend_api_key and name.lower() == "authorization")}
    if backend_api_key:
        out[AUTHORIZATION_HEADER] = f"Bearer {backend_api_key}"
    out[REQUEST_ID_HEADER] = rid
    return out


def client_headers(
    upstream: Mapping[str, str] | Iterable[tuple[str, str]],
) -> list[tuple[str, str]]:
    """Upstream response headers that may reach the client, in their original order."""
    items = upstream.items() if isinstance(upstream, Mapping) else upstream
    return [(k, v) for k, v in items if k.lower() not in DROPPED_RESPONSE_HEADERS]
