"""epd-flask behind real nginx running the shipped etc/nginx.conf: streaming, aborts, private
admin paths, request ids, and reloads and host stops under load that lose nothing."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.bodies import chat, completion
from tests.e2e.conftest import Launcher, Process
from tests.e2e.edge import Nginx, nginx_binary
from tests.e2e.load import Load, stream_chat
from tests.e2e.test_stalled_readers import LONG_STREAM, WAIT, in_flight, read_rest, stall
from tests.helpers import RawStream, eventually, free_port
from tests.rosters import roster

NGINX = nginx_binary()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.nginx,
    # In CI (.ci/run installs nginx) a missing nginx is a failure, not a skip.
    pytest.mark.skipif(NGINX is None and os.environ.get("CI") != "true",
                       reason="nginx is not installed (Debian: apt-get install nginx; .ci/run "
                       "installs it), so the tests through nginx cannot run"),
]

CHAT = chat(temperature=0)
PRIVATE_PATHS = [
    ("GET", "/instances"), ("POST", "/instances"), ("DELETE", "/instances?url=http://x"),
    ("GET", "/metrics"), ("GET", "/status"), ("POST", "/start_profile"),
    ("POST", "/stop_profile"), ("GET", "/sim/stats"), ("POST", "/v1/load_lora_adapter"),
    # Spellings that nginx normalizes before choosing a location: still private.
    ("GET", "/v1/../instances"), ("GET", "//instances"), ("GET", "/v1/%2e%2e/instances"),
    ("GET", "/%69nstances"), ("GET", "/instances/"),
]
PUBLIC_PATHS = [("GET", "/health"), ("GET", "/healthz"), ("GET", "/ready"), ("GET", "/readyz"),
                ("GET", "/healthcheck"), ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory.mktemp("fleet"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def sims(fleet: Launcher) -> tuple[Process, Process]:
    return fleet.sim("prefill"), fleet.sim("decode", "--output-tokens", "1000")


@pytest.fixture
def decode(sims: tuple[Process, Process]) -> Iterator[Process]:
    """The shared decode, with its per-token delay set by the test and restored after."""
    yield sims[1]
    sims[1].control("config", token_delay=0)
    sims[1].control("faults", drop_after=None, fail_next=0)


@pytest.fixture(scope="module")
def front(fleet: Launcher, sims: tuple[Process, Process],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """nginx in front of one gunicorn (one worker), shared by the read-only tests."""
    gw = fleet.gunicorn(roster([sims[0]], [sims[1]]))
    edge = Nginx(NGINX, tmp_path_factory.mktemp("nginx"), [gw.url.removeprefix("http://")])
    yield edge
    edge.stop()


@pytest.fixture
def stack(tmp_path: Path, sims: tuple[Process, Process]) -> Iterator[dict[str, Callable]]:
    """Per test: gunicorn "hosts" and an nginx over them; nginx stops first, so the hosts'
    workers are not held by its idle keep-alive connections."""
    launcher = Launcher(tmp_path)
    edges: list[Nginx] = []

    def host(workers: int = 1) -> Process:
        return launcher.gunicorn(roster([sims[0]], [sims[1]]), workers=workers)

    def nginx(urls: list[str]) -> Nginx:
        edges.append(Nginx(NGINX, tmp_path / f"nginx-{len(edges)}",
                           [u.removeprefix("http://") for u in urls]))
        return edges[-1]

    yield {"host": host, "nginx": nginx}
    for edge in edges:
        edge.stop()
    launcher.stop_all()


def raw_request(url: str, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
    """Send ``path`` byte for byte (requests would normalize the dot segments itself)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=b"{}" if method == "POST" else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


# -- through one nginx, one host ------------------------------------------------------------

