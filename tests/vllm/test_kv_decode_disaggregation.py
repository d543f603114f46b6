"""Selective disaggregation on what the decode holds (docs/behaviour.md#routing-policies, 8),
against real vLLM: one NIXL prefill, one decode with prefix caching publishing its KV-cache
events, epd-flask under gunicorn in front.

The first turn is long: it goes through the prefill, and the decode caches the KV it pulled
(vLLM's ``cache_blocks`` once remote KV arrives), which its events announce. The next turn
repeats it and adds a few tokens: the decode holds all but those, fewer than
``disaggregate_min_prompt_tokens``, so the proxy sends it straight to the decode, which serves
the held prefix from its own cache; the prefill never sees it.
"""

from __future__ import annotations

import re
import time

import pytest

from epd_flask.fleet.kvevents import STALE_SECONDS
from tests.rosters import roster
from tests.vllm.checks import CACHED, EXTERNAL, LOCAL, kv_delta, post, unique_prompt
from tests.vllm.fleet import MODEL_NAME

pytestmark = pytest.mark.vllm

#: Below the first turn (~200 tokens), above what the second adds (~10).
FLOOR = 64
#: ~340 tokens with the next turn's words: under the servers' 512-token context.
HISTORY_REPEATS = 4


@pytest.fixture(scope="module")
def kv_decode(fleet):
    top = fleet.up("kv-decode")
    prefill, decode = top.by_role("prefill"), top.by_role("decode")
    proxy = fleet.proxy(roster(
        [prefill], [(decode, {"kv_events": f"tcp://127.0.0.1:{decode.kv_events_port}"})],
        connector="nixl", decode_retries=0, disaggregate_min_prompt_tokens=FLOOR))
    time.sleep(1.0)  # the worker's subscriber connects (ZMQ drops what it misses)
    # A first request and its events: on a busy box the worker's reader may fall behind on
    # its first messages and drop them, after which it routes by prefix for STALE_SECONDS
    # (docs/behaviour.md#routing-policies, 6); the test's turns come after that.
    _complete(proxy.url, unique_prompt("warm-up"))
    time.sleep(1.0)
    if "dropped" in proxy.log_text():
        time.sleep(STALE_SECONDS + 1.0)
    return prefill, decode, proxy


def _complete(url: str, prompt: str) -> dict:
    reply = post(url, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                          "max_tokens": 4, "temperature": 0})
    assert reply.status == 200, reply.raw
    return reply.json


def test_a_decode_that_holds_the_prompt_serves_it_without_prefill(kv_decode) -> None:
    prefill, decode, proxy = kv_decode
    history = " ".join([unique_prompt("held")] * HISTORY_REPEATS)
    before = decode.metrics()
    first = _complete(proxy.url, history)
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 3 * FLOOR
    pulled = kv_delta(decode, before, prompt, EXTERNAL)
    assert pulled.external >= prompt - 32, pulled  # turn 1 went through prefill
    time.sleep(1.0)  # the decode's BlockStored reaches the proxy's picture
    prefill_before, decode_before = prefill.metrics(), decode.metrics()
    second = _complete(proxy.url, history + " and one more short question")
    prompt2 = second["usage"]["prompt_tokens"]
    served = kv_delta(decode, decode_before, prompt2, CACHED, LOCAL)
    assert served.extra[CACHED] >= prompt - 64, served  # the held prefix, from its cache
    assert served.extra[LOCAL] < FLOOR, served  # only what it lacked, computed
    assert served.external == 0, served
    prefill_after = prefill.metrics()
    assert all(prefill_after.get(k, 0) == prefill_before.get(k, 0)
               for k in (EXTERNAL, LOCAL, CACHED)), "the prefill saw the second turn"
    log = proxy.log_text()
    assert re.search(r"prefill:disaggregate\(held=\d+/\d+\)", log), log[-3000:]
