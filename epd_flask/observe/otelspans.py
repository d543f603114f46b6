"""A request's spans, made with the OpenTelemetry SDK (docs/behaviour.md#tracing).

Imported by ``tracing.Tracing.start`` in a worker, never at import time of the app. The names
of spans, events and attributes below are a contract with the operators' dashboards and
queries (the README's "Tracing" section lists them); the GenAI and HTTP semantic conventions'
names are used where one fits, ``epd.*`` for the proxy's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode, format_trace_id
from opentelemetry.trace import Tracer as SDKTracer
from opentelemetry.trace.propagation import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epd_flask import __version__
from epd_flask.core.errors import ProxyError, instance_label
from epd_flask.core.tracing import CallTrace
from epd_flask.observe.spanqueue import SpanQueue
from epd_flask.observe.tracing import TraceSettings
from epd_flask.serving import usage
from epd_flask.serving.context import RequestContext

#: The service the spans come from, unless OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES)
#: names another.
SERVICE_NAME = "epd-flask"
#: The instrumentation scope of every span.
SCOPE = "epd_flask"

# Span names: the server span is "<method> <route>" for the proxy's own routes ("<method>"
# for a pass-through, whose path has no bound), each upstream call is named after its stage.
ENCODE, PREFILL, DECODE, TOKENIZE = "encode", "prefill", "decode", "tokenize"
RELAY = "relay"
ADMISSION = "admission"
# Events.
RETRY_EVENT, FIRST_BYTE_EVENT = "retry", "first_byte"
#: Routes whose path is a span name's route: the others are whatever a client sent.
NAMED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

# Attributes: the semantic conventions' where one fits.
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
ERROR_TYPE = "error.type"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_MODEL = "gen_ai.request.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
# ... and the proxy's own.
REQUEST_ID = "epd.request_id"
UPSTREAM_ID = "epd.upstream_id"
RETRIES = "epd.retries"
TENANT = "epd.tenant"
CHUNKS = "epd.chunks"
ROLE = "epd.role"
STAGE = "epd.stage"
#: Every routing decision, in order: "<role>:<policy>:<outcome>:<instance label>".
ROUTING = "epd.routing"
INSTANCE_URL = "epd.instance.url"
INSTANCE_LABEL = "epd.instance.label"

PROPAGATOR = TraceContextTextMapPropagator()


@lru_cache(maxsize=1024)
def _label(url: str) -> str:
    return instance_label(url)


class _Resource(Resource):
    """The SDK's resource, its hash computed once: the exporter groups every span it encodes
    by resource, and the SDK's hash is a JSON dump of the attributes (3 us a span here).
    A resource never changes once made."""

    _hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = super().__hash__()
        return self._hash

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other)


class Tracer:
    """One worker's tracer provider, span queue and exporter."""

    def __init__(self, settings: TraceSettings,
                 report: Callable[[str | None, int], None]) -> None:
        """``report`` hears what became of finished spans: (None, exported) or (reason,
        lost)."""
        # The service's name and version, and which worker; OTEL_SERVICE_NAME and
        # OTEL_RESOURCE_ATTRIBUTES override them. The sampler is OTEL_TRACES_SAMPLER's.
        merged = Resource.create({"service.name": SERVICE_NAME, "service.version": __version__,
                                  "process.pid": os.getpid()}
                                 ).merge(OTELResourceDetector().detect())
        resource = _Resource(merged.attributes, merged.schema_url)
        self.queue = SpanQueue(OTLPSpanExporter(endpoint=settings.url),
                               max_queue=settings.max_queue, batch=settings.batch,
                               delay=settings.delay, report=report)
        # The queue is the provider's one processor, not one of a list behind the SDK's
        # multi-processor: that wrapper's loops cost 2.4 of a span's 12 us here.
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False,
                                       active_span_processor=self.queue)  # type: ignore[arg-type]
        self.tracer = self.provider.get_tracer(SCOPE, __version__)

    def start(self) -> None:
        self.queue.start()

    def flush(self, timeout: float) -> bool:
        return self.queue.force_flush(int(timeout * 1000))

    def stop(self) -> None:
        self.provider.shutdown()

    def begin(self, headers: Mapping[str, str], method: str, path: str, request_id: str,
              upstream_id: str) -> SpanTrace:
        parent = PROPAGATOR.extract(headers)
        named = path in NAMED_ROUTES
        attributes: dict[str, Any] = {HTTP_METHOD: method, HTTP_ROUTE if named else URL_PATH: path,
                                      REQUEST_ID: request_id, UPSTREAM_ID: upstream_id}
        operation = OPERATIONS.get(path)
        if operation is not None:
            attributes[GEN_AI_OPERATION] = operation
        root = self.tracer.start_span(f"{method} {path}" if named else method, context=parent,
                                      kind=SpanKind.SERVER, attributes=attributes)
        return SpanTrace(self.tracer, root)


class CallSpan:
    """One upstream call's span (``core.tracing.CallTrace``)."""

    __slots__ = ("_recording", "_span", "headers")

    def __init__(self, span: Span, recording: bool) -> None:
        self._span = span
        self._recording = recording
        self.headers = trace_headers(span.get_span_context())

    def first_byte(self) -> None:
        if self._recording:
            self._span.add_event(FIRST_BYTE_EVENT)

    def end(self, status: int | None, error: ProxyError | None) -> None:
        span = self._span
        if self._recording:
            if status is not None:
                span.set_attribute(HTTP_STATUS, status)
            if error is not None:
                span.set_attribute(ERROR_TYPE, error.code)
                span.set_status(Status(StatusCode.ERROR, error.message))
            elif status is not None and status >= 400:
                span.set_attribute(ERROR_TYPE, str(status))
                span.set_status(Status(StatusCode.ERROR))
        span.end()


