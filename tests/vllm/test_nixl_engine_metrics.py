"""The engine load signals routing reads (docs/behaviour.md#routing-policies), from real vLLM:
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
with their ``model_name`` and ``engine`` labels, parsed by the proxy's own reader, idle and
while a stream runs."""

from __future__ import annotations

import re

import gevent
import pytest
import requests

from epd_flask.fleet.enginemetrics import NAMES, EngineLoad, parse
from tests.helpers import eventually
from tests.vllm.checks import HTTP_TIMEOUT, completion_body, unique_prompt
from tests.vllm.fleet import MODEL_NAME

pytestmark = pytest.mark.vllm


def page(url: str) -> bytes:
    r = requests.get(url + "/metrics", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    return r.content


def load(url: str) -> EngineLoad:
    return parse(page(url))


def test_the_gauges_have_vllm_names_and_labels_and_read_idle(fleet) -> None:
    decode = fleet.up("nixl").by_role("decode")
    text = page(decode.url)
    for name in NAMES:
        series = re.findall(rb"^" + re.escape(name) + rb"\{([^}]*)\} (\S+)$", text, re.M)
        assert series, f"{name!r} is not on the page"
        for labels, _value in series:
            found = dict(re.findall(rb'(\w+)="([^"]*)"', labels))
            assert found.get(b"model_name") == MODEL_NAME.encode()
            assert found.get(b"engine") == b"0"
    idle = eventually(lambda: (now := load(decode.url)).queue == 0 and now,
                      what="the decode idle")
    assert idle.kv_usage is not None and 0.0 <= idle.kv_usage < 0.05


def test_a_running_stream_shows_as_running_and_holding_kv(fleet) -> None:
    decode = fleet.up("nixl").by_role("decode")
    body = completion_body(unique_prompt("engine-load"), max_tokens=400, stream=True,
                           ignore_eos=True)

    def stream() -> int:
        with requests.post(decode.url + "/v1/completions", json=body, stream=True,
                           timeout=HTTP_TIMEOUT) as r:
            for _ in r.iter_content(None):
                pass
            return r.status_code

    running = gevent.spawn(stream)
    try:
        busy = eventually(lambda: (now := load(decode.url)).running >= 1 and now,
                          what="the stream counted as running")
        assert busy.waiting == 0 and busy.kv_usage is not None and busy.kv_usage > 0
    finally:
        assert running.get(timeout=HTTP_TIMEOUT) == 200
    assert eventually(lambda: load(decode.url).queue == 0, what="the stream done")
