"""What one enormous SSE event costs the worker: time linear in its bytes while it is relayed,
and past ``EPD_MAX_EVENT_BYTES`` an in-band error that ends the stream and closes decode."""

from __future__ import annotations

import json
import socket
import time

import gevent
import requests

from epd_flask.serving import relay
from epd_flask.serving.context import RequestContext
from epd_flask.upstream.transport import Transport
from tests.bodies import chat_stream
from tests.fakes import LAST_CHUNK, SSE_HEAD, chunk
from tests.helpers import eventually
from tests.rosters import roster

CHAT = chat_stream("hi", max_tokens=4)
MB = 1024 * 1024
PIECE = 64 * 1024
#: A loop stall past this while a long event passes means the relay is not linear (the
#: quadratic join-and-search took 1.8 s for 16 MB, and four times that for 32 MB). Measured
#: in this process's CPU time, so a busy machine that deschedules the test cannot trip it.
STALL_BOUND = 1.0


class _Resp:
    """Stands in for an upstream answer in the relay's ``finally``."""

    deadline = None

    def close(self) -> None:
        pass


def _pieces(size: int) -> list[bytes]:
    event = b'data: "' + b"x" * size + b'"\n\n'
    return [event[i:i + PIECE] for i in range(0, len(event), PIECE)] + [b"data: [DONE]\n\n"]


def test_relaying_one_long_event_costs_time_linear_in_its_bytes() -> None:
    ctx = RequestContext("r", "/v1/completions", {})
    started = time.process_time()
    out = list(relay.sse(Transport(), _Resp(), ctx,  # type: ignore[arg-type]
                         chunks=_pieces(32 * MB), max_event=64 * MB))
    took = time.process_time() - started
    print(f"\n32 MB event in 64 KB reads relayed in {took * 1000:.0f} ms of CPU time")
    assert [len(o) for o in out] == [32 * MB + 10, 14]
    assert took < STALL_BOUND


def _huge_event_then_done(size: int, cut: list[str] | None = None):
    def handle(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(SSE_HEAD + chunk(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'))
        body = b'data: "' + b"x" * size + b'"\n\n'
        try:
            for i in range(0, len(body), PIECE):
                conn.sendall(chunk(body[i:i + PIECE]))
            conn.sendall(chunk(b"data: [DONE]\n\n") + LAST_CHUNK)
        except OSError as exc:
            if cut is not None:
                cut.append(type(exc).__name__)
            raise
    return handle


def _stall_watch(samples: list[float], stop: list[bool]) -> None:
    """The CPU time this process spends between two turns of the loop: how long one greenlet
    held it, not how long the machine kept the process waiting."""
    last = time.process_time()
    while not stop:
        gevent.sleep(0.002)
        now = time.process_time()
        samples.append(now - last)
        last = now


def test_a_16_mb_event_passes_without_stalling_the_worker(sim, proxy, fake) -> None:
    p = sim("prefill")
    d = fake(_huge_event_then_done(16 * MB))
    px = proxy(roster([p], [d], decode_retries=0), max_event_bytes=64 * MB)
    gaps: list[float] = []
    stop: list[bool] = []
    watcher = gevent.spawn(_stall_watch, gaps, stop)
    started = time.monotonic()
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=30)
    took = time.monotonic() - started
    stop.append(True)
    watcher.join()
    print(f"\n16 MB event through the proxy in {took:.2f} s; the worker's longest stall "
          f"meanwhile {max(gaps) * 1000:.0f} ms of CPU time")
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert len(r.content) > 16 * MB
    assert max(gaps) < STALL_BOUND


def test_an_event_past_the_limit_ends_the_stream_in_band_and_closes_decode(sim, proxy,
                                                                        fake) -> None:
    p = sim("prefill")
    cut: list[str] = []
    d = fake(_huge_event_then_done(64 * MB, cut))
    px = proxy(roster([p], [d], decode_retries=0), max_event_bytes=MB)
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0].startswith('data: {"choices"')
    err = json.loads(events[-1][len("data: "):])["error"]
    assert err["code"] == "upstream_event_too_large" and err["type"] == "upstream_error"
    assert "larger than this proxy relays (1048576 bytes" in err["message"]
    assert len(r.content) < 2 * MB  # the long event was never relayed, not even in part
    assert "[DONE]" not in r.text
    assert eventually(lambda: cut, interval=0.05)  # decode's connection was cut mid-event


def test_events_split_anywhere_across_reads_come_out_whole() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    transport = Transport()
    for cut_a in range(1, len(stream)):
        for cut_b in range(cut_a, len(stream)):
            pieces = [stream[:cut_a], stream[cut_a:cut_b], stream[cut_b:]]
            ctx = RequestContext("r", "/v1/completions", {})
            out = list(relay.sse(transport, _Resp(), ctx,  # type: ignore[arg-type]
                                 chunks=[p for p in pieces if p]))
            assert b"".join(out) == stream
            assert all(o.endswith(b"\n\n") for o in out), (cut_a, cut_b, out)
