"""Selective disaggregation on what is not cached (docs/behaviour.md#routing-policies, 8),
through real HTTP against simulators that publish vLLM's KV events: a decode keeps the KV a
prefill sent it, so a conversation's next turn, whose prompt that decode mostly holds, skips
prefill there and decode computes only the new turn; a long prompt no decode holds still
goes through prefill, and without a picture of the decode the estimate decides as before."""

from __future__ import annotations

import logging
import re
from typing import Any

import gevent
import requests

from tests.bodies import completion
from tests.helpers import eventually
from tests.rosters import roster
from tests.serving.test_kv_routing import EVENTS, events_endpoint

FLOOR = 256
#: ~1,000 tokens the sims count (4 bytes a token): far above the floor.
HISTORY = "The decode keeps what the prefill sent it. " * 93
SIM = {"kv_events_config": EVENTS, "block_size": 32, "max_model_len": 4096,
       "prompt_tokens_details": True, "prefill_tokens_per_s": 100000.0}


def _fleet(sim: Any, proxy: Any, events_on_decodes: bool = True) -> tuple[Any, list[Any], Any]:
    p = sim("prefill", **SIM)
    ds = [sim("decode", **SIM) for _ in range(2)]
    decodes = [(d, {"kv_events": events_endpoint(d.url)}) if events_on_decodes else d
               for d in ds]
    px = proxy(roster([p], decodes, disaggregate_min_prompt_tokens=FLOOR,
                      routing={"decode": "kv_aware"}), probes=True)
    if events_on_decodes:
        kv = px.services.kv_events
        assert eventually(lambda: len(kv.readers) == 2
                          and all(r.connected for r in kv.readers.values()))
        gevent.sleep(0.2)  # the subscriptions travel to the publishers
    return p, ds, px


def _send(px: Any, prompt: str) -> None:
    r = requests.post(px.url + "/v1/completions", timeout=10,
                      json=completion(prompt, max_tokens=2))
    assert r.status_code == 200, r.text


def _routing(caplog: Any) -> str:
    line = [r.getMessage() for r in caplog.records if r.name == "epd_flask.requests"][-1]
    return re.search(r"routing=(\S+)", line).group(1)


def test_a_turn_its_decode_holds_skips_prefill_and_computes_only_the_new_part(
        sim, proxy, caplog) -> None:
    p, ds, px = _fleet(sim, proxy)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        _send(px, HISTORY)  # nobody holds it: prefill computes it, a decode receives its KV
        assert p.state.stats()["completions"] == 1
        holder = next(d for d in ds if d.state.stats()["completions"] == 1)
        kv = px.services.kv_events
        eventually(lambda: kv.picture(holder.url) is not None, what="the decode's blocks heard")
        computed = holder.state.stats()["prefix_computed_tokens"]
        _send(px, HISTORY + "And the next turn asks one short question.")
        routing = _routing(caplog)
    assert p.state.stats()["completions"] == 1  # no second prefill
    assert holder.state.stats()["completions"] == 2
    assert re.search(r"prefill:disaggregate\(held=\d+/\d+\)", routing), routing
    # Decode computed the new turn and the block it ends in, not the history.
    assert 0 < holder.state.stats()["prefix_computed_tokens"] - computed < 64
    assert "kv_transfer_params" not in holder.state.requests(1)[0]["body"]


def test_a_long_prompt_no_decode_holds_still_goes_through_prefill(sim, proxy,
                                                                  caplog) -> None:
    p, _, px = _fleet(sim, proxy)
    _send(px, HISTORY)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        _send(px, "A different conversation altogether. " * 40)
    assert p.state.stats()["completions"] == 2
    assert "prefill:disaggregate" not in _routing(caplog)


def test_without_a_picture_of_the_decode_the_estimate_decides(sim, proxy, caplog) -> None:
    p, _, px = _fleet(sim, proxy, events_on_decodes=False)
    _send(px, HISTORY)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        _send(px, HISTORY + "And the next turn.")  # ~1,000 estimated tokens: prefill
        assert p.state.stats()["completions"] == 2
        _send(px, "A short one.")
        assert "prefill:disaggregate(short)" in _routing(caplog)
    assert p.state.stats()["completions"] == 2


#: The prefill's queue bound of the tests below, in prompt tokens: HISTORY (~1,000) queued
#: is above it.
QUEUE = 500
#: A prefill this slow keeps HISTORY queued for ~1 s; a decode computes a short prompt at once.
SLOW = {"max_model_len": 4096, "prefill_tokens_per_s": 1000.0}
FAST = {"max_model_len": 4096, "prefill_tokens_per_s": 100000.0}


def _queued_fleet(sim: Any, proxy: Any, **decode: Any) -> tuple[Any, Any, Any]:
    p, d = sim("prefill", **SLOW), sim("decode", **FAST, **decode)
    px = proxy(roster([p], [d], disaggregate_max_prefill_queue_tokens=QUEUE))
    return p, d, px


def _queue_prefill(px: Any, p: Any) -> gevent.Greenlet:
    """HISTORY sent through the slow prefill, left in its queue."""
    long = gevent.spawn(_send, px, HISTORY)
    registry = px.services.registry
    eventually(lambda: registry.get(p.url).in_flight == 1, what="the prefill busy")
    return long


def _routings(caplog: Any) -> list[str]:
    return [re.search(r"routing=(\S+)", r.getMessage()).group(1) for r in caplog.records
            if r.name == "epd_flask.requests"]


def test_while_every_prefill_is_queued_an_idle_decode_computes_the_prompt(
        sim, proxy, caplog) -> None:
    p, d, px = _queued_fleet(sim, proxy)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        long = _queue_prefill(px, p)
        _send(px, "A short question that need not wait.")
        assert not long.ready()  # served before the queued prompt's prefill ended
        long.get(timeout=10)
    skipped = [r for r in _routings(caplog) if "prefill:disaggregate" in r]
    assert len(skipped) == 1, _routings(caplog)
    queued = int(re.search(r"prefill:disaggregate\(queued=(\d+)\)", skipped[0]).group(1))
    assert queued >= QUEUE
    assert p.state.stats()["completions"] == 1  # only the long one
    assert d.state.stats()["completions"] == 2
    short = next(r for r in d.state.requests(2) if "need not wait" in r["body"]["prompt"])
    assert "kv_transfer_params" not in short["body"]


def test_a_busy_decode_leaves_the_prompt_to_the_queued_prefill(sim, proxy, caplog) -> None:
    p, _, px = _queued_fleet(sim, proxy, token_delay=0.05)
    streams = [requests.post(px.url + "/v1/completions", stream=True, timeout=10,
                             json=completion(f"Stream {i}.", max_tokens=200, stream=True))
               for i in range(2)]
    lines = [s.iter_lines() for s in streams]  # kept: a dropped iterator ends its stream
    try:
        for s, read in zip(streams, lines, strict=True):
            assert s.status_code == 200
            next(read)  # decoding: two requests open on the decode
        with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
            long = _queue_prefill(px, p)
            _send(px, "A short question that waits its turn.")
            long.get(timeout=10)
    finally:
        for s in streams:
            s.close()
    assert not [r for r in _routings(caplog) if "prefill:disaggregate" in r], _routings(caplog)
    assert p.state.stats()["completions"] == 4


def test_an_idle_prefill_keeps_the_prompt(sim, proxy, caplog) -> None:
    p, _, px = _queued_fleet(sim, proxy)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        _send(px, "A short question to an idle fleet.")
        _send(px, HISTORY)
    assert p.state.stats()["completions"] == 2
    assert not [r for r in _routings(caplog) if "prefill:disaggregate" in r]
