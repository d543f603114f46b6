"""The proxy's own OTLP encoder (observe/otlpwire.py) against the SDK's: for the spans a
request makes, and for every kind of value, event, status and parent a span can carry, the
bytes decode to the very message the SDK's ``encode_spans`` builds (docs/behaviour.md#tracing).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epd_flask.core.errors import ProxyError
from epd_flask.observe import otelspans, otlpwire
from epd_flask.observe.spanqueue import SpanQueue
from epd_flask.observe.tracing import TraceSettings


class Kept(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def provider(kept: Kept, resource: Resource) -> TracerProvider:
    made = TracerProvider(resource=resource, shutdown_on_exit=False)
    made.add_span_processor(SimpleSpanProcessor(kept))
    return made


def decoded(spans: list[ReadableSpan]) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(otlpwire.encode(spans))


def test_every_kind_of_span_decodes_to_the_sdks_message() -> None:
    kept = Kept()
    tracer = provider(kept, Resource.create({"service.name": "s", "process.pid": 7},
                                            schema_url="https://schema/r")).get_tracer(
        "scope", "1.2", schema_url="https://schema/s", attributes={"scope.flag": True})
    remote = TraceContextTextMapPropagator().extract({
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=opaque,other=x"})
    root = tracer.start_span("POST /v1/chat/completions", context=remote,
                             kind=SpanKind.SERVER, attributes={
                                 "s": "text", "empty": "", "i": 200, "neg": -3,
                                 "big": 2**62, "f": 0.25, "b": False, "t": True,
                                 "strings": ("a:b", "c"), "ints": [1, 2, 3],
                                 "floats": [0.5], "bools": [True, False], "none_in": [None]})
    root.add_event("retry", {"epd.stage": "decode", "error.type": "upstream_timeout"})
    root.add_event("bare")
    parent = set_span_in_context(root)
    child = tracer.start_span("decode", context=parent, kind=SpanKind.CLIENT,
                              attributes={"epd.instance.url": "http://127.0.0.1:1"})
    child.set_status(Status(StatusCode.ERROR, "went wrong"))
    child.end()
    tracer.start_span("admission", context=parent, start_time=10, attributes=None
                      ).end(end_time=20)
    ok = tracer.start_span("relay", context=parent)
    ok.set_status(Status(StatusCode.OK))
    ok.end()
    root.end()
    tracer.start_span("GET", kind=SpanKind.PRODUCER).end()  # a trace of its own, no parent
    assert len(kept.spans) == 5
    assert decoded(kept.spans) == encode_spans(kept.spans)


def test_spans_of_two_resources_and_scopes_are_grouped_as_the_sdk_groups_them() -> None:
    kept = Kept()
    one = provider(kept, Resource.create({"service.name": "one"}))
    two = provider(kept, Resource.create({"service.name": "two"}))
    for made, scope in ((one, "a"), (two, "a"), (one, "b"), (one, "a")):
        made.get_tracer(scope).start_span(f"{scope} span").end()
    assert decoded(kept.spans) == encode_spans(kept.spans)


def test_a_request_traced_by_the_proxy_decodes_to_the_sdks_message() -> None:
    """The proxy's own spans, as otelspans makes them: a server span with its routing,
    usage and retry, two calls (one failed), the relay."""
    tracer = otelspans.Tracer(TraceSettings("http://127.0.0.1:9/v1/traces", 100, 512, 60.0),
                              lambda reason, count: None)
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
        spans = list(tracer.queue._queue)
        assert len(spans) == 4
        assert decoded(spans) == encode_spans(spans)
    finally:
        tracer.stop()


def test_what_it_does_not_encode_is_left_to_the_sdk() -> None:
    """Links (the proxy makes none) and integers outside int64 raise, and the span queue
    sends that batch through the SDK's own ``export``."""
    kept = Kept()
    tracer = provider(kept, Resource.create({})).get_tracer("x")
    first = tracer.start_span("first")
    first.end()
    tracer.start_span("linked", links=[Link(first.get_span_context())]).end()
    with pytest.raises(TypeError):
        otlpwire.encode(kept.spans)
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
    queue = SpanQueue(exporter, max_queue=10, batch=10, delay=60.0,
                      report=lambda reason, count: reports.append((reason, count)))
    made = TracerProvider(resource=Resource.create({}), shutdown_on_exit=False)
    made.add_span_processor(queue)
    tracer = made.get_tracer("x")
    first = tracer.start_span("first")
    first.end()
    assert queue.force_flush(5000)
    assert len(exporter.posted) == 1 and exporter.spans == []
    assert [s.name for s in decoded_bytes(exporter.posted[0])] == ["first"]
    tracer.start_span("linked", links=[Link(first.get_span_context())]).end()
    assert queue.force_flush(5000)
    assert len(exporter.posted) == 1 and [s.name for s in exporter.spans] == ["linked"]
    assert reports == [(None, 1), (None, 1)]


def decoded_bytes(data: bytes) -> list[Any]:
    request = ExportTraceServiceRequest.FromString(data)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
