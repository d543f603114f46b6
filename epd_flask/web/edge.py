"""What a request must pass before any backend hears of it: serving API keys, body size,
content encoding and JSON nesting.

Plain functions over header values and bytes (no Flask), so the views stay thin and each rule
is testable on its own. Imports only ``errors``.
"""

from __future__ import annotations

import hashlib
import hmac
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from epd_flask.core.errors import ClientError, PayloadTooLarge, Unauthorized

#: zlib window bits: gzip framing only, and zlib/raw deflate (``deflate`` is either in the wild).
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_DEFLATE_WBITS = 32 + zlib.MAX_WBITS  # auto-detects a zlib header; raw deflate handled below
DECODE_STEP = 1 << 20
SUPPORTED_ENCODINGS = ("gzip", "deflate", "identity")
#: Body fields a client may not send through us: the KV connector's, set per leg by the proxy.
PROXY_FIELDS = frozenset({"kv_transfer_params"})

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")


class KeyRing:
    """Serving API keys, compared in constant time (digests of equal length, every key
    compared, so neither the key's length nor its position leaks through timing), and the
    tenant each belongs to (docs/behaviour.md#admission)."""

    def __init__(self, keys: Iterable[str], tenants: Mapping[str, str] | None = None) -> None:
        self._digests = tuple(_digest(k) for k in keys)
        self._tenants = {_digest(k): t for k, t in (tenants or {}).items()}

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """Raise ``Unauthorized`` (OpenAI's 401 shape) unless the bearer token is a key;
        the tenant the key belongs to, if it names one."""
        if not self.enabled:
            return None
        token = bearer_token(authorization)
        if token is None:
            err = Unauthorized(MISSING_KEY)
            err.code = None  # type: ignore[assignment]  # OpenAI sends null here
            raise err
        offered = _digest(token)
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(offered, known)
        if not found:
            raise Unauthorized(f"Incorrect API key provided: {_redact(token)}.")
        return self._tenants.get(offered)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def is_key(authorization: str | None, key: str | None) -> bool:
    """Does this Authorization header carry ``key`` as its bearer token (constant time)?"""
    token = bearer_token(authorization)
    if not key or token is None:
        return False
    return hmac.compare_digest(_digest(token), _digest(key))


def without_proxy_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The body without fields only the proxy may set (the same dict when it has none).

    ``kv_transfer_params`` tells an instance where to push or pull KV blocks: from a client
    it would point a decode at any engine's memory, or make a prefill push to any host.
    """
    if not any(name in doc for name in PROXY_FIELDS):
        return doc
    return {k: v for k, v in doc.items() if k not in PROXY_FIELDS}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _redact(token: str) -> str:
    if len(token) <= 8:
        return "*" * len(token)
    return f"{token[:3]}{'*' * min(len(token) - 7, 20)}{token[-4:]}"


def check_length(content_length: int | None, limit: int) -> None:
    """413 from the headers alone, before a byte of an oversized body is read."""
    if content_length is not None and content_length > limit:
        raise too_large(limit)


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is larger than this proxy accepts ({limit} bytes)")


def read_capped(read: Callable[[int], bytes], limit: int, step: int = 65536) -> bytes:
    """Read a body of unknown length (chunked), refusing it as soon as it passes ``limit``."""
    parts: list[bytes] = []
    size = 0
    while True:
        chunk = read(step)
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)


def unreadable(exc: Exception) -> ClientError:
    """A body whose framing the server could not parse (a chunk size that is not one)."""
    reason = " ".join(str(exc).split())[:120] or type(exc).__name__
    return ClientError(f"request body could not be read: {reason}", code="invalid_body")


def check_complete(received: int, content_length: int | None) -> None:
    """A body that ended before its Content-Length (the client closed its side early) is a
    fragment: forwarding it would send the backends something the client never meant."""
    if content_length is not None and received < content_length:
        raise ClientError(f"request body ended after {received} of the {content_length} bytes "
                          "its Content-Length announced", code="invalid_body")


def content_coding(content_encoding: str | None) -> str | None:
    """The one coding to undo (``gzip`` or ``deflate``), None for none; anything else is a
    415, known from the header alone, so it is answered before the body is read."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in SUPPORTED_ENCODINGS:
        raise ClientError(
            f"Content-Encoding {content_encoding!r} is not supported; send the body "
            "uncompressed or with gzip or deflate", status=415, code="unsupported_media_type")
    return codings[0]


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo a request ``Content-Encoding`` (gzip or deflate), capped at ``limit`` bytes out so
    a small compressed body cannot expand into gigabytes; anything else is a 415."""
    coding = content_coding(content_encoding)
    if coding is None:
        return raw
    wbits = _GZIP_WBITS if coding == "gzip" else _DEFLATE_WBITS
    try:
        return _inflate(raw, wbits, limit)
    except zlib.error:
        if coding == "deflate":
            try:
                return _inflate(raw, -zlib.MAX_WBITS, limit)
            except zlib.error:
                pass
        raise ClientError(f"request body is not valid {coding} data",
                          code="invalid_encoding") from None


def _inflate(raw: bytes, wbits: int, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    out: list[bytes] = []
    size = 0
    data = raw
    while not inflater.eof:
        # Bounded steps: pending output is drained by calling again with the leftover input
        # (or none), never by flush(), which would inflate everything at once.
        chunk = inflater.decompress(data, DECODE_STEP)
        data = inflater.unconsumed_tail
        if not chunk and not data:
            break
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        out.append(chunk)
    if not inflater.eof:
        raise zlib.error("truncated stream")
    return b"".join(out)


def check_depth(doc: Any, max_depth: int) -> None:
    """Refuse JSON nested deeper than ``max_depth`` (iterative: deep nesting must not cost
    the worker a recursion of its own)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise nested_too_deeply(max_depth)
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))


def nested_too_deeply(max_depth: int) -> ClientError:
    return ClientError(f"request body is nested more than {max_depth} levels deep",
                       code="invalid_json")