class SpanTrace:
    """One request's trace (``core.tracing.RequestTrace``): its server span, a child per
    upstream call, the relay's span, and what they learnt of the answer's usage."""

    __slots__ = (
        "_cached_tokens",
        "_input_tokens",
        "_output_tokens",
        "_parent",
        "_relay",
        "_root",
        "_routing",
        "_tracer",
        "recording",
        "trace_id",
    )

    def __init__(self, tracer: SDKTracer, root: Span) -> None:
        self._tracer = tracer
        self._root = root
        self._parent: Context = set_span_in_context(root)
        self.trace_id = format_trace_id(root.get_span_context().trace_id)
        self.recording = root.is_recording()
        self._relay: Span | None = None
        self._input_tokens: int | None = None
        self._output_tokens: int | None = None
        self._cached_tokens: int | None = None
        self._routing: list[str] = []

    def call(self, stage: str, role: str, url: str) -> CallTrace:
        attributes: dict[str, Any] | None = None
        if self.recording:
            attributes = {INSTANCE_URL: url, INSTANCE_LABEL: _label(url)}
            if role != stage:  # a prefill_decode instance's decode call
                attributes[ROLE] = role
        span = self._tracer.start_span(stage, context=self._parent, kind=SpanKind.CLIENT,
                                       attributes=attributes)
        return CallSpan(span, self.recording)

    def decided(self, role: str, policy: str, outcome: str, url: str) -> None:
        # An attribute, not an event per decision: a third of the cost of each.
        if self.recording:
            self._routing.append(f"{role}:{policy}:{outcome}:{_label(url)}")

    def retried(self, stage: str, code: str) -> None:
        if self.recording:
            self._root.add_event(RETRY_EVENT, {STAGE: stage, ERROR_TYPE: code})

    def waited(self, name: str, started_ns: int, ended_ns: int) -> None:
        span = self._tracer.start_span(name, context=self._parent, start_time=started_ns)
        span.end(end_time=ended_ns)

    def relaying(self) -> None:
        if self._relay is None:
            self._relay = self._tracer.start_span(RELAY, context=self._parent)

    def answer_usage(self, data: bytes) -> None:
        if not self.recording:
            return
        found = usage.last_usage(data)
        if found is None:
            return
        prompt, completion, cached = found
        if prompt is not None:
            self._input_tokens = prompt
        if completion is not None:
            self._output_tokens = completion
        if cached is not None and self._cached_tokens is None:
            self._cached_tokens = cached

    def prefill_usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        if self._input_tokens is None:
            self._input_tokens = prompt_tokens
        # Prefill's cache is the one that served the prompt (docs/behaviour.md#prefill-and-decode).
        self._cached_tokens = cached_tokens

    def finish(self, ctx: RequestContext, failure: ProxyError | None) -> None:
        root = self._root
        error_type, message, failed = _outcome(ctx, failure)
        relay = self._relay
        if relay is not None:
            if self.recording and error_type is not None:
                relay.set_attribute(ERROR_TYPE, error_type)
                if failed:
                    relay.set_status(Status(StatusCode.ERROR, message))
            relay.end()
        if self.recording:
            # What is worth its cost: every attribute is encoded for every request.
            attributes: dict[str, Any] = {}
            if self._routing:
                attributes[ROUTING] = self._routing
            if ctx.retries:
                attributes[RETRIES] = ctx.retries
            if ctx.chunks:
                attributes[CHUNKS] = ctx.chunks
            if ctx.status is not None:
                attributes[HTTP_STATUS] = ctx.status
            if ctx.model is not None:
                attributes[GEN_AI_MODEL] = ctx.model
            if ctx.tenant is not None:
                attributes[TENANT] = ctx.tenant
            if self._input_tokens is not None:
                attributes[INPUT_TOKENS] = self._input_tokens
            if self._output_tokens is not None:
                attributes[OUTPUT_TOKENS] = self._output_tokens
            if self._cached_tokens is not None:
                attributes[CACHED_TOKENS] = self._cached_tokens
            if error_type is not None:
                attributes[ERROR_TYPE] = error_type
            root.set_attributes(attributes)
            if failed:
                root.set_status(Status(StatusCode.ERROR, message))
        root.end()


def trace_headers(context: SpanContext) -> dict[str, str]:
    """The W3C trace-context headers naming the span of ``context`` (what the SDK's
    propagator writes, without its detour through a context object per call)."""
    headers = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                              f"{context.trace_flags:02x}"}
    if context.trace_state:
        headers["tracestate"] = context.trace_state.to_header()
    return headers


def _outcome(ctx: RequestContext, failure: ProxyError | None,
             ) -> tuple[str | None, str | None, bool]:
    """(error.type, message, whether the span failed) of a finished request: the error code
    the client got, else its status when that says it failed. A server span fails for a 5xx,
    the status of an in-band error included; a 4xx is the client's (the semantic conventions'
    rule), a client that left mid-stream too (499), its code still recorded."""
    status = ctx.status
    if failure is not None:
        return failure.code, failure.message, failure.status >= 500
    if status is not None and status >= 400:
        return str(status), ctx.error, status >= 500
    return None, None, False
