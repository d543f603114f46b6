"""The proxy's span records as an OTLP ``ExportTraceServiceRequest``, written straight to
protobuf's wire format (docs/behaviour.md#tracing).

The SDK's exporter encodes a batch by building a protobuf message object per span, per
attribute and per value, at ~22 us a span here. The wire format of these few messages is
simple, a worker's resource and scope never change (their bytes are made once), and most
attribute pairs repeat from request to request (the method, the route, the model, each
instance's URL and label), so their encoded bytes are kept. The result decodes to the very
message the SDK's ``encode_spans`` builds from the same spans as its own ``ReadableSpan``
(``Encoder.readable``; tests/unit/test_otlpwire.py holds the two side by side), the SDK's span
limits applied as its span objects apply them. A value of a type this encoder does not know
raises ``TypeError``, and that span goes the SDK's way instead.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from epd_flask.observe.spanrecord import SpanRecord

_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack
# The span flags the SDK's encoder writes: whether the parent is remote is known, and is it.
_LOCAL_FLAGS = b"\x85\x01" + _FIXED32(0x100)
_REMOTE_FLAGS = b"\x85\x01" + _FIXED32(0x300)
_INT64 = 1 << 63
_UNLIMITED = sys.maxsize


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


#: A span's kind field (the protocol's numbers are the API's plus one) and a status's code.
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


@lru_cache(maxsize=256)
def _key_field(key: str) -> bytes:
    return _field(b"\x0a", key.encode())


def _unique_pair(key: str, value: str) -> bytes:
    """A string attribute whose value never repeats (a request id): kept, it would only push
    the pairs that do repeat out of the cache, at a third more than encoding it."""
    raw = value.encode()
    body = b"\x0a" + _varint(len(raw)) + raw
    return _key_field(key) + b"\x12" + _varint(len(body)) + body


def _clipped(value: Any, length: int) -> Any:
    """A value with its strings cut to ``length``, as the SDK's attribute maps cut them."""
    if isinstance(value, str):
        return value[:length]
    if isinstance(value, (bool, int, float, bytes)) or value is None:
        return value
    if isinstance(value, Sequence):
        return tuple(_clipped(v, length) for v in value)
    if isinstance(value, Mapping):
        return {k: _clipped(v, length) for k, v in value.items()}
    return value


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None, most: int = _UNLIMITED,
                length: int | None = None, unique: frozenset[str] = frozenset(),
                ) -> tuple[list[bytes], int]:
    """Each attribute as a ``KeyValue`` field under ``tag``, and how many the limit dropped:
    the newest ``most`` are kept, as the SDK's bounded map keeps them. The field of a string
    or integer value is kept, keyed by its pair (a bool, equal to 1 or 0, is never looked up
    there), unless its key is one of ``unique``."""
    if not attributes:
        return [], 0
    items: Iterable[tuple[str, Any]] = attributes.items()
    dropped = len(attributes) - most
    if dropped > 0:
        items = list(items)[dropped:]
    out = []
    for key, value in items:
        if length is not None:
            value = _clipped(value, length)
        kind = type(value)
        if kind is str:
            body = _unique_pair(key, value) if key in unique else _pair(key, value)
        elif kind is int:
            body = _pair(key, value)
        else:
            body = _key_value(key, value)
        out.append(tag + _varint(len(body)) + body)
    return out, max(dropped, 0)


def _scope_field(scope: InstrumentationScope) -> bytes:
    inner = b""
    if scope.name:
        inner += _field(b"\x0a", scope.name.encode())
    if scope.version:
        inner += _field(b"\x12", scope.version.encode())
    inner += b"".join(_attributes(b"\x1a", scope.attributes)[0])
    return _field(b"\x0a", inner)


