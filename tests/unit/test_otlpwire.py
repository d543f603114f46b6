"""The proxy's span records and their OTLP encoder (observe/spanrecord.py, otlpwire.py)
against the SDK: the same spans, made by the SDK's own tracer, encoded by the SDK's
``encode_spans``, decode to the very message this encoder writes, for every kind of value,
event, status and parent a span can carry and under the SDK's span limits
(docs/behaviour.md#tracing).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.propagation import set_span_in_context

from epd_flask.core.errors import ProxyError
from epd_flask.observe import otelspans, otlpwire
from epd_flask.observe.spanqueue import SpanQueue
from epd_flask.observe.spanrecord import CLIENT, ERROR, INTERNAL, SERVER, SpanRecord
from epd_flask.observe.tracing import TraceSettings

RESOURCE = Resource.create({"service.name": "s", "process.pid": 7},
                           schema_url="https://schema/r")
SCOPE = InstrumentationScope("scope", "1.2", "https://schema/s", {"scope.flag": True})


class Kept(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


class Ids(IdGenerator):
    """The ids of the records being replayed, in order."""

    def __init__(self) -> None:
        self.next_span: Iterator[int] = iter(())
        self.next_trace: Iterator[int] = iter(())

    def generate_span_id(self) -> int:
        return next(self.next_span)

    def generate_trace_id(self) -> int:
        return next(self.next_trace)


def replayed(records: list[SpanRecord], limits: SpanLimits | None = None) -> list[ReadableSpan]:
    """The same spans made by the SDK's own tracer: the same ids, parents, names, kinds,
    times, attributes (the limits applied by the SDK as it sets them), events and status."""
    kept, ids = Kept(), Ids()
    provider = TracerProvider(resource=RESOURCE, shutdown_on_exit=False, id_generator=ids,
                              span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer(SCOPE.name, SCOPE.version, schema_url=SCOPE.schema_url,
                                 attributes=SCOPE.attributes)
    for r in records:
        ids.next_span, ids.next_trace = iter([r.span_id]), iter([r.trace_id])
        context = None
        if r.parent_id:
            state = TraceState.from_header([r.trace_state]) if r.trace_state else None
            context = set_span_in_context(NonRecordingSpan(SpanContext(
                r.trace_id, r.parent_id, is_remote=r.remote_parent,
                trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)))
        span = tracer.start_span(r.name, context=context, kind=SpanKind(r.kind),
                                 attributes=dict(r.attributes or {}), start_time=r.start_ns)
        for name, at, attributes in r.events or ():
            span.add_event(name, attributes, timestamp=at)
        if r.status:
            span.set_status(Status(StatusCode(r.status), r.message))
        span.end(end_time=r.end_ns)
    return kept.spans


def decoded(data: bytes) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(data)


def record(name: str, trace_id: int, span_id: int, parent_id: int = 0, *, kind: int = INTERNAL,
           remote: bool = False, state: str = "", attributes: dict[str, Any] | None = None,
           events: list[Any] | None = None, start: int = 1_000, end: int = 2_000,
           status: int = 0, message: str | None = None) -> SpanRecord:
    made = SpanRecord(trace_id, span_id, parent_id, remote, state, name, kind, start,
                      attributes)
    made.end_ns, made.events, made.status, made.message = end, events, status, message
    return made


TRACE = 0x0AF7651916CD43DD8448EB211C80319C


def every_kind() -> list[SpanRecord]:
    root = record("POST /v1/chat/completions", TRACE, 0x1111, 0xB7AD6B7169203331, kind=SERVER,
                  remote=True, state="vendor=opaque,other=x", attributes={
                      "s": "text", "empty": "", "i": 200, "neg": -3, "big": 2**62, "f": 0.25,
                      "b": False, "t": True, "strings": ("a:b", "c"), "ints": [1, 2, 3],
                      "floats": [0.5], "bools": [True, False], "none_in": [None]},
                  events=[("retry", 1_500, {"epd.stage": "decode",
                                            "error.type": "upstream_timeout"}),
                          ("bare", 1_600, None)])
    child = record("decode", TRACE, 0x2222, 0x1111, kind=CLIENT, state="vendor=opaque,other=x",
                   attributes={"epd.instance.url": "http://127.0.0.1:1"}, status=ERROR,
                   message="went wrong")
    wait = record("admission", TRACE, 0x3333, 0x1111, state="vendor=opaque,other=x", start=10,
                  end=20)
    failed = record("relay", TRACE, 0x4444, 0x1111, state="vendor=opaque,other=x",
                    status=ERROR)
    alone = record("GET", 0x5555, 0x6666)  # a trace of its own, no parent
    return [child, wait, failed, root, alone]


def test_every_kind_of_span_decodes_to_the_sdks_message() -> None:
    records = every_kind()
    encoder = otlpwire.Encoder(RESOURCE, SCOPE, SpanLimits())
    expected = encode_spans(replayed(records))
    assert decoded(encoder.encode(records)) == expected
    # values that never repeat, written without the cache
    unique = otlpwire.Encoder(RESOURCE, SCOPE, SpanLimits(), frozenset({"s", "empty", "i"}))
    assert decoded(unique.encode(records)) == expected
    # ... and the SDK's own span the exporter gets when this encoder cannot encode a batch
    assert encode_spans([encoder.readable(r) for r in records]) == expected


def test_the_sdks_span_limits_apply_as_the_sdk_applies_them() -> None:
    """OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT and the others: the newest attributes and events
    kept, the rest counted as dropped, strings cut to the length limit."""
    records = every_kind()
    records[3].events = [*(records[3].events or ()), ("third", 1_700, {"a": "long", "b": 1})]
    limits = SpanLimits(max_span_attributes=3, max_events=2, max_event_attributes=1,
                        max_attribute_length=2, max_span_attribute_length=3)
    encoder = otlpwire.Encoder(RESOURCE, SCOPE, limits)
    expected = encode_spans(replayed(records, limits))
    assert decoded(encoder.encode(records)) == expected
    assert encode_spans([encoder.readable(r) for r in records]) == expected
    (root,) = (s for s in expected.resource_spans[0].scope_spans[0].spans if s.kind == 2)
    assert (root.dropped_attributes_count, root.dropped_events_count) == (10, 1)
    nothing = SpanLimits(max_span_attributes=0, max_events=0)
    assert decoded(otlpwire.Encoder(RESOURCE, SCOPE, nothing).encode(records)) \
        == encode_spans(replayed(records, nothing))


def test_a_request_traced_by_the_proxy_decodes_to_the_sdks_message() -> None:
    """The proxy's own spans, as otelspans makes them: a server span with its routing,
    usage and retry, two calls (one failed), the relay."""
    tracer = otelspans.Tracer(TraceSettings("http://127.0.0.1:9/v1/traces", 100, 512, 60.0),
                              lambda reason, count: None)
    queue = tracer.queue
    records: list[SpanRecord] = []
    adding = queue.add
    queue.add = lambda span: (records.append(span), adding(span))  # type: ignore[method-assign]
    try:
        trace = tracer.begin({}, "POST", "/v1/chat/completions", "req-1", "up-1")
        trace.decided("prefill", "round_robin", "chosen", "http://127.0.0.1:2")
        call = trace.call("prefill", "prefill", "http://127.0.0.1:2")
        call.end(None, ProxyError("prefill failed", status=502, code="upstream_error"))
        trace.retried("prefill", "upstream_error")
        trace.prefill_usage(7, 3)
        call = trace.call("decode", "prefill_decode", "http://127.0.0.1:3")
        call.first_byte()
        call.end(200, None)
        trace.relaying()
        trace.answer_usage(b'{"usage":{"prompt_tokens":7,"completion_tokens":16}}')
        trace.finish(SimpleNamespace(retries=1, chunks=4, status=200, model="m",
                                     tenant="t", error=None), None)
        assert len(records) == 4
        waiting = list(queue._queue)  # each span encoded as it ended
        assert all(type(span) is bytes for span in waiting)
        sdk = encode_spans(replayed(records))
        mine = decoded(queue._encoder.request(waiting))
        # the worker's resource and scope, not the test's
        assert mine.resource_spans[0].scope_spans[0].scope.name == "epd_flask"
        for message in (sdk, mine):
            message.resource_spans[0].ClearField("resource")
            message.resource_spans[0].ClearField("schema_url")
            message.resource_spans[0].scope_spans[0].ClearField("scope")
            message.resource_spans[0].scope_spans[0].ClearField("schema_url")
        assert mine == sdk
    finally:
        queue._queue.clear()
        tracer.stop()


def test_what_it_does_not_encode_is_left_to_the_sdk() -> None:
    """An integer outside int64 raises, and the span queue sends that batch through the
    SDK's own ``export``."""
    with pytest.raises(TypeError):
        otlpwire.Encoder(RESOURCE, SCOPE, SpanLimits()).encode(
            [record("huge", 1, 2, attributes={"n": 2**64})])
    with pytest.raises(TypeError):
        otlpwire._value(2**64)


