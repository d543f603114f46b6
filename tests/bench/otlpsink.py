"""The collector of ``run.py --tracing``: an OTLP/HTTP receiver in its own process (its CPU is
not the proxy's), which decodes every post as a collector would and counts the spans.

    python tests/bench/otlpsink.py PORT

``POST /v1/traces`` takes an ``ExportTraceServiceRequest``; ``GET /count`` answers the spans
and posts received so far as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from gevent.pywsgi import WSGIServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ANSWER = ExportTraceServiceResponse().SerializeToString()
counts = {"spans": 0, "posts": 0}


def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    if environ["PATH_INFO"] == "/count":
        body = json.dumps(counts).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]
    request = ExportTraceServiceRequest()
    request.ParseFromString(environ["wsgi.input"].read())
    counts["posts"] += 1
    counts["spans"] += sum(len(ss.spans) for rs in request.resource_spans
                           for ss in rs.scope_spans)
    start_response("200 OK", [("Content-Type", "application/x-protobuf")])
    return [ANSWER]


if __name__ == "__main__":
    WSGIServer(("127.0.0.1", int(sys.argv[1])), app, log=None).serve_forever()
