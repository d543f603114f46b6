"""Every KV connector through gunicorn's gevent worker against simulator processes."""

from __future__ import annotations

import json
import re
import sys
import time

import gevent
import pytest
import requests

from tests.bodies import chat
from tests.e2e.conftest import Process
from tests.helpers import RawStream, eventually, free_port
from tests.rosters import roster

pytestmark = pytest.mark.e2e

CHAT = chat(max_tokens=6, temperature=0)
READY_TIMEOUT = 10.0
# An idle keep-alive connection from this test process would hold gunicorn's graceful stop
# for its whole timeout (the test fixture kills it after 10 s); real clients come and go.
CLOSE = {"Connection": "close"}
P2P_RID = re.compile(r"___prefill_addr_127\.0\.0\.1:21001___decode_addr_127\.0\.0\.1:22001_"
                     r"[0-9a-f]{32}")


def wait_ready(gw) -> None:
    eventually(lambda: requests.get(gw.url + "/ready", timeout=5, headers=CLOSE).status_code
               == 200, READY_TIMEOUT, interval=0.05, what="the gateway ready")


def fleet(procs, connector: str, p_args: tuple[str, ...] = (), d_args: tuple[str, ...] = (),
          bootstrap_port: int | None = None, **settings):
    prefill: dict[str, str] = {}  # the instances' fields beyond role and url
    decode: dict[str, str] = {}
    if connector == "mooncake":
        bootstrap_port = bootstrap_port or free_port()
        p_args = (*p_args, "--bootstrap-port", str(bootstrap_port))
        prefill["bootstrap_url"] = f"http://127.0.0.1:{bootstrap_port}"
    if connector == "p2p_nccl":
        prefill["kv_zmq_addr"], decode["kv_zmq_addr"] = "127.0.0.1:21001", "127.0.0.1:22001"
    p = procs["sim"]("prefill", *p_args)
    d = procs["sim"]("decode", *d_args)
    # /debug/worker: a restarted prefill's new engine ids, as this worker knows them.
    gw = procs["gunicorn"](roster([(p, prefill)], [(d, decode)], connector=connector,
                                  **settings), "-k", "gevent",
                           env={"EPD_DEBUG_ENDPOINTS": "1"})
    wait_ready(gw)
    return p, d, gw


def last_request(sim) -> dict:
    return requests.get(sim.url + "/sim/requests?limit=1", timeout=5).json()[0]


EVIDENCE = {
    "nixl": lambda p, d: d.stats()["kv_handles_valid"] == 2,
    "none": lambda p, d: d.stats()["kv_handles_absent"] == 2
    and "kv_transfer_params" not in last_request(p)["body"],
    "mooncake": lambda p, d: d.stats()["kv_handles_mooncake"] == 2
    and d.stats()["kv_handles_invalid"] == 0,
    "p2p_nccl": lambda p, d: P2P_RID.fullmatch(last_request(p)["headers"]["x-request-id"])
    is not None
    and last_request(d)["headers"]["x-request-id"] == last_request(p)["headers"]["x-request-id"],
}


def stop_all(*processes) -> None:
    gevent.joinall([gevent.spawn(p.stop) for p in processes], timeout=30)


