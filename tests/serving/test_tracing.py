"""Tracing (docs/behaviour.md#tracing) through real HTTP: the spans a collector receives (the
real OTLP protobuf, decoded by tests/otlp.py), and the trace-context headers the simulated
instances see."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
import requests

from epd_flask.core.errors import instance_label
from epd_flask.serving.context import RequestContext
from tests.bodies import chat, chat_stream, image, multimodal
from tests.helpers import RawStream, eventually, sample, scrape
from tests.otlp import Received, Receiver, tree
from tests.rosters import roster

SCHEDULE_MS = 20


@pytest.fixture(scope="module")
def collector() -> Iterator[Receiver]:
    receiver = Receiver().start()
    yield receiver
    receiver.stop()


def traced(proxy: Any, doc: dict[str, Any], url: str, **config: Any) -> Any:
    """A proxy tracing to ``url``, started as a server starts it."""
    return proxy(doc, probes=True, otel_exporter_otlp_traces_endpoint=url,
                 otel_bsp_schedule_delay=SCHEDULE_MS, **config)


def post(px: Any, body: dict[str, Any], **headers: str) -> requests.Response:
    rid = headers.pop("rid", None) or secrets.token_hex(8)
    resp = requests.post(px.url + "/v1/chat/completions", json=body, timeout=20,
                         headers={"X-Request-Id": rid, **headers})
    resp.content  # noqa: B018  (the whole answer: the request has ended)
    resp.rid = rid  # type: ignore[attr-defined]
    return resp


def spans_of(collector: Receiver, rid: str) -> tuple[Received, list[Received]]:
    """The server span of the request the client called ``rid``, and every span of its trace
    (the server span ends last, so its arrival means the others arrived)."""
    root = eventually(lambda: next((s for s in collector.spans if s.kind == "server"
                                    and s.attributes.get("epd.request_id") == rid), None),
                      what=f"the server span of {rid}")
    return root, collector.trace(root.trace_id)


def named(spans: list[Received], name: str) -> list[Received]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


def completions(server: Any) -> list[dict[str, Any]]:
    return [r for r in server.state.requests() if r["path"] == "/v1/chat/completions"]


def parent_and_flags(traceparent: str) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id, bool(int(flags, 16) & 1)


def names(seen: dict[str, Any], span: Received) -> bool:
    """Whether the call an instance saw carried ``span`` as its sampled parent."""
    return parent_and_flags(seen["headers"]["traceparent"]) == (span.trace_id, span.span_id,
                                                                True)


def test_a_streamed_pd_request_continues_the_clients_trace(sim, proxy, collector,
                                                          caplog) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.01)
    px = traced(proxy, roster([p], [d]), collector.url)
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    before = scrape(px.url)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        r = post(px, chat_stream(max_tokens=5, stream_options={"include_usage": True}),
                 traceparent=f"00-{client_trace}-{client_span}-01", tracestate="vendor=abc")
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    root, spans = spans_of(collector, r.rid)

    assert (root.name, root.trace_id, root.parent_id) == (
        "POST /v1/chat/completions", client_trace, client_span)
    assert root.resource["service.name"] == "epd-flask"
    assert root.resource["process.pid"] == os.getpid()
    attrs = root.attributes
    assert attrs["http.response.status_code"] == 200 and not root.error
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "tiny-llama"
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert "epd.retries" not in attrs and attrs["epd.chunks"] >= 5
    assert attrs["epd.routing"] == [f"decode:round_robin:rotation:{instance_label(d.url)}",
                                    f"prefill:round_robin:rotation:{instance_label(p.url)}"]

    assert sorted(s.name for s in spans) == ["POST /v1/chat/completions", "decode", "prefill",
                                             "relay"]
    assert {s.parent_id for s in spans if s is not root} == {root.span_id}
    (prefill,), (decode,), (relay,) = (named(spans, n) for n in ("prefill", "decode", "relay"))
    assert (prefill.kind, decode.kind, relay.kind) == ("client", "client", "internal")
    assert prefill.attributes["epd.instance.url"] == p.url
    assert decode.attributes["epd.instance.url"] == d.url
    assert decode.attributes["http.response.status_code"] == 200
    # prefill, then decode: its first byte before the relay starts; the relay ends the request
    assert prefill.end_ns <= decode.start_ns
    assert len(decode.events) == 1 and decode.events[0][0] == "first_byte"
    assert decode.start_ns <= relay.start_ns <= relay.end_ns <= root.end_ns

    # Each instance was handed its own call's span, in the client's trace, with its state.
    for server, span in ((p, prefill), (d, decode)):
        (seen,) = completions(server)
        assert seen["headers"]["traceparent"] == f"00-{client_trace}-{span.span_id}-01"
        assert seen["headers"]["tracestate"] == "vendor=abc"
    line = next(m.getMessage() for m in caplog.records if f"request_id={r.rid} "
                in m.getMessage())
    assert f" trace_id={client_trace} " in line
    after = scrape(px.url)
    assert sample(after, "epd_tracing_spans_exported_total") \
        >= sample(before, "epd_tracing_spans_exported_total") + 4


def test_an_epd_request_has_a_span_per_encoder_call(sim, proxy, collector) -> None:
    e0, e1 = sim("encode", ttft=0.02), sim("encode", ttft=0.02)
    p, d = sim("prefill"), sim("decode")
    px = traced(proxy, roster([p], [d], encoders=[e0, e1]), collector.url)
    r = post(px, multimodal(image(), image(), max_tokens=3))
    assert r.status_code == 200, r.text
    root, spans = spans_of(collector, r.rid)
    print(f"\nE+P+D trace {root.trace_id}:\n{tree(spans)}")

    encodes = named(spans, "encode")
    assert len(encodes) == 2 and {s.attributes["epd.instance.url"] for s in encodes} == {
        e0.url, e1.url}
    (prefill,), (decode,) = named(spans, "prefill"), named(spans, "decode")
    assert not named(spans, "relay")  # a whole JSON answer: nothing relayed after it
    assert {s.parent_id for s in spans if s is not root} == {root.span_id}
    assert max(s.end_ns for s in encodes) <= prefill.start_ns <= prefill.end_ns \
        <= decode.start_ns <= decode.end_ns <= root.end_ns
    assert [r.split(":")[0] for r in root.attributes["epd.routing"]] == [
        "decode", "prefill", "encode", "encode"]
    for server in (e0, e1):
        (seen,) = completions(server)
        (span,) = (s for s in encodes if s.attributes["epd.instance.url"] == server.url)
        assert names(seen, span)


def test_a_retried_request_shows_the_failed_attempt(sim, proxy, collector) -> None:
    p, d0, d1 = sim("prefill"), sim("decode"), sim("decode")
    d0.state.inject(fail_next=1, fail_status=500)
    px = traced(proxy, roster([p], [d0, d1], decode_retries=1), collector.url)
    r = post(px, chat(max_tokens=3))
    assert r.status_code == 200, r.text
    root, spans = spans_of(collector, r.rid)

    assert root.attributes["epd.retries"] == 1 and not root.error
    decodes = named(spans, "decode")
    assert len(named(spans, "prefill")) == 2 and len(decodes) == 2
    failed, served = decodes
    assert failed.attributes["epd.instance.url"] == d0.url and failed.error
    assert failed.attributes["http.response.status_code"] == 500
    assert served.attributes["epd.instance.url"] == d1.url and not served.error
    (retry,) = root.event("retry")
    assert retry == {"epd.stage": "decode", "error.type": failed.attributes["error.type"]}


def test_a_failed_request_records_the_code_the_client_got(sim, proxy, collector) -> None:
    p, d = sim("prefill"), sim("decode")
    d.stop()
    px = traced(proxy, roster([p], [d], decode_retries=0, fail_threshold=100), collector.url)
    r = post(px, chat(max_tokens=3))
    assert r.status_code >= 500
    code = r.json()["error"]["code"]
    root, spans = spans_of(collector, r.rid)
    assert root.error and root.attributes["error.type"] == code == "upstream_unavailable"
    assert root.attributes["http.response.status_code"] == r.status_code
    (decode,) = named(spans, "decode")
    assert decode.error and decode.attributes["error.type"] == code
    assert "http.response.status_code" not in decode.attributes  # it never answered

    # A client's mistake is its own: recorded, yet the server span has not failed.
    rid = secrets.token_hex(8)
    r = requests.post(px.url + "/v1/chat/completions", data="hello", timeout=20,
                      headers={"X-Request-Id": rid, "Content-Type": "text/plain"})
    assert r.status_code == 415
    root, spans = spans_of(collector, rid)
    assert root.attributes["error.type"] == r.json()["error"]["code"] and not root.error
    assert [s.name for s in spans] == ["POST /v1/chat/completions"]


def test_unsampled_requests_export_nothing_yet_name_their_calls(sim, proxy, collector,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    p, d = sim("prefill"), sim("decode")
    px = traced(proxy, roster([p], [d]), collector.url)
    client_trace = secrets.token_hex(16)
    r = post(px, chat(max_tokens=2), traceparent=f"00-{client_trace}-{secrets.token_hex(8)}-01")
    assert r.status_code == 200
    r = post(px, chat(max_tokens=2))
    assert r.status_code == 200
    assert px.services.tracing.flush(5)
    assert not collector.trace(client_trace)
    (prefill_1, prefill_2), (decode_1, decode_2) = completions(p), completions(d)
    kept = [parent_and_flags(c["headers"]["traceparent"]) for c in (prefill_1, decode_1)]
    assert [(t, sampled) for t, _, sampled in kept] == [(client_trace, False)] * 2
    assert kept[0][1] != kept[1][1]  # each call its own span
    fresh = [parent_and_flags(c["headers"]["traceparent"]) for c in (prefill_2, decode_2)]
    assert fresh[0][0] == fresh[1][0] != client_trace and not fresh[0][2] and not fresh[1][2]
    assert not collector.trace(fresh[0][0])


def test_tracing_off_forwards_the_clients_trace_headers_unchanged(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]), probes=True)
    assert px.services.tracing is None
    parent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    r = post(px, chat(max_tokens=2), traceparent=parent, tracestate="vendor=abc")
    assert r.status_code == 200
    for server in (p, d):
        (seen,) = completions(server)
        assert (seen["headers"]["traceparent"], seen["headers"]["tracestate"]) == (
            parent, "vendor=abc")


def dropped(px: Any, reason: str) -> float:
    return sample(scrape(px.url), "epd_tracing_spans_dropped_total", reason=reason)


def test_a_collector_that_is_down_changes_no_answer(sim, proxy, monkeypatch) -> None:
    """100 requests, all answered as with no tracing; every span lost is counted."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    gone = Receiver().start()
    gone.stop()  # its port now refuses connections
    p, d = sim("prefill"), sim("decode")
    px = traced(proxy, roster([p], [d]), gone.url)
    before = dropped(px, "export_failed")
    for _ in range(100):
        r = post(px, chat(max_tokens=2))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    px.services.tracing.flush(10)
    assert dropped(px, "export_failed") == before + 300  # server, prefill and decode spans


