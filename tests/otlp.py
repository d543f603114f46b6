"""An OTLP/HTTP trace receiver for the tests: what exporters post to ``/v1/traces``, decoded
from the real protobuf (``opentelemetry-proto``) into plain records, the way a collector
would read it. It can also misbehave as a collector does: answer slowly or not at all."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gevent.event import Event
from gevent.pywsgi import WSGIServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

PATH = "/v1/traces"
#: The longest a stalled receiver holds a post before answering anyway.
STALL_LIMIT = 60.0
KINDS = {Span.SPAN_KIND_INTERNAL: "internal", Span.SPAN_KIND_SERVER: "server",
         Span.SPAN_KIND_CLIENT: "client", Span.SPAN_KIND_PRODUCER: "producer",
         Span.SPAN_KIND_CONSUMER: "consumer", Span.SPAN_KIND_UNSPECIFIED: "unspecified"}


@dataclass
class Received:
    """One span as the collector saw it; ids in hex, the parent's empty for a root."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    error: bool
    status_message: str
    resource: dict[str, Any]
    scope: str

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def event(self, name: str) -> list[dict[str, Any]]:
        return [attrs for n, attrs in self.events if n == name]


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind) if kind else None


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in pairs}


@dataclass
class Receiver:
    """Started on a free loopback port (``url`` is its traces URL); ``spans`` in arrival
    order."""

    spans: list[Received] = field(default_factory=list)
    posts: int = 0
    content_types: set[str] = field(default_factory=set)
    _release: Event = field(default_factory=Event)
    _server: WSGIServer | None = None
    url: str = ""

    def start(self) -> Receiver:
        self._release.set()
        self._server = WSGIServer(("127.0.0.1", 0), self._app, log=None)
        self._server.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}{PATH}"
        return self

    def stop(self) -> None:
        self._release.set()
        if self._server is not None:
            self._server.stop(timeout=1)
            self._server = None

    def stall(self) -> None:
        """Take posts in, answer none (until ``release`` or ``STALL_LIMIT``)."""
        self._release.clear()

    def release(self) -> None:
        self._release.set()

    def clear(self) -> None:
        self.spans.clear()

    def trace(self, trace_id: str) -> list[Received]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def _app(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] != PATH or environ["REQUEST_METHOD"] != "POST":
            start_response("404 Not Found", [("Content-Length", "0")])
            return []
        body = environ["wsgi.input"].read()
        self.content_types.add(environ.get("CONTENT_TYPE", ""))
        encoding = environ.get("HTTP_CONTENT_ENCODING", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        self._release.wait(STALL_LIMIT)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.posts += 1
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    self.spans.append(Received(
                        sp.name, sp.trace_id.hex(), sp.span_id.hex(), sp.parent_span_id.hex(),
                        KINDS[sp.kind], sp.start_time_unix_nano, sp.end_time_unix_nano,
                        attributes(sp.attributes),
                        [(e.name, attributes(e.attributes)) for e in sp.events],
                        sp.status.code == Status.STATUS_CODE_ERROR, sp.status.message,
                        resource, ss.scope.name))
        answer = ExportTraceServiceResponse().SerializeToString()
        start_response("200 OK", [("Content-Type", "application/x-protobuf"),
                                  ("Content-Length", str(len(answer)))])
        return [answer]


def tree(spans: list[Received]) -> str:
    """The spans of one trace as an indented tree: name, kind, duration, and whose child
    (spans whose parent is not among them are roots)."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[Received]] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            service = s.resource.get("service.name", "?")
            lines.append(f"{'  ' * depth}{s.name} [{s.kind}, {service}] {s.ms:.2f} ms "
                         f"span={s.span_id} parent={s.parent_id or '-'}"
                         + (" ERROR" if s.error else ""))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
