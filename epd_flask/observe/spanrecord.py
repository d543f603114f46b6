"""One finished span, as the proxy records it (docs/behaviour.md#tracing).

A plain record, not the SDK's span object: that one holds four locks, a bounded attribute map
checking every value, two bounded lists, and makes a read-only copy when it ends, which was
most of what tracing cost a request. The proxy writes its few spans from one greenlet and
never changes one after it ends, so a record is enough; the span limits (``OTEL_SPAN_*``,
``OTEL_ATTRIBUTE_*``) are applied when it is encoded (``otlpwire``), as it ends.
"""

from __future__ import annotations

from typing import Any

#: A span's kind, numbered as OpenTelemetry's API numbers ``SpanKind``.
INTERNAL, SERVER, CLIENT = 0, 1, 2
#: A span's status code, numbered as the API's ``StatusCode`` (no span of the proxy is OK).
UNSET, ERROR = 0, 2

#: An event: (name, wall-clock nanoseconds, attributes or None).
Event = tuple[str, int, "dict[str, Any] | None"]


class SpanRecord:
    """What the collector gets of one span. ``trace_state`` is the W3C ``tracestate``
    header's value ("" for none); ``parent_id`` 0 for a trace's first span; ``end_ns`` 0
    until it ends."""

    __slots__ = ("attributes", "end_ns", "events", "kind", "message", "name", "parent_id",
                 "remote_parent", "span_id", "start_ns", "status", "trace_id", "trace_state")

    def __init__(self, trace_id: int, span_id: int, parent_id: int, remote_parent: bool,
                 trace_state: str, name: str, kind: int, start_ns: int,
                 attributes: dict[str, Any] | None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.trace_state = trace_state
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.events: list[Event] | None = None
        self.status = UNSET
        self.message: str | None = None
