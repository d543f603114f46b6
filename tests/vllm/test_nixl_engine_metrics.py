"""The engine load signals routing reads (docs/behaviour.md#routing-policies), from real vLLM:
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
with their ``model_name`` and ``engine`` labels, parsed by the proxy's own reader, idle and
while a stream runs; and a proxy's prober reading them, so routing counts a stream another
host sent the decode."""

from __future__ import annotations

import re
import time

import gevent
import pytest
import requests
from gevent.event import Event

from epd_flask.fleet.enginemetrics import NAMES, EngineLoad, parse
from epd_flask.web.services import services
from tests.helpers import eventually
from tests.rosters import roster
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


def _stream(url: str, tag: str) -> int:
    """A long stream sent straight to ``url``, read to its end."""
    body = completion_body(unique_prompt(tag), max_tokens=400, stream=True, ignore_eos=True)
    with requests.post(url + "/v1/completions", json=body, stream=True,
                       timeout=HTTP_TIMEOUT) as r:
        for _ in r.iter_content(None):
            pass
        return r.status_code


def _stream_on(url: str, tag: str) -> gevent.Greenlet:
    return gevent.spawn(_stream, url, tag)


def _streams_until(url: str, tag: str, seen: Event, most: int = 20) -> list[int]:
    """Streams sent straight to ``url`` one after another until ``seen`` (a tiny model's
    stream lasts well under a second, less than a few probe rounds), at most ``most``."""
    statuses = []
    for i in range(most):
        if seen.is_set():
            break
        statuses.append(_stream(url, f"{tag}-{i}"))
    return statuses


def test_a_running_stream_shows_as_running_and_holding_kv(fleet) -> None:
    decode = fleet.up("nixl").by_role("decode")
    running = _stream_on(decode.url, "engine-load")
    try:
        busy = eventually(lambda: (now := load(decode.url)).running >= 1 and now,
                          what="the stream counted as running")
        assert busy.waiting == 0 and busy.kv_usage is not None and busy.kv_usage > 0
    finally:
        assert running.get(timeout=HTTP_TIMEOUT) == 200
    assert eventually(lambda: load(decode.url).queue == 0, what="the stream done")


def test_the_prober_counts_a_stream_another_host_sent(fleet, proxy) -> None:
    top = fleet.up("nixl")
    prefill, decode = top.by_role("prefill"), top.by_role("decode")
    px = proxy(roster([prefill], [decode], connector="nixl", probe_interval=0.2,
                      engine_metrics_interval=0.2), probes=True)
    registry = services(px.app).live.registry
    eventually(lambda: (s := registry.get(decode.url)) is not None and s.engine is not None
               and s.engine.queue == 0, what="the idle decode read")
    seen = Event()
    running = gevent.spawn(_streams_until, decode.url, "another-host", seen)  # not via the proxy
    try:
        state = eventually(lambda: (s := registry.get(decode.url)).engine.running >= 1 and s,
                           seconds=30, what="the prober read a stream")
        assert state.in_flight == 0  # none of it is this worker's
        assert state.queue(time.monotonic(), 10.0, registry.host(decode.url)[0]) >= 1
        assert state.engine.kv_usage is not None and state.engine.kv_usage > 0
    finally:
        seen.set()
        statuses = running.get(timeout=HTTP_TIMEOUT)
    assert statuses and set(statuses) == {200}
    eventually(lambda: registry.get(decode.url).engine.queue == 0, what="the streams done")
    assert registry.get(decode.url).queue(time.monotonic(), 10.0,
                                          registry.host(decode.url)[0]) == 0