def check_connector(connector: str, p, d, gw) -> None:
    plain = requests.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30,
                          headers=CLOSE)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"]
    assert plain.json()["usage"]["completion_tokens"] == 6
    streamed = requests.post(gw.url + "/v1/chat/completions",
                             json={**CHAT, "stream": True,
                                   "stream_options": {"include_usage": True}}, timeout=30,
                             headers=CLOSE)
    assert streamed.status_code == 200
    events = [e[6:] for e in streamed.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 6
    assert last_request(p)["body"]["max_tokens"] == 1
    assert last_request(p)["body"]["stream"] is False
    assert "stream_options" not in last_request(p)["body"]
    assert EVIDENCE[connector](p, d), connector


def test_every_connector_serves_stream_and_non_stream_through_gunicorn(procs) -> None:
    """Four fleets, one per connector, started side by side to keep the suite quick."""
    names = ["nixl", "none", "mooncake", "p2p_nccl"]
    starting = {name: gevent.spawn(fleet, procs, name) for name in names}
    gevent.joinall(list(starting.values()), raise_error=True, timeout=60)
    fleets = {name: g.value for name, g in starting.items()}
    try:
        for name in names:
            check_connector(name, *fleets[name])
    finally:
        stop_all(*(f[2] for f in fleets.values()))


def test_mooncake_through_gunicorn(procs, tmp_path) -> None:
    """Concurrent legs (TTFT), a client leaving before the first byte, a restarted prefill."""
    delay_ms = 400
    bport = free_port()
    p, d, gw = fleet(procs, "mooncake", ("--ttft-ms", str(delay_ms)),
                     ("--ttft-ms", str(delay_ms)), bootstrap_port=bport,
                     probe_interval=0.3, fail_threshold=1)
    try:
        legs_overlap(p, d, gw, delay_ms)
        client_leaves_early(p, d, gw)
        prefill_restarts(p, d, gw, bport, tmp_path)
    finally:
        stop_all(gw)


def legs_overlap(p, d, gw, delay_ms: int) -> None:
    overlap: list[float] = []

    def watch() -> None:
        while True:
            if p.stats()["in_flight"] and d.stats()["in_flight"]:
                overlap.append(time.monotonic())
            gevent.sleep(0.02)

    watcher = gevent.spawn(watch)
    started = time.monotonic()
    with requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                       stream=True, timeout=30, headers=CLOSE) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith(b"data: "))
        ttft = time.monotonic() - started
    watcher.kill()
    print(f"\nmooncake through gunicorn: TTFT {ttft * 1000:.0f} ms, prefill {delay_ms} ms, "
          f"decode {delay_ms} ms (sum {2 * delay_ms} ms); both legs in flight at "
          f"{len(overlap)} polls")
    assert overlap
    assert delay_ms / 1000 <= ttft < 2 * delay_ms / 1000


def client_leaves_early(p, d, gw) -> None:
    prefill_s = 3.0
    p.control("config", ttft=prefill_s)
    before = p.stats()["requests_aborted"], d.stats()["streams_started"]
    client = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "stream": True})
    eventually(lambda: p.stats()["in_flight"] and d.stats()["in_flight"],
               what="both legs in flight")
    left = time.monotonic()
    client.hang_up()
    eventually(lambda: not (p.stats()["in_flight"] or d.stats()["in_flight"]), prefill_s,
               what="both legs ended before the prefill would have")
    closed_after = time.monotonic() - left
    print(f"client left before decode's first byte: both legs closed {closed_after * 1000:.0f}"
          f" ms later (prefill would have answered after {prefill_s * 1000:.0f} ms)")
    assert p.stats()["requests_aborted"] == before[0] + 1
    assert d.stats()["streams_started"] == before[1]
    p.control("config", ttft=0.0)


def prefill_restarts(p, d, gw, bport: int, tmp_path) -> None:
    """Same ports, new engine ids: found without touching gunicorn."""
    old = p.stats()["engine_id"]
    pulled = d.stats()["kv_handles_mooncake"]
    p.stop()
    again = Process([sys.executable, "-m", "epd_flask.sim.cli", "--role", "prefill", "--port",
                     p.url.rsplit(":", 1)[1], "--bootstrap-port", str(bport)], p.url,
                    log=tmp_path / "sim-prefill-restarted.log")
    try:
        again.wait_up()
        new = again.stats()["engine_id"]
        assert new != old
        rediscovered(gw, p.url, new)
        r = requests.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30,
                          headers=CLOSE)
        assert r.status_code == 200
        assert last_request(d)["body"]["kv_transfer_params"]["remote_engine_id"] == new
        assert d.stats()["kv_handles_mooncake"] == pulled + 1
        assert d.stats()["kv_handles_invalid"] == 0
    finally:
        again.stop()


def rediscovered(gw, prefill_url: str, engine_id: str) -> None:
    eventually(lambda: requests.get(gw.url + "/debug/worker", timeout=5, headers=CLOSE).json()[
        "bootstrap"][prefill_url]["engine_ids"] == [engine_id], READY_TIMEOUT, interval=0.05,
        what=f"{prefill_url} rediscovered as {engine_id}")