def test_stream_arrives_token_by_token_through_nginx(front: Nginx, decode: Process) -> None:
    decode.control("config", token_delay=0.05)
    before = decode.stats()
    arrivals: list[float] = []
    decode_running_at_first_event = None
    with requests.post(front.url + "/v1/chat/completions", stream=True, timeout=30,
                       json={**CHAT, "max_tokens": 20, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 1:
                # The first event is in our hands while decode is still generating the rest.
                now = decode.stats()
                decode_running_at_first_event = (
                    now["streams_started"] == before["streams_started"] + 1
                    and now["streams_completed"] == before["streams_completed"])
            last = line
    assert last == b"data: [DONE]"
    assert decode_running_at_first_event is True
    assert decode.stats()["streams_completed"] == before["streams_completed"] + 1
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # 20 tokens 50 ms apart arrive as 20+ separate events, not one buffered burst.
    assert sum(g > 0.025 for g in gaps) >= 15, gaps
    print(f"\nthrough nginx: {len(arrivals)} events, first->last "
          f"{(arrivals[-1] - arrivals[0]) * 1000:.0f} ms, median gap "
          f"{sorted(gaps)[len(gaps) // 2] * 1000:.1f} ms")


def test_client_disconnect_at_nginx_aborts_decode(front: Nginx, decode: Process) -> None:
    decode.control("config", token_delay=0.05)
    before = decode.stats()
    client = RawStream(front.url, "/v1/chat/completions",
                       {**CHAT, "max_tokens": 400, "stream": True})
    client.first_event()
    left_at = time.time()
    client.hang_up()
    eventually(lambda: decode.stats()["streams_aborted"] != before["streams_aborted"])
    after = decode.stats()
    assert after["streams_aborted"] == before["streams_aborted"] + 1
    assert after["streams_completed"] == before["streams_completed"]
    print(f"\ndecode saw the abort {(after['last_abort_at'] - left_at) * 1000:.0f} ms after "
          "the client left nginx")
    # 400 tokens at 50 ms would take 20 s: the abort came from the hang-up, not the end.
    assert after["last_abort_at"] - left_at < 2.0


def test_a_client_that_stops_reading_at_nginx_frees_its_decode(tmp_path: Path) -> None:
    """nginx stops reading gunicorn when its client stops reading (unbuffered), so
    EPD_CLIENT_WRITE_TIMEOUT ends the stream and its decode behind nginx as it does without
    it, before nginx's own send_timeout."""
    launcher = Launcher(tmp_path)
    edge = None
    try:
        sim = launcher.sim("prefill_decode", *LONG_STREAM)
        gw = launcher.gunicorn(
            {"settings": {}, "instances": [{"role": "prefill_decode", "url": sim.url}]},
            env={"EPD_CLIENT_WRITE_TIMEOUT": "2"})
        edge = Nginx(NGINX, tmp_path / "nginx", [gw.url.removeprefix("http://")])
        sock = stall(edge.url)
        try:
            assert eventually(lambda: sim.stats()["streams_aborted"] == 1, WAIT), sim.stats()
            assert eventually(lambda: in_flight(gw.url) == 0, WAIT)
            rest, _ = read_rest(sock)
            assert b"[DONE]" not in rest
            assert sim.stats()["streams_completed"] == 0
        finally:
            sock.close()
    finally:
        if edge is not None:
            edge.stop()
        launcher.stop_all()


@pytest.mark.parametrize(("method", "path"), PRIVATE_PATHS)
def test_admin_and_unlisted_paths_are_404_through_nginx(front: Nginx, method: str,
                                                        path: str) -> None:
    status, body, headers = raw_request(front.url, method, path)
    assert status == 404
    assert json.loads(body)["error"]["code"] == "not_found"
    assert headers["X-Request-Id"]


@pytest.mark.parametrize(("method", "path"), PUBLIC_PATHS)
def test_serving_and_health_paths_are_published(front: Nginx, method: str, path: str) -> None:
    status, body, _ = raw_request(front.url, method, path)
    assert status == 200, body
    if path in ("/health", "/healthz"):
        assert json.loads(body)["instances"]["decode"]["live"]


def test_request_id_is_passed_or_generated(front: Nginx, sims: tuple[Process, Process]) -> None:
    decode = sims[1]
    mine = requests.post(front.url + "/v1/completions", timeout=30,
                         headers={"X-Request-Id": "client-id-42"},
                         json=completion("hi", max_tokens=2))
    assert mine.status_code == 200 and mine.headers["X-Request-Id"] == "client-id-42"
    theirs = requests.post(front.url + "/v1/completions", timeout=30,
                           json=completion("hi", max_tokens=2))
    generated = theirs.headers["X-Request-Id"]
    # nginx's $request_id (32 hex digits), which epd-flask kept for the client and its logs;
    # decode got epd-flask's own id for each request instead.
    assert len(generated) == 32 and int(generated, 16) >= 0
    seen = [r["headers"].get("x-request-id") for r in requests.get(
        decode.url + "/sim/requests?limit=20", timeout=5).json()]
    assert "client-id-42" not in seen and generated not in seen


def test_no_reachable_host_is_a_json_502(stack: dict[str, Callable]) -> None:
    edge = stack["nginx"]([f"http://127.0.0.1:{free_port()}" for _ in range(2)])
    r = requests.post(edge.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                      timeout=30)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert r.headers["X-Request-Id"]


# -- under load --------------------------------------------------------------------------------

#: How long a wait under load (workers forked, streams done) may take.
LOAD_WAIT = 15.0


def test_sighup_under_load_through_nginx_loses_nothing(stack: dict[str, Callable],
                                                       decode: Process) -> None:
    decode.control("config", token_delay=0.01)
    gw = stack["host"](workers=2)
    edge = stack["nginx"]([gw.url])
    old = eventually(lambda: gw.workers() if len(gw.workers()) == 2 else None, LOAD_WAIT,
                     what="two workers")
    with Load(edge.url, clients=8, max_tokens=12) as load:
        # Streams of ~1.5 s that are open while the workers are replaced.
        spanning = load.spawn_streams(3, max_tokens=150)
        eventually(lambda: load.completed >= 10, LOAD_WAIT, what="10 streams done")
        hup_at = time.monotonic()
        os.kill(gw.proc.pid, signal.SIGHUP)
        new = eventually(lambda: (gw.workers() - old
                                  if len(gw.workers() - old) == 2 else None), LOAD_WAIT,
                         what="two new workers")
        load.mark("after reload")
        eventually(lambda: load.completed_since("after reload") >= 40, LOAD_WAIT,
                   what="40 streams done after the reload")
    spanning_results = [g.value for g in spanning]
    print(f"\nSIGHUP through nginx: {load.summary()}; new workers {sorted(new)} forked "
          f"{(load.marks['after reload'] - hup_at) * 1000:.0f} ms after the signal; "
          f"{len(spanning_results)} streams spanning the reload: {spanning_results}")
    assert load.failed == [] and load.truncated == []
    assert spanning_results == ["ok"] * 3
    assert load.completed_since("after reload") >= 40


def test_one_of_two_hosts_stopped_mid_load_fails_nothing(stack: dict[str, Callable],
                                                         decode: Process) -> None:
    decode.control("config", token_delay=0.01)
    a, b = stack["host"](), stack["host"]()
    edge = stack["nginx"]([a.url, b.url])
    with Load(edge.url, clients=8, max_tokens=12) as load:
        spanning = load.spawn_streams(4, max_tokens=150)
        eventually(lambda: load.completed >= 20, LOAD_WAIT, what="20 streams done")
        b.terminate()  # SIGTERM to b's master: a graceful stop
        load.mark("after stop")
        # b no longer accepts connections: nginx must send new requests to a.
        eventually(lambda: not reachable(b.url), what="b stopped")
        eventually(lambda: load.completed_since("after stop") >= 60, LOAD_WAIT,
                   what="60 streams done after the stop")
    spanning_results = [g.value for g in spanning]
    stopped = b.url.removeprefix("http://")
    retried = [line for line in edge.errors().splitlines()
               if "[error]" in line and f"upstream: \"http://{stopped}/" in line]
    print(f"\none of two hosts stopped: {load.summary()}; nginx met {len(retried)} "
          f"failed connection(s) to the stopped host and resent them; streams open across the "
          f"stop: {spanning_results}")
    assert load.failed == [] and load.truncated == []
    assert spanning_results == ["ok"] * 4
    assert load.completed_since("after stop") >= 60
    assert len(retried) >= 1, edge.errors()[-2000:]


def reachable(url: str) -> bool:
    try:
        requests.get(url + "/health", timeout=1)
        return True
    except requests.ConnectionError:
        return False


def test_load_helper_notices_a_truncated_stream(front: Nginx, decode: Process) -> None:
    """The load's checks can fail: a stream cut mid-way is counted as truncated."""
    decode.control("faults", drop_after=3)
    assert stream_chat(requests.Session(), front.url, 10) != "ok"
