"""A request's spans, as the proxy's own records, under the OpenTelemetry SDK's sampler and
resource (docs/behaviour.md#tracing).

Imported by ``tracing.Tracing.start`` in a worker, never at import time of the app. The SDK
decides what it is good at: the sampler (``OTEL_TRACES_SAMPLER``, asked once per trace, at its
root, with the client's parent), the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``), the span limits, the W3C propagator reading a client's
``traceparent``, and the exporter's client and its settings. The spans themselves are
``spanrecord.SpanRecord``: a request writes three to five, and the SDK's span objects were
most of what tracing cost it. The names of spans, events and attributes below are a contract
with the operators' dashboards and queries (the README's "Tracing" section lists them); the
GenAI and HTTP semantic conventions' names are used where one fits, ``epd.*`` for the
proxy's own.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, TraceFlags, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epd_flask import __version__
from epd_flask.core.errors import ProxyError, instance_label
from epd_flask.core.tracing import CallTrace
from epd_flask.observe import otlpwire
from epd_flask.observe.spanqueue import SpanQueue
from epd_flask.observe.spanrecord import CLIENT, ERROR, INTERNAL, SERVER, SpanRecord
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

_now = time.time_ns
_bits = random.getrandbits  # the SDK's RandomIdGenerator's source (reseeded after a fork)
_SAMPLED, _RANDOM = TraceFlags.SAMPLED, TraceFlags.RANDOM_TRACE_ID


def _span_id() -> int:
    while True:
        made = _bits(64)
        if made:  # 0 is the invalid id
            return made


def _trace_id() -> int:
    while True:
        made = _bits(128)
        if made:
            return made


@lru_cache(maxsize=1024)
def _label(url: str) -> str:
    return instance_label(url)


class Tracer:
    """One worker's sampler, resource, span queue and exporter."""

    def __init__(self, settings: TraceSettings,
                 report: Callable[[str | None, int], None]) -> None:
        """``report`` hears what became of finished spans: (None, exported) or (reason,
        lost)."""
        # The service's name and version, and which worker; OTEL_SERVICE_NAME and
        # OTEL_RESOURCE_ATTRIBUTES override them.
        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": __version__,
                                    "process.pid": os.getpid()}
                                   ).merge(OTELResourceDetector().detect())
        # OTEL_TRACES_SAMPLER(_ARG), as the SDK's provider reads them.
        self.sampler = TracerProvider(resource=resource, shutdown_on_exit=False).sampler
        encoder = otlpwire.Encoder(resource, InstrumentationScope(SCOPE, __version__),
                                   SpanLimits(), unique=frozenset({REQUEST_ID, UPSTREAM_ID}))
        self.queue = SpanQueue(OTLPSpanExporter(endpoint=settings.url), encoder,
                               max_queue=settings.max_queue, batch=settings.batch,
                               delay=settings.delay, report=report)

    def start(self) -> None:
        self.queue.start()

    def flush(self, timeout: float) -> bool:
        return self.queue.force_flush(int(timeout * 1000))

    def stop(self) -> None:
        self.queue.shutdown()

    def begin(self, headers: Mapping[str, str], method: str, path: str, request_id: str,
              upstream_id: str) -> SpanTrace:
        """The client's trace continued (its ``traceparent``, if valid, is the server span's
        remote parent), else a new one; the sampler's answer holds for every span of it."""
        context = PROPAGATOR.extract(headers)
        parent = get_current_span(context).get_span_context()
        named = path in NAMED_ROUTES
        name = f"{method} {path}" if named else method
        attributes: dict[str, Any] = {HTTP_METHOD: method, HTTP_ROUTE if named else URL_PATH: path,
                                      REQUEST_ID: request_id, UPSTREAM_ID: upstream_id}
        operation = OPERATIONS.get(path)
        if operation is not None:
            attributes[GEN_AI_OPERATION] = operation
        if parent.is_valid:
            trace_id, parent_id = parent.trace_id, parent.span_id
            flags = parent.trace_flags & _RANDOM
        else:
            trace_id, parent_id, flags = _trace_id(), 0, _RANDOM
        result = self.sampler.should_sample(context, trace_id, name, SpanKind.SERVER,
                                            attributes, ())
        state = result.trace_state.to_header() if result.trace_state else ""
        span_id = _span_id()
        root = None
        if result.decision.is_sampled():
            flags |= _SAMPLED
            extra = result.attributes
            if extra.keys() - attributes.keys():  # a sampler's own (the SDK's add none)
                attributes.update(extra)
            root = SpanRecord(trace_id, span_id, parent_id, parent_id != 0, state, name,
                              SERVER, _now(), attributes)
        return SpanTrace(self.queue, trace_id, flags, state, span_id, root)


