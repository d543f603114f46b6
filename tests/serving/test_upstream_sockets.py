"""Every way out of a request gives back its upstream sockets (docs/behaviour.md#transport),
at the transport level.

Counted the way an operator would: this process's open file descriptors that are TCP sockets
connected to an instance's port (/proc/self/fd matched against /proc/self/net/tcp*).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.pool
import pytest
import requests

from tests.bodies import chat_stream
from tests.helpers import RawStream, eventually
from tests.rosters import roster

CHAT = chat_stream()
STORM = 1000
CONCURRENCY = 50
SETTLE_SECONDS = 2.0

pytestmark = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(),
                                reason="counts sockets through Linux /proc")


def upstream_sockets(*ports: int) -> int:
    """Open sockets of this process whose peer is one of ``ports``."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    wanted = set(ports)
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[2].rsplit(":", 1)[1], 16) in wanted and fields[9] in inodes:
                count += 1
    return count


def settle(ports: tuple[int, ...], baseline: int) -> tuple[int, float]:
    """Wait (bounded) for the count to reach the baseline; returns (count, seconds)."""
    started = time.monotonic()
    while True:
        count = upstream_sockets(*ports)
        waited = time.monotonic() - started
        if count <= baseline or waited > SETTLE_SECONDS:
            return count, waited
        gevent.sleep(0.05)


def storm_proxy(sim, proxy, **settings):
    p = sim("prefill")
    # Streams long enough to be abandoned mid-way, short enough to cost the sim little.
    d = sim("decode", token_delay=0.2, output_tokens=10)
    return p, d, proxy_over(proxy, p, d, **settings)


def proxy_over(proxy, p, d, **settings):
    # A short idle limit so the pooled prefill connections are swept within the window too:
    # after the storm, *every* upstream socket must be gone, not only the decode streams.
    px = proxy(roster([p], [d], **settings), upstream_idle_timeout=0.5)
    px.services.transport.start()
    return px


def test_a_storm_of_abandoned_streams_returns_every_upstream_socket(sim, proxy) -> None:
    p, d, px = storm_proxy(sim, proxy)
    ports = (p.port, d.port)
    baseline = upstream_sockets(*ports)
    peak = 0

    def abandon(_: int) -> None:
        nonlocal peak
        client = RawStream(px.url, "/v1/chat/completions", CHAT)
        client.first_event()
        peak = max(peak, upstream_sockets(d.port)) if _ % 100 == 0 else peak
        client.hang_up()

    started = time.monotonic()
    gevent.pool.Pool(CONCURRENCY).map(abandon, range(STORM))
    storm_seconds = time.monotonic() - started
    after, waited = settle(ports, baseline)
    print(f"\n{STORM} abandoned streams in {storm_seconds:.2f} s (concurrency {CONCURRENCY}); "
          f"upstream sockets: baseline {baseline}, sampled peak {peak}, "
          f"{after} after {waited:.2f} s")
    assert peak > baseline  # the count does see the streams while they are open
    assert after == baseline
    eventually(lambda: d.state.stats()["streams_aborted"] >= STORM, SETTLE_SECONDS, interval=0.05)
    stats = d.state.stats()
    assert stats["streams_aborted"] == STORM and stats["streams_completed"] == 0


def test_every_other_way_out_returns_its_sockets_too(sim, proxy) -> None:
    """Success (stream and not), upstream errors, first-byte and between-chunk timeouts.

    The timeouts are short (0.3 s) only on the proxy that is meant to hit them: the sim, the
    proxy and 50 clients share this one process, and on a loaded machine an answer the sim
    sends at once can reach the proxy's read more than 0.3 s later, which a proxy whose
    requests must succeed would rightly count as a timeout."""
    settings = {"decode_retries": 0, "fail_threshold": 100}
    p, d, px = storm_proxy(sim, proxy, **settings)
    impatient = proxy_over(proxy, p, d, decode_timeout=0.3, decode_chunk_timeout=0.3,
                           **settings)
    ports = (p.port, d.port)
    baseline = upstream_sockets(*ports)
    outcomes: list[str] = []

    def call(body: dict, via: Any = px) -> None:
        r = requests.post(via.url + "/v1/chat/completions", json=body, timeout=10)
        text = r.text
        outcomes.append("error" if r.status_code != 200 or '"error"' in text else "ok")

    short = {**CHAT, "max_tokens": 4}
    d.state.configure(token_delay=0.0)
    pool = gevent.pool.Pool(CONCURRENCY)
    pool.map(call, [short] * 40 + [{**short, "stream": False}] * 40)
    d.state.inject(fail_next=30)
    pool.map(call, [short] * 30)
    d.state.inject(hang_next=20)  # no answer at all: decode first-byte timeout
    pool.map(lambda body: call(body, impatient), [short] * 20)
    d.state.configure(token_delay=1.0)  # first token, then silence: between-chunk timeout
    pool.map(lambda body: call(body, impatient), [{**CHAT, "max_tokens": 3}] * 20)
    assert outcomes.count("ok") == 80 and outcomes.count("error") == 70
    after, waited = settle(ports, baseline)
    print(f"\n150 requests (80 ok, 30 upstream 500, 20 first-byte and 20 chunk timeouts): "
          f"upstream sockets back to {after} (baseline {baseline}) after {waited:.2f} s")
    assert after == baseline
