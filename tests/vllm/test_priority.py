"""vLLM's priority scheduling fed by the tenants' classes (docs/behaviour.md#admission,
``forward_priority``): one real vLLM engine that runs one request at a time
(``--scheduling-policy priority --max-num-seqs 1``) behind epd-flask; a high-priority tenant's
request sent while low-priority ones wait finishes before the last of them."""

from __future__ import annotations

import time

import gevent
import pytest

from epd_flask.fleet.saturation import ENGINE_WAITING_FULL
from tests.helpers import eventually
from tests.rosters import roster
from tests.vllm.checks import call, chat_body, unique_prompt

pytestmark = pytest.mark.vllm

#: Low-priority requests sent before the high one: as many as the engine takes before the
#: proxy calls it full (one running, the rest waiting), so every one of them waits in the
#: engine's queue, not the proxy's, and what overtakes them is vLLM's scheduler.
LOWS = ENGINE_WAITING_FULL


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

    # Each low request is 400 tokens after a ~60-token prompt (within --max-model-len 512),
    # which the tiny model writes in about half a second on a quiet machine: several of them
    # keep the engine busy long enough for the high request to arrive while some still wait.
    lows = [f"low-{n}" for n in range(1, LOWS + 1)]
    sent = []
    for name in lows:
        sent.append(gevent.spawn(send, name, "batch", 400))
        eventually(lambda name=name: engine("running") + engine("waiting") >= len(sent)
                   or name in finished, 60, what=f"{name} reaching the engine")
    eventually(lambda: engine("waiting") >= 2, 60, what="two low requests waiting")
    high = gevent.spawn(send, "high", "chat", 8)
    gevent.joinall([*sent, high], raise_error=True, timeout=300)
    # First come, first served would finish it after every low request.
    assert finished["high"] < finished[lows[-1]], finished
    assert finished[lows[0]] < finished[lows[-1]]