class CallSpan:
    """One upstream call's span (``core.tracing.CallTrace``); an unsampled call has no
    record, only its headers."""

    __slots__ = ("_queue", "_record", "headers")

    def __init__(self, queue: SpanQueue, record: SpanRecord | None,
                 headers: dict[str, str]) -> None:
        self._queue = queue
        self._record = record
        self.headers = headers

    def first_byte(self) -> None:
        record = self._record
        if record is not None:
            event = (FIRST_BYTE_EVENT, _now(), None)
            if record.events is None:
                record.events = [event]
            else:
                record.events.append(event)

    def end(self, status: int | None, error: ProxyError | None) -> None:
        record, self._record = self._record, None  # a span ends once
        if record is None:
            return
        attributes = record.attributes
        assert attributes is not None
        if status is not None:
            attributes[HTTP_STATUS] = status
        if error is not None:
            attributes[ERROR_TYPE] = error.code
            record.status, record.message = ERROR, error.message
        elif status is not None and status >= 400:
            attributes[ERROR_TYPE] = str(status)
            record.status = ERROR
        record.end_ns = _now()
        self._queue.add(record)


class SpanTrace:
    """One request's trace (``core.tracing.RequestTrace``): its server span, a child per
    upstream call, the relay's span, and what they learnt of the answer's usage. Unsampled,
    it records nothing, and its calls still name spans of their own in their headers."""

    __slots__ = (
        "_cached_tokens",
        "_input_tokens",
        "_output_tokens",
        "_prefix",
        "_queue",
        "_relay",
        "_root",
        "_routing",
        "_span_id",
        "_state",
        "_suffix",
        "_trace",
        "recording",
        "trace_id",
    )

    def __init__(self, queue: SpanQueue, trace: int, flags: int, state: str, span_id: int,
                 root: SpanRecord | None) -> None:
        self._queue = queue
        self._trace = trace
        self._state = state
        self._span_id = span_id
        self._root = root
        self.trace_id = f"{trace:032x}"
        self.recording = root is not None
        self._prefix = f"00-{self.trace_id}-"
        self._suffix = f"-{flags:02x}"
        self._relay: SpanRecord | None = None
        self._input_tokens: int | None = None
        self._output_tokens: int | None = None
        self._cached_tokens: int | None = None
        self._routing: list[str] = []

    def _child(self, name: str, kind: int, start_ns: int, attributes: dict[str, Any] | None,
               span_id: int | None = None) -> SpanRecord:
        return SpanRecord(self._trace, _span_id() if span_id is None else span_id,
                          self._span_id, False, self._state, name, kind, start_ns, attributes)

    def call(self, stage: str, role: str, url: str) -> CallTrace:
        span_id = _span_id()
        headers = {"traceparent": f"{self._prefix}{span_id:016x}{self._suffix}"}
        if self._state:
            headers["tracestate"] = self._state
        record = None
        if self.recording:
            attributes: dict[str, Any] = {INSTANCE_URL: url, INSTANCE_LABEL: _label(url)}
            if role != stage:  # a prefill_decode instance's decode call
                attributes[ROLE] = role
            record = self._child(stage, CLIENT, _now(), attributes, span_id)
        return CallSpan(self._queue, record, headers)

    def decided(self, role: str, policy: str, outcome: str, url: str) -> None:
        # An attribute, not an event per decision: a third of the cost of each.
        if self.recording:
            self._routing.append(f"{role}:{policy}:{outcome}:{_label(url)}")

    def retried(self, stage: str, code: str) -> None:
        root = self._root
        if root is not None:
            event = (RETRY_EVENT, _now(), {STAGE: stage, ERROR_TYPE: code})
            if root.events is None:
                root.events = [event]
            else:
                root.events.append(event)

    def waited(self, name: str, started_ns: int, ended_ns: int) -> None:
        if self.recording:
            record = self._child(name, INTERNAL, started_ns, None)
            record.end_ns = ended_ns
            self._queue.add(record)

    def relaying(self) -> None:
        if self.recording and self._relay is None:
            self._relay = self._child(RELAY, INTERNAL, _now(), None)

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
        root, self._root = self._root, None  # a span ends once
        if root is None:
            return
        error_type, message, failed = _outcome(ctx, failure)
        relay, self._relay = self._relay, None
        queue = self._queue
        if relay is not None:
            if error_type is not None:
                relay.attributes = {ERROR_TYPE: error_type}
                if failed:
                    relay.status, relay.message = ERROR, message
            relay.end_ns = _now()
            queue.add(relay)
        # What is worth its cost: every attribute is encoded for every request.
        attributes = root.attributes
        assert attributes is not None
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
        if failed:
            root.status, root.message = ERROR, message
        root.end_ns = _now()
        queue.add(root)


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
