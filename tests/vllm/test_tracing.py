"""One trace from the proxy into real vLLM (docs/behaviour.md#tracing): vLLM started with
``--otlp-traces-endpoint`` joins the trace each call hands it, so its ``llm_request`` spans
arrive at the same collector as children of the proxy's ``prefill`` and ``decode`` spans."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.helpers import eventually
from tests.otlp import Received, Receiver, tree
from tests.rosters import roster
from tests.vllm.checks import chat_body, post, unique_prompt

pytestmark = pytest.mark.vllm

#: vLLM exports when it finishes a request, in batches (200 ms here: fleet.traced).
SPANS_SECONDS = 60.0


@pytest.fixture(scope="module")
def collector() -> Iterator[Receiver]:
    receiver = Receiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def pd(fleet, collector) -> SimpleNamespace:
    top = fleet.up("nixl", traces=collector.url)
    prefill, decode = top.by_role("prefill"), top.by_role("decode")
    proxy = fleet.proxy(roster([prefill], [decode], connector="nixl", decode_retries=0),
                        env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
                             "OTEL_BSP_SCHEDULE_DELAY": "100"})
    return SimpleNamespace(prefill=prefill, decode=decode, proxy=proxy)


def server_span(collector: Receiver, request_id: str) -> Received:
    return eventually(lambda: next((s for s in collector.spans if s.kind == "server"
                                    and s.attributes.get("epd.request_id") == request_id),
                                   None), SPANS_SECONDS, what=f"the proxy's span of {request_id}")


def test_vllm_spans_nest_under_the_proxys_prefill_and_decode(pd, collector) -> None:
    body = chat_body(unique_prompt("traced"), stream=True,
                     stream_options={"include_usage": True})
    reply = post(pd.proxy.url, "/v1/chat/completions", body)
    assert reply.status == 200, reply.raw
    root = server_span(collector, reply.headers["x-request-id"])
    ours = {s.name: s for s in collector.trace(root.trace_id)
            if s.resource.get("service.name") == "epd-flask"}
    prefill, decode = ours["prefill"], ours["decode"]

    def vllm_spans() -> list[Received]:
        return [s for s in collector.trace(root.trace_id)
                if s.resource.get("service.name", "").startswith("vllm-")]

    found = eventually(lambda: len(vllm_spans()) >= 2 and vllm_spans(), SPANS_SECONDS,
                       what=lambda: f"vLLM's spans in trace {root.trace_id}: "
                                    f"{[(s.name, s.resource) for s in vllm_spans()]}")
    print(f"\ntrace {root.trace_id} through real vLLM:\n"
          f"{tree(collector.trace(root.trace_id))}")
    by_parent = {s.parent_id: s for s in found}
    assert set(by_parent) == {prefill.span_id, decode.span_id}
    assert by_parent[prefill.span_id].resource["service.name"] == "vllm-prefill"
    assert by_parent[decode.span_id].resource["service.name"] == "vllm-decode"
    for span in found:
        assert span.name == "llm_request" and span.kind == "server"
    # vLLM's own account of the request agrees with the proxy's
    assert by_parent[decode.span_id].attributes["gen_ai.usage.completion_tokens"] == \
        root.attributes["gen_ai.usage.output_tokens"] == 8
