"""Finished spans as an OTLP ``ExportTraceServiceRequest``, written straight to protobuf's
wire format (docs/behaviour.md#tracing).

The SDK's exporter encodes a batch by building a protobuf message object per span, per
attribute and per value, at ~22 us a span here: with every request recorded, that was the
largest single part of what tracing cost. The wire format of these few messages is simple,
and most attribute pairs repeat from request to request (the method, the route, the model,
each instance's URL and label), so their encoded bytes are kept. The result decodes to the
very message the SDK's ``encode_spans`` builds (tests/unit/test_otlpwire.py holds the two
side by side); a value of a type it does not know raises ``TypeError`` and the batch goes
the SDK's way instead.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import SpanKind, StatusCode

_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack
# The span flags the SDK's encoder writes: whether the parent is remote is known, and is it.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_INT64 = 1 << 63


def _varint_slow(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = tuple(_varint_slow(i) for i in range(1 << 14))


def _varint(n: int) -> bytes:
    return _SMALL[n] if n < 16384 else _varint_slow(n)


#: A span's kind field (the protocol's numbers are the SDK's plus one) and a status's code.
_KINDS = {kind.value: b"\x30" + _varint(kind.value + 1) for kind in SpanKind}
_CODES = {code.value: b"\x18" + _varint(code.value) if code.value else b"" for code in StatusCode}


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (bytes, string or message)."""
    return tag + _varint(len(payload)) + payload


def _value(value: Any) -> bytes:
    """An ``AnyValue``'s body, as the SDK's encoder chooses the kind (bool before int)."""
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise TypeError("an integer attribute outside int64")
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if value is None:
        return b""
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join(_field(b"\x0a", _key_value(str(k), v))
                                        for k, v in value.items()))
    raise TypeError(f"an attribute value of type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    return _field(b"\x0a", key.encode()) + _field(b"\x12", _value(value))


@lru_cache(maxsize=4096)
def _pair(key: str, value: str | int) -> bytes:
    return _key_value(key, value)


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> list[bytes]:
    """Each attribute as a ``KeyValue`` field under ``tag``; the field of a string or
    integer value is kept, keyed by its pair (a bool, equal to 1 or 0, is never looked up
    there)."""
    if not attributes:
        return []
    # The SDK's attributes are a mapping over a plain dict, whose own items are 5x faster.
    items = getattr(attributes, "_dict", attributes).items()  # type: ignore[union-attr]
    out = []
    for key, value in items:
        kind = type(value)
        body = _pair(key, value) if kind is str or kind is int else _key_value(key, value)
        out.append(tag + _varint(len(body)) + body)
    return out


def _span(span: ReadableSpan) -> bytes:
    context = span.context
    assert context is not None  # a span the SDK ended always has one
    parent = span.parent
    name = span.name.encode()
    parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
             b"\x12\x08", context.span_id.to_bytes(8, "big")]
    if context.trace_state:
        parts.append(_field(b"\x1a", ",".join(f"{k}={v}" for k, v in context.trace_state.items())
                            .encode()))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    parts += (b"\x2a", _varint(len(name)), name, _KINDS[span.kind._value_])
    if span.start_time:
        parts += (b"\x39", _FIXED64(span.start_time))
    if span.end_time:
        parts += (b"\x41", _FIXED64(span.end_time))
    # The span's own attributes, not the read-only view a proxy object puts over them.
    parts += _attributes(b"\x4a", getattr(span, "_attributes", None) or span.attributes)
    if span.dropped_attributes:
        parts += (b"\x50", _varint(span.dropped_attributes))
    for event in span.events:
        body = b"".join([b"\x09" + _FIXED64(event.timestamp) if event.timestamp else b"",
                         _field(b"\x12", event.name.encode()),
                         *_attributes(b"\x1a", event.attributes),
                         b"\x20" + _varint(event.dropped_attributes)
                         if event.dropped_attributes else b""])
        parts.append(_field(b"\x5a", body))
    if span.dropped_events:
        parts += (b"\x60", _varint(span.dropped_events))
    if span.links:
        raise TypeError("links are left to the SDK's encoder")  # the proxy makes none
    if span.dropped_links:
        parts += (b"\x70", _varint(span.dropped_links))
    status = span.status
    code = _CODES[status.status_code._value_]
    if status.description:
        parts.append(_field(b"\x7a", _field(b"\x12", status.description.encode()) + code))
    else:
        parts.append(b"\x7a" + _SMALL[len(code)] + code)
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    parts += (b"\x85\x01", _FIXED32(flags))
    return b"".join(parts)


def _scope_spans(scope: Any, spans: list[bytes]) -> bytes:
    body = b""
    if scope is not None:
        inner = b""
        if scope.name:
            inner += _field(b"\x0a", scope.name.encode())
        if scope.version:
            inner += _field(b"\x12", scope.version.encode())
        inner += b"".join(_attributes(b"\x1a", scope.attributes))
        body = _field(b"\x0a", inner)
    else:
        body = b"\x0a\x00"
    body += b"".join(_field(b"\x12", s) for s in spans)
    if scope is not None and scope.schema_url:
        body += _field(b"\x1a", scope.schema_url.encode())
    return body


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """The request's bytes: spans grouped by resource, then by instrumentation scope, in
    the order they come (as the SDK's encoder does)."""
    grouped: dict[Any, dict[Any, list[bytes]]] = {}
    for span in spans:
        scopes = grouped.setdefault(span.resource, {})
        scopes.setdefault(span.instrumentation_scope or None, []).append(_span(span))
    out = []
    for resource, scopes in grouped.items():
        body = _field(b"\x0a", b"".join(_attributes(b"\x0a", resource.attributes)))
        body += b"".join(_field(b"\x12", _scope_spans(scope, encoded))
                         for scope, encoded in scopes.items())
        if resource.schema_url:
            body += _field(b"\x1a", resource.schema_url.encode())
        out.append(_field(b"\x0a", body))
    return b"".join(out)


def poster(exporter: SpanExporter) -> Callable[[bytes], bool] | None:
    """What posts an encoded batch through ``exporter``'s own HTTP client (its endpoint,
    headers, compression, certificates, timeout and retries, all read by the SDK), True
    when the collector took it; None when this SDK's exporter has no such client, and
    batches go through its ``export`` (which encodes them itself)."""
    client = getattr(exporter, "_client", None)
    send = getattr(client, "export", None)
    if not callable(send):
        return None

    def post(data: bytes) -> bool:
        return bool(getattr(send(data), "success", False))

    return post
