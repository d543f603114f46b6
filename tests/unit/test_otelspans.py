"""Which traces the proxy records (docs/behaviour.md#tracing): the SDK's sampler, read from
OTEL_TRACES_SAMPLER(_ARG), asked once per trace with the client's parent; every span of the
trace follows its answer, and the headers of the calls carry it on."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from epd_flask.observe import otelspans
from epd_flask.observe.tracing import TraceSettings

CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture
def tracer() -> Iterator[otelspans.Tracer]:
    made = otelspans.Tracer(TraceSettings("http://127.0.0.1:9/v1/traces", 100, 512, 60.0),
                            lambda reason, count: None)
    yield made
    made.queue._queue.clear()
    made.stop()


def request(tracer: otelspans.Tracer, **headers: str) -> tuple[bool, list[str], list[str]]:
    """(recorded, the two calls' traceparents, the names of the spans queued)."""
    trace = tracer.begin(headers, "POST", "/v1/chat/completions", "r", "u")
    parents = []
    for stage in ("prefill", "decode"):
        call = trace.call(stage, stage, "http://127.0.0.1:2")
        parents.append(call.headers["traceparent"])
        call.end(200, None)
    trace.finish(SimpleNamespace(retries=0, chunks=0, status=200, model="m", tenant=None,
                                 error=None), None)
    queue = tracer.queue
    waiting = list(queue._queue)
    names = [span.name for span in ExportTraceServiceRequest.FromString(
        queue._encoder.request(waiting)).resource_spans[0].scope_spans[0].spans] \
        if waiting else []
    queue._queue.clear()
    return trace.recording, parents, names


def test_the_default_sampler_follows_the_clients_sampled_flag(tracer) -> None:
    recorded, parents, names = request(tracer, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert recorded and names == ["prefill", "decode", "POST /v1/chat/completions"]
    assert all(p.startswith(f"00-{CLIENT_TRACE}-") and p.endswith("-01") for p in parents)
    recorded, parents, names = request(tracer, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")
    assert not recorded and names == []
    assert all(p.startswith(f"00-{CLIENT_TRACE}-") and p.endswith("-00") for p in parents)
    assert parents[0] != parents[1]  # each call a span of its own, recorded or not


def test_a_new_trace_is_recorded_and_says_its_id_is_random(tracer) -> None:
    recorded, parents, names = request(tracer)
    assert recorded and len(names) == 3
    trace_ids = {p.split("-")[1] for p in parents}
    assert len(trace_ids) == 1 and CLIENT_TRACE not in trace_ids
    assert all(p.endswith("-03") for p in parents)  # sampled, and W3C's random-trace-id flag


@pytest.mark.parametrize(("sampler", "arg", "recorded"), [
    ("always_off", None, False),
    ("parentbased_traceidratio", "0", False),
    ("parentbased_traceidratio", "1", True),
    ("always_on", None, True),
])
def test_the_sampler_is_the_one_otel_traces_sampler_names(monkeypatch, sampler, arg,
                                                          recorded) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    made = otelspans.Tracer(TraceSettings("http://127.0.0.1:9/v1/traces", 100, 512, 60.0),
                            lambda reason, count: None)
    try:
        assert request(made)[0] is recorded
        # a client's unsampled parent: parent-based samplers follow it, the others do not
        followed = request(made, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")[0]
        assert followed is (sampler == "always_on")
    finally:
        made.queue._queue.clear()
        made.stop()