class Encoder:
    """One worker's spans as the bytes of an export request: its resource and instrumentation
    scope (which never change, so their fields are made once), the span limits the SDK
    read from the environment, and the attributes whose string values never repeat."""

    def __init__(self, resource: Resource, scope: InstrumentationScope, limits: SpanLimits,
                 unique: frozenset[str] = frozenset()) -> None:
        self.resource = resource
        self._unique = unique
        self.scope = scope
        self.limits = limits
        self._max_attributes = _bound(limits.max_span_attributes)
        self._max_length = limits.max_span_attribute_length
        self._max_events = _bound(limits.max_events)
        self._max_event_attributes = _bound(limits.max_event_attributes)
        self._max_event_length = limits.max_attribute_length
        self._resource_field = _field(b"\x0a", b"".join(_attributes(b"\x0a",
                                                                    resource.attributes)[0]))
        self._resource_tail = (_field(b"\x1a", resource.schema_url.encode())
                               if resource.schema_url else b"")
        self._scope_field = _scope_field(scope)
        self._scope_tail = (_field(b"\x1a", scope.schema_url.encode())
                            if scope.schema_url else b"")

    def encode(self, records: Iterable[SpanRecord]) -> bytes:
        """The request's bytes: one resource, one scope, the spans in the order they come."""
        return self.request([self.span(r) for r in records])

    def request(self, spans: list[bytes]) -> bytes:
        """The request's bytes around spans already encoded (``span``)."""
        scope_spans = self._scope_field + b"".join(spans) + self._scope_tail
        body = self._resource_field + _field(b"\x12", scope_spans) + self._resource_tail
        return _field(b"\x0a", body)

    def span(self, record: SpanRecord) -> bytes:
        """One span's field of a ``ScopeSpans``."""
        body = self._span(record)
        return b"\x12" + _varint(len(body)) + body

    def _span(self, record: SpanRecord) -> bytes:
        name = record.name.encode()
        parts = [b"\x0a\x10", record.trace_id.to_bytes(16, "big"),
                 b"\x12\x08", record.span_id.to_bytes(8, "big")]
        if record.trace_state:
            parts.append(_field(b"\x1a", record.trace_state.encode()))
        if record.parent_id:
            parts += (b"\x22\x08", record.parent_id.to_bytes(8, "big"))
        parts += (b"\x2a", _varint(len(name)), name, _KINDS[record.kind],
                  b"\x39", _FIXED64(record.start_ns), b"\x41", _FIXED64(record.end_ns))
        attributes, dropped = _attributes(b"\x4a", record.attributes, self._max_attributes,
                                          self._max_length, self._unique)
        parts += attributes
        if dropped:
            parts += (b"\x50", _varint(dropped))
        events = record.events
        if events:
            dropped = len(events) - self._max_events
            for name_, at, event_attributes in events[max(dropped, 0):]:
                fields, lost = _attributes(b"\x1a", event_attributes,
                                           self._max_event_attributes, self._max_event_length)
                body = b"".join([b"\x09" + _FIXED64(at) if at else b"",
                                 _field(b"\x12", name_.encode()), *fields,
                                 b"\x20" + _varint(lost) if lost else b""])
                parts.append(_field(b"\x5a", body))
            if dropped > 0:
                parts += (b"\x60", _varint(dropped))
        code = _CODES[record.status]
        if record.message:
            parts.append(_field(b"\x7a", _field(b"\x12", record.message.encode()) + code))
        else:
            parts.append(b"\x7a" + _SMALL[len(code)] + code)
        parts.append(_REMOTE_FLAGS if record.remote_parent else _LOCAL_FLAGS)
        return b"".join(parts)

    def readable(self, record: SpanRecord) -> ReadableSpan:
        """The record as the SDK's own span, its limits applied by the SDK's own bounded
        containers: what the exporter's ``export`` takes when this encoder cannot."""
        limits = self.limits
        state = TraceState.from_header([record.trace_state]) if record.trace_state else None
        context = SpanContext(record.trace_id, record.span_id, is_remote=False,
                              trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)
        parent = (SpanContext(record.trace_id, record.parent_id, is_remote=record.remote_parent)
                  if record.parent_id else None)
        events: BoundedList = BoundedList(limits.max_events)
        for name, at, attributes in record.events or ():
            events.append(Event(name, BoundedAttributes(
                limits.max_event_attributes, attributes,
                max_value_len=limits.max_attribute_length, immutable=True), at))
        return ReadableSpan(
            name=record.name, context=context, parent=parent, resource=self.resource,
            attributes=BoundedAttributes(limits.max_span_attributes, record.attributes,
                                         max_value_len=limits.max_span_attribute_length),
            events=events, kind=SpanKind(record.kind),
            status=Status(StatusCode(record.status), record.message),
            start_time=record.start_ns, end_time=record.end_ns,
            instrumentation_scope=self.scope)


def _bound(limit: int | None) -> int:
    return _UNLIMITED if limit is None else limit


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
