"""Clients that stop reading their stream, through real gunicorn: the worker resets one that
accepts no byte for EPD_CLIENT_WRITE_TIMEOUT, and decode_total_timeout ends the relay even
while it waits on such a client (docs/behaviour.md#edge, docs/behaviour.md#transport).
Either way decode's connection is closed (the simulator counts the stream aborted) and the
in-flight slot is freed for the next completion."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import gevent
import pytest
import requests

from tests.bodies import completion, completion_stream
from tests.helpers import eventually
from tests.rosters import roster

pytestmark = pytest.mark.e2e

#: A stream far longer than every socket buffer on its way (~25 MB): the sim writes it as fast
#: as it is read.
TOKENS = 100000
LONG_STREAM = ["--output-tokens", str(TOKENS), "--max-model-len", str(2 * TOKENS)]
#: The sim builds a whole answer before its first byte (~2 s for this one, one at a time), and
#: the write timeout must not end the first stall before the last one is established.
STALLED = 2
WRITE_TIMEOUT = 8
#: Past the sim's time to the first byte, so the relay is blocked on its client when it fires.
TOTAL_TIMEOUT = 10
#: The stalled clients' receive buffer, and what each reads before it stops.
RCVBUF = 4096
READ_FIRST = 1024
LAST_CHUNK = b"\r\n0\r\n\r\n"
WAIT = 30.0  # bound on every wait below


def stall(url: str, max_tokens: int = TOKENS) -> socket.socket:
    """A streaming completion whose client reads 1 KB, then nothing."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    sock.settimeout(WAIT)
    sock.connect((parts.hostname, parts.port))
    body = json.dumps(completion_stream("hello", max_tokens=max_tokens)).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    got = b""
    while len(got) < READ_FIRST:
        got += sock.recv(READ_FIRST)
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    return sock


def read_rest(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server still sends, to the answer's last chunk or the connection's
    end, and whether the connection was reset."""
    rest = b""
    try:
        while not rest.endswith(LAST_CHUNK) and (data := sock.recv(65536)):
            rest += data
    except ConnectionResetError:
        return rest, True
    return rest, False


def _completion(url: str) -> int:
    return requests.post(url + "/v1/completions", timeout=WAIT,
                         json=completion("hi", max_tokens=2)).status_code


def in_flight(url: str) -> int:
    return requests.get(url + "/health", timeout=WAIT).json()["load"]["in_flight"]


def test_a_client_that_stops_reading_is_reset_and_its_decode_closed(procs) -> None:
    sim = procs["sim"]("prefill_decode", *LONG_STREAM)
    gw = procs["gunicorn"](
        roster(combined=[sim]),
        env={"EPD_MAX_IN_FLIGHT": str(STALLED), "EPD_CLIENT_WRITE_TIMEOUT": str(WRITE_TIMEOUT)})
    starts = [gevent.spawn(stall, gw.url) for _ in range(STALLED)]
    gevent.joinall(starts, timeout=WAIT, raise_error=True)
    stalled = [g.value for g in starts]
    try:
        # Held: every slot is a stalled stream, so the next completion is refused...
        assert _completion(gw.url) == 503
        assert sim.stats()["streams_aborted"] == 0
        # ...until the worker gives up on them: decode closed, slots free, served again.
        assert eventually(lambda: sim.stats()["streams_aborted"] == STALLED, WAIT), \
            sim.stats()
        assert eventually(lambda: in_flight(gw.url) == 0, WAIT)
        assert _completion(gw.url) == 200
        stats = sim.stats()
        assert stats["streams_completed"] == 0 and stats["in_flight"] == 0, stats
        for sock in stalled:  # the stream was cut, not finished
            rest, reset = read_rest(sock)
            assert reset or b"data: [DONE]" not in rest
    finally:
        for sock in stalled:
            sock.close()


def test_decode_total_timeout_ends_a_relay_blocked_on_its_client(procs) -> None:
    sim = procs["sim"]("prefill_decode", *LONG_STREAM)
    gw = procs["gunicorn"](
        roster(combined=[sim], decode_total_timeout=TOTAL_TIMEOUT, decode_chunk_timeout=1),
        env={"EPD_CLIENT_WRITE_TIMEOUT": "120"})
    sock = stall(gw.url)
    try:
        # The relay waits on the client, not on decode; the total timeout still closes decode.
        assert eventually(lambda: sim.stats()["streams_aborted"] == 1, WAIT), sim.stats()
        assert in_flight(gw.url) == 1  # the client has not read the end yet
        rest, reset = read_rest(sock)
        assert not reset
        # The stream ends with the in-band error event, after whole events, then the last chunk.
        assert rest.endswith(LAST_CHUNK), rest[-300:]
        error = rest[rest.rindex(b'data: {"error"'):]
        last = json.loads(error[len(b"data: "):error.index(b"\n\n")])
        assert last["error"]["code"] == "upstream_timeout", last
        assert "total timeout" in last["error"]["message"]
        assert b"[DONE]" not in rest
        assert eventually(lambda: in_flight(gw.url) == 0, WAIT)
    finally:
        sock.close()