def test_a_collector_that_never_answers_changes_no_answer(sim, proxy) -> None:
    """The export waits on the collector; requests never do: the queue fills, and what no
    longer fits is dropped and counted."""
    stalled = Receiver().start()
    stalled.stall()
    try:
        p, d = sim("prefill"), sim("decode")
        px = traced(proxy, roster([p], [d]), stalled.url, otel_bsp_max_queue_size=8,
                    otel_bsp_max_export_batch_size=4)
        before = dropped(px, "queue_full")
        for _ in range(30):
            r = post(px, chat(max_tokens=2))
            assert r.status_code == 200
        # 90 spans ended: 8 wait in the queue, up to a batch of 4 in the post the collector
        # holds, and the rest were dropped.
        lost = dropped(px, "queue_full") - before
        assert 90 - 8 - 4 <= lost < 90 - 8
        stalled.release()
        assert px.services.tracing.flush(10)
        assert len(stalled.spans) + lost == 90
    finally:
        stalled.release()
        stalled.stop()


def test_a_tokenize_call_is_a_span_naming_itself(sim, proxy, collector) -> None:
    """kv_aware's /tokenize call (fleet/kvaware.py) carries its own span."""
    p, d = sim("prefill"), sim("decode")
    px = traced(proxy, roster([p], [d]), collector.url)
    svc = px.services
    rid = secrets.token_hex(8)
    trace = svc.tracing.begin({}, "POST", "/v1/chat/completions", rid, "u")
    prefill = svc.live.view.instances[0]
    assert prefill.url == p.url
    tokens = svc.router.tokenizer.tokens(chat(), prefill, {}, trace)
    assert tokens
    ctx = RequestContext(rid, "/v1/chat/completions", {}, trace=trace)
    ctx.finish(status=200)
    root, spans = spans_of(collector, rid)
    (call,) = named(spans, "tokenize")
    assert call.parent_id == root.span_id and call.kind == "client"
    (seen,) = [r for r in p.state.requests() if r["path"] == "/tokenize"]
    assert names(seen, call)


