"""A client that hangs up before its answer starts frees every upstream leg within a second,
whichever leg was being waited on: an encoder, prefill, decode before its first byte, a whole
non-stream answer. Through real HTTP: the client is a raw socket that closes, and the
simulated instances record when they saw their request aborted (``last_abort_at``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import gevent
import pytest

from tests.bodies import chat, image, multimodal
from tests.helpers import RawStream, eventually, sample, scrape
from tests.rosters import roster

CHAT = chat(max_tokens=8, temperature=0)
#: When the client leaves, well inside the slow leg.
LEAVE_AFTER = 0.5
#: The most a departure may take to reach the instance (docs/behaviour.md#edge).
CLOSE_WITHIN = 1.0


def _aborted(server: Any) -> bool:
    stats = server.state.stats()
    return bool(stats["requests_aborted"] or stats["streams_aborted"])


def _leave_and_time(px: Any, body: dict[str, Any], upstream: Any) -> float:
    """Send ``body``, hang up after ``LEAVE_AFTER`` s; the seconds from the hang-up to
    ``upstream`` recording the abort (fails if it takes more than 3 s)."""
    client = RawStream(px.url, "/v1/chat/completions", body)
    gevent.sleep(LEAVE_AFTER)
    assert upstream.state.stats()["in_flight"] == 1  # the slow leg is being waited on
    left_at = time.time()
    client.hang_up()
    eventually(lambda: _aborted(upstream), 3.0, what="the instance seeing the client leave")
    return upstream.state.stats()["last_abort_at"] - left_at


def _report(what: str, seconds: float) -> None:
    print(f"\n{what}: client left -> upstream closed in {seconds * 1000:.0f} ms")


def _499s(px: Any) -> float:
    return sample(scrape(px.url), "epd_requests_total", route="/v1/chat/completions",
                  status="499")


def _counted_as_499(px: Any, caplog: pytest.LogCaptureFixture, wait: Callable[[], bool]) -> None:
    eventually(wait, 3.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_flask.requests"]
    assert len(lines) == 1 and " status=499 " in lines[0], lines
    assert "client closed the connection" in lines[0]
    assert _499s(px) == 1


def test_non_stream_decode_is_aborted_when_the_client_leaves(sim, proxy, caplog) -> None:
    p, d = sim("prefill"), sim("decode", ttft=5.0)
    px = proxy(roster([p], [d]))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        seconds = _leave_and_time(px, CHAT, d)
        _report("non-stream decode (5 s)", seconds)
        assert seconds < CLOSE_WITHIN
        _counted_as_499(px, caplog, lambda: d.state.stats()["in_flight"] == 0)
    assert d.state.stats()["requests_aborted"] == 1


def test_slow_prefill_is_aborted_and_decode_never_called(sim, proxy, caplog) -> None:
    p, d = sim("prefill", ttft=3.0), sim("decode")
    px = proxy(roster([p], [d]))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        seconds = _leave_and_time(px, {**CHAT, "stream": True}, p)
        _report("stream, prefill (3 s)", seconds)
        assert seconds < CLOSE_WITHIN
        _counted_as_499(px, caplog, lambda: p.state.stats()["in_flight"] == 0)
    gevent.sleep(0.2)
    assert d.state.stats()["completions"] == 0


def test_stream_decode_before_its_first_byte_is_aborted(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", ttft=3.0)
    px = proxy(roster([p], [d]))
    seconds = _leave_and_time(px, {**CHAT, "stream": True}, d)
    _report("stream, decode before its first byte (3 s)", seconds)
    assert seconds < CLOSE_WITHIN
    assert d.state.stats()["streams_completed"] == 0


def test_slow_encoder_is_aborted_and_prefill_and_decode_never_called(sim, proxy) -> None:
    e, p, d = sim("encode", ttft=3.0), sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e]))
    body = {**CHAT, **multimodal(image(size=900))}
    seconds = _leave_and_time(px, body, e)
    _report("encoder (3 s)", seconds)
    assert seconds < CLOSE_WITHIN
    gevent.sleep(0.2)
    assert p.state.stats()["completions"] == 0 and d.state.stats()["completions"] == 0


def test_mooncake_legs_are_both_aborted_before_decodes_first_byte(sim, proxy) -> None:
    p = sim("prefill", bootstrap_port=0, ttft=3.0)
    d = sim("decode", kv_timeout=10.0)
    px = proxy(roster([(p, {"bootstrap_url": p.bootstrap_url})], [d], connector="mooncake"),
               probes=True)
    eventually(lambda: px.services.pipeline.ready()[0], interval=0.05)
    seconds = _leave_and_time(px, CHAT, p)
    _report("mooncake, prefill and decode at once (3 s)", seconds)
    assert seconds < CLOSE_WITHIN
    assert eventually(lambda: d.state.stats()["in_flight"] == 0, 2)
