"""vLLM's priority scheduling fed by the tenants' classes (docs/behaviour.md#admission,
``forward_priority``): one real vLLM engine that runs one request at a time
(``--scheduling-policy priority --max-num-seqs 1``) behind epd-flask; a high-priority tenant's
request sent after two low-priority ones finishes before the second of them."""

from __future__ import annotations

import time

import gevent
import pytest

from tests.helpers import eventually
from tests.rosters import roster
from tests.vllm.checks import call, chat_body, unique_prompt

pytestmark = pytest.mark.vllm


def test_a_high_priority_tenant_overtakes_a_waiting_low_priority_one(fleet):
    top = fleet.up("priority")
    server = top.by_role("prefill_decode")
    doc = roster(combined=[server], admission={"tenant_header": "X-Tenant",
                                               "forward_priority": True})
    doc["tenants"] = {"chat": {"priority": "high"}, "batch": {"priority": "low"}}
    proxy = fleet.proxy(doc)
    finished: dict[str, float] = {}

    def send(name: str, tenant: str, tokens: int) -> None:
        reply = call("POST", proxy.url + "/v1/chat/completions",
                     chat_body(unique_prompt(name), max_tokens=tokens, ignore_eos=True),
                     headers={"X-Tenant": tenant})
        assert reply.status == 200, reply.raw[:300]
        finished[name] = time.monotonic()

    def engine(name: str) -> float:
        return server.metrics().get(f"vllm:num_requests_{name}", 0.0)

    # Long enough (the tiny model writes a token in milliseconds) to be seen running and
    # waiting: 400 tokens after a ~60-token prompt, within --max-model-len 512.
    first = gevent.spawn(send, "low-1", "batch", 400)
    eventually(lambda: engine("running") == 1, 60, what="the first low request running")
    second = gevent.spawn(send, "low-2", "batch", 400)
    eventually(lambda: engine("waiting") == 1, 60, what="the second low request waiting")
    high = gevent.spawn(send, "high", "chat", 8)
    gevent.joinall([first, second, high], raise_error=True, timeout=300)
    assert finished["high"] < finished["low-2"], finished