def test_a_request_that_waited_for_capacity_shows_its_wait_and_tenant(sim, proxy,
                                                                    collector) -> None:
    """Admission (docs/behaviour.md#admission) queues a request while the only instance is
    busy: its trace has an ``admission`` span for the wait, before its call."""
    server = sim("prefill_decode", token_delay=0.05, output_tokens=400)
    doc = roster(combined=[(server, {"max_concurrency": 1})],
                 admission={"tenant_header": "X-Tenant", "queue_timeout": 20})
    doc["tenants"] = {"batch": {}}
    px = traced(proxy, doc, collector.url)
    held = RawStream(px.url, "/v1/chat/completions", chat("hold", stream=True, max_tokens=400))
    held.first_event()
    rid = secrets.token_hex(8)
    pending = gevent.spawn(post, px, chat(max_tokens=1), rid=rid, **{"X-Tenant": "batch"})
    eventually(lambda: px.services.admission.waiting == 1, what="the request waiting")
    held.hang_up()
    assert pending.get(timeout=20).status_code == 200
    root, spans = spans_of(collector, rid)
    (wait,), (decode,) = named(spans, "admission"), named(spans, "decode")
    assert wait.parent_id == root.span_id and wait.ms > 0
    assert root.start_ns <= wait.start_ns <= wait.end_ns <= decode.start_ns
    assert root.attributes["epd.tenant"] == "batch"
    assert decode.attributes["epd.role"] == "prefill_decode"
