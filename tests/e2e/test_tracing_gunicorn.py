"""Tracing under real gunicorn (docs/behaviour.md#tracing): each worker starts its own exporter
after the fork, so spans arrive from every worker and none from the master."""

from __future__ import annotations

import pytest
import requests

from tests.bodies import chat
from tests.helpers import eventually
from tests.otlp import Receiver
from tests.rosters import roster

pytestmark = pytest.mark.e2e

#: Requests sent at most while waiting for both workers' spans.
MAX_REQUESTS = 200


def test_two_workers_each_export_their_own_spans(procs) -> None:
    collector = Receiver().start()
    try:
        p, d = procs["sim"]("prefill"), procs["sim"]("decode")
        base = collector.url.removesuffix("/v1/traces")
        gw = procs["gunicorn"](roster([p], [d]), workers=2, env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_SERVICE_NAME": "epd-e2e",
            "OTEL_BSP_SCHEDULE_DELAY": "50"})
        workers = eventually(lambda: gw.workers() if len(gw.workers()) == 2 else None,
                             what="two workers")
        sent = 0

        def both_exported() -> bool:
            nonlocal sent
            assert sent < MAX_REQUESTS, f"{sent} requests, spans from {exporters()} only"
            sent += 1
            # a connection per request: gunicorn hands each to whichever worker accepts
            r = requests.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=2),
                              headers={"Connection": "close"}, timeout=10)
            assert r.status_code == 200, r.text
            return exporters() == workers

        def exporters() -> set[int]:
            return {s.resource["process.pid"] for s in collector.spans}

        eventually(both_exported, 60, interval=0.05, what=lambda: f"spans from {workers}")
        assert gw.proc.pid not in exporters()
        assert {s.resource["service.name"] for s in collector.spans} == {"epd-e2e"}
        assert collector.content_types == {"application/x-protobuf"}
        servers = [s for s in collector.spans if s.kind == "server"]
        assert servers and all(s.attributes["http.response.status_code"] == 200
                               for s in servers)
    finally:
        collector.stop()