def test_the_installed_exporter_posts_through_its_own_client() -> None:
    """The fast path is the one taken with the SDK this proxy installs: its exporter has the
    client that posts bytes (else every batch is encoded by the SDK, at three times the
    cost, and this test says so)."""
    assert otlpwire.poster(OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces")) \
        is not None
    assert otlpwire.poster(Kept()) is None


class Posting(Kept):
    """An exporter with a client that posts bytes, as the SDK's OTLP exporter has."""

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[bytes] = []
        self._client = SimpleNamespace(export=lambda data: self.posted.append(data)
                                       or SimpleNamespace(success=True))


def test_the_span_queue_posts_encoded_batches_and_leaves_the_rest_to_the_exporter() -> None:
    exporter = Posting()
    reports: list[tuple[str | None, int]] = []
    queue = SpanQueue(exporter, otlpwire.Encoder(RESOURCE, SCOPE, SpanLimits()), max_queue=10,
                      batch=10, delay=60.0,
                      report=lambda reason, count: reports.append((reason, count)))
    queue.add(record("first", 1, 2))
    assert queue.force_flush(5000)
    assert len(exporter.posted) == 1 and exporter.spans == []
    assert [s.name for s in decoded_bytes(exporter.posted[0])] == ["first"]
    queue.add(record("huge", 1, 3, attributes={"n": 2**64}))
    assert queue.force_flush(5000)
    assert len(exporter.posted) == 1 and [s.name for s in exporter.spans] == ["huge"]
    # in one batch, each goes its way
    queue.add(record("second", 1, 4))
    queue.add(record("huge again", 1, 5, attributes={"n": -2**64}))
    assert queue.force_flush(5000)
    assert [s.name for s in decoded_bytes(exporter.posted[1])] == ["second"]
    assert [s.name for s in exporter.spans] == ["huge", "huge again"]
    assert reports == [(None, 1), (None, 1), (None, 2)]
    # an exporter without the client that posts bytes gets every span through ``export``
    kept = Kept()
    plain = SpanQueue(kept, otlpwire.Encoder(RESOURCE, SCOPE, SpanLimits()), max_queue=10,
                      batch=10, delay=60.0, report=lambda reason, count: None)
    plain.add(record("third", 1, 6))
    assert plain.force_flush(5000)
    assert [s.name for s in kept.spans] == ["third"]


def decoded_bytes(data: bytes) -> list[Any]:
    request = ExportTraceServiceRequest.FromString(data)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
