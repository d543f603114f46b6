"""Decode's three clocks through real HTTP: the wait for a stream's first byte
(``decode_timeout``), the silence allowed between chunks (``decode_chunk_timeout``), and the
whole call (``decode_total_timeout``, off by default, the only bound on a non-stream answer,
which arrives whole at its end)."""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.bodies import completion
from tests.fakes import SSE_HEAD, chunk, serve_and_wait
from tests.rosters import roster

COMPLETION = completion(max_tokens=4)
EVENT = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
#: Headers of an SSE answer that ends with the connection: no length, no chunking.
UNFRAMED_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"


def post(px, body: dict) -> tuple[requests.Response, float]:
    started = time.monotonic()
    r = requests.post(px.url + "/v1/completions", json=body, timeout=30)
    return r, time.monotonic() - started


def last_event(text: str) -> dict:
    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
    return json.loads(events[-1][len("data: "):])


@pytest.mark.parametrize("head, first", [
    (UNFRAMED_SSE_HEAD, EVENT),
    (SSE_HEAD, chunk(EVENT)),
], ids=["ends with the connection", "chunked"])
def test_silence_after_the_first_event_is_cut_by_the_chunk_timeout(sim, proxy, fake, head,
                                                                   first) -> None:
    p = sim("prefill")
    d = fake(serve_and_wait(head + first))
    px = proxy(roster([p], [d], decode_timeout=2.0, decode_chunk_timeout=0.5,
                         decode_retries=0))
    r, took = post(px, {**COMPLETION, "stream": True})
    print(f"\nsilent stream cut after {took:.2f} s (chunk timeout 0.5 s, decode timeout 2 s)")
    assert r.status_code == 200 and r.text.startswith(EVENT.decode())
    err = last_event(r.text)["error"]
    assert err["code"] == "upstream_timeout"
    assert "sent nothing for 0.5 s between chunks (decode chunk timeout)" in err["message"]
    assert took < 2.0  # the chunk timeout cut it, not the first-byte one


def test_a_non_stream_answer_may_take_longer_than_decode_timeout(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", ttft=1.0)
    px = proxy(roster([p], [d], decode_timeout=0.3, decode_retries=0))
    r, took = post(px, COMPLETION)
    print(f"\nnon-stream answer after {took:.2f} s with decode_timeout 0.3 s: {r.status_code}")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_a_non_stream_answer_past_the_total_timeout_is_504(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", ttft=2.0)
    px = proxy(roster([p], [d], decode_timeout=5.0, decode_total_timeout=0.5,
                         decode_retries=0))
    r, took = post(px, COMPLETION)
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["code"] == "upstream_timeout"
    assert err["message"].endswith("did not finish within 0.5 s (decode total timeout)")
    assert took < 2.0


def test_a_stream_past_the_total_timeout_ends_in_band(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.1, output_tokens=100)
    px = proxy(roster([p], [d], decode_chunk_timeout=2.0, decode_total_timeout=1.0,
                         decode_retries=0))
    r, took = post(px, {**COMPLETION, "max_tokens": 100, "stream": True})
    assert r.status_code == 200
    tokens = [e for e in r.text.split("\n\n") if e.startswith("data: {") and '"error"' not in e]
    err = last_event(r.text)["error"]
    assert err["code"] == "upstream_timeout" and "(decode total timeout)" in err["message"]
    assert 2 <= len(tokens) < 100 and "[DONE]" not in r.text
    assert took < 2.0
