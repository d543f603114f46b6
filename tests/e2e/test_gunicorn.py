"""The serving path under gunicorn with the gevent worker, as operators run it."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from epd_flask.web import collector
from tests.bodies import chat
from tests.helpers import RawStream, eventually, free_port, instances
from tests.rosters import roster

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e

CHAT = chat(temperature=0)


def test_tokens_arrive_one_by_one_through_gunicorn(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--token-delay-ms", "50", "--output-tokens", "20")
    gw = procs["gunicorn"](roster([p], [d]), "-k", "gevent")
    body = {**CHAT, "max_tokens": 20, "stream": True}
    arrivals: list[float] = []
    saw_running_decode = False
    with requests.post(gw.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["X-Accel-Buffering"] == "no"
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 2:
                # The first content token is in our hands while decode is still generating.
                saw_running_decode = d.stats()["streams_completed"] == 0
            last = line
    assert last == b"data: [DONE]"
    assert saw_running_decode
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # 20 tokens relayed as 20+ separate arrivals, not one buffered burst: most gaps are a
    # sizeable fraction of the decode's per-token delay.
    assert sum(g > 0.025 for g in gaps) >= 15, gaps
    print(f"\nchunk gaps through gunicorn: median {sorted(gaps)[len(gaps) // 2] * 1000:.1f} ms, "
          f"first->last {(arrivals[-1] - arrivals[0]) * 1000:.0f} ms over {len(arrivals)} events")


def test_client_disconnect_reaches_decode_through_gunicorn(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--token-delay-ms", "50", "--output-tokens", "400")
    gw = procs["gunicorn"](roster([p], [d]), "-k", "gevent")
    client = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 400,
                                                        "stream": True})
    client.first_event()
    left_at = time.time()
    client.hang_up()
    eventually(lambda: d.stats()["streams_aborted"])
    stats = d.stats()
    assert stats["streams_aborted"] == 1
    print(f"\ndecode saw the abort {(stats['last_abort_at'] - left_at) * 1000:.0f} ms after "
          "the client left")
    assert stats["last_abort_at"] - left_at < 1.0
    assert stats["streams_completed"] == 0


@pytest.mark.parametrize("worker", [None, "gevent", "gunicorn.workers.ggevent.GeventPyWSGIWorker"])
def test_client_leaving_a_non_stream_request_aborts_decode_through_gunicorn(
        procs, worker: str | None) -> None:
    """Before any byte of the answer: gunicorn's workers (ours by default, the stock gevent
    one, the pywsgi one) give the proxy the client's socket, which it watches while decode
    computes."""
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--ttft-ms", "5000")
    gw = procs["gunicorn"](roster([p], [d]), *(("-k", worker) if worker else ()))
    client = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 8})
    eventually(lambda: d.stats()["in_flight"])
    time.sleep(0.3)
    left_at = time.time()
    client.hang_up()
    eventually(lambda: d.stats()["requests_aborted"])
    stats = d.stats()
    assert stats["requests_aborted"] == 1
    print(f"\n{worker}: decode saw the abort {(stats['last_abort_at'] - left_at) * 1000:.0f} "
          "ms after the client left")
    assert stats["last_abort_at"] - left_at < 1.0


def test_decode_failures_through_gunicorn(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--output-tokens", "30")
    gw = procs["gunicorn"](roster([p], [d], decode_retries=1), "-k", "gevent")
    d.control("faults", fail_next=1)
    ok = requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5},
                       timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    d.control("faults", drop_after=4)
    cut = requests.post(gw.url + "/v1/chat/completions",
                        json={**CHAT, "max_tokens": 30, "stream": True}, timeout=30)
    events = [e for e in cut.text.split("\n\n") if e.startswith("data: ")]
    assert json.loads(events[-1][6:])["error"]["code"] == "stream_interrupted"
    before = p.stats()["completions"], d.stats()["completions"]
    bad = requests.post(gw.url + "/v1/chat/completions", data=b"[1,2]", timeout=30,
                        headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert (p.stats()["completions"], d.stats()["completions"]) == before


def test_plain_gunicorn_command_runs_hooks_and_probes(procs) -> None:
    """`gunicorn -k gevent wsgi:app` from the project root, no other flags: the config file
    is found, workers start their probes, and a dead instance is evicted with no traffic."""
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode")
    doc = roster([p], [d], probe_interval=0.2, fail_threshold=1)
    doc["instances"].append({"role": "decode", "url": "http://127.0.0.1:9"})
    gw = procs["gunicorn"](doc, "-k", "gevent")
    evicted = eventually(lambda: instances(gw.url, "decode", live=False), 10, interval=0.1)
    assert evicted == {"http://127.0.0.1:9"}
    assert requests.get(gw.url + "/ready", timeout=5).status_code == 200


def test_each_worker_sets_its_collector_up_at_start(procs) -> None:
    """The app, its services and their greenlets live as long as the worker: before it serves,
    the worker moves them out of the collector's generations, so no collection under 500
    streams walks them again (docs/benchmarks.md#what-bounds-the-make-bench-figures), sets
    its own thresholds, and collects the young generations on a clock, idle or not."""
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode")
    gw = procs["gunicorn"](roster([p], [d]), "-k", "gevent", env={"EPD_DEBUG_ENDPOINTS": "1"})
    before = requests.get(gw.url + "/debug/worker", timeout=5).json()
    assert before["gc_frozen"] > 10_000
    assert before["gc_thresholds"] == list(collector.THRESHOLDS) != list(gc.get_threshold())
    time.sleep(10 * collector.YOUNG_EVERY)
    after = requests.get(gw.url + "/debug/worker", timeout=5).json()
    assert after["pid"] == before["pid"]
    assert after["gc_collections"][1] - before["gc_collections"][1] >= 3


def test_the_repository_config_file_reexports_the_packaged_one(procs) -> None:
    """`gunicorn -c etc/gunicorn.conf.py wsgi:app` still works: the file re-runs the packaged
    configuration (settings and hooks), at start and again when SIGHUP re-reads it."""
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--output-tokens", "4")
    gw = procs["gunicorn"](roster([p], [d]), "-c", "etc/gunicorn.conf.py")
    ok = requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                       timeout=30)
    assert ok.status_code == 200
    before = gw.workers()
    os.kill(gw.proc.pid, signal.SIGHUP)
    eventually(lambda: gw.workers() and not gw.workers() & before, 15, interval=0.05,
               what=lambda: f"the workers replaced: {gw.tail()}")
    assert "roster" in gw.tail() and "reloaded" in gw.tail()
    again = requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                          timeout=30)
    assert again.status_code == 200 and gw.proc.poll() is None


def _unwritable(folder: Path) -> None:
    """Make ``folder`` unwritable for this process, as a read-only mount is: permissions for
    an ordinary user; for root (which ignores them) the immutable attribute."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
    if done.returncode != 0 or os.access(folder, os.W_OK):
        pytest.skip(f"cannot make a directory unwritable for root here: {done.stderr!r}")


def _writable(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
    folder.chmod(0o755)


def test_admin_api_over_a_read_only_roster_refuses_to_start(tmp_path) -> None:
    """The Kubernetes example mounts its roster (a ConfigMap) read-only; with ADMIN_API_KEY
    set there, every registration would fail. gunicorn refuses to start instead, before it
    listens, naming the setting, the directory and the fix; without the key the same
    read-only roster is served, and so it is with the key when the roster names an etcd store,
    which the admin API writes instead (docs/behaviour.md#discovery). The roster is the
    example's own."""
    configmap = yaml.safe_load((ROOT / "etc" / "k8s" / "configmap.yaml").read_text())
    folder = tmp_path / "roster"
    folder.mkdir()
    roster_file = folder / "roster.yaml"
    roster_file.write_text(configmap["data"]["roster.yaml"])
    _unwritable(folder)
    try:
        port = free_port()
        env = {**os.environ, "EPD_ROSTER": str(roster_file), "PORT": str(port),
               "EPD_WORKERS": "1", "EPD_STATE_DIR": str(tmp_path / "state"),
               "ADMIN_API_KEY": "k8s-admin-key-0123456789"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        done = subprocess.run([sys.executable, "-m", "gunicorn", "wsgi:app"], cwd=ROOT,
                              env=env, capture_output=True, timeout=60, check=False)
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        assert done.returncode != 0, out[-2000:]
        assert "ADMIN_API_KEY" in out and f"{folder} is not writable" in out, out
        assert "Listening at" not in out
        key = env.pop("ADMIN_API_KEY")
        with _serving(env, port, "the read-only roster without the admin API"):
            pass
        # With an etcd store the admin API writes to etcd, not the file: it may be on. etcd
        # is not running here, which the admin API says.
        _writable(folder)
        doc = yaml.safe_load(configmap["data"]["roster.yaml"])
        doc["discovery"] = {"etcd": {"endpoints": [f"http://127.0.0.1:{free_port()}"],
                                     "prefix": "/k8s/"}}
        roster_file.write_text(yaml.safe_dump(doc))
        _unwritable(folder)
        with _serving({**env, "ADMIN_API_KEY": key}, port,
                      "the read-only roster with the admin API writing to etcd"):
            answer = requests.post(f"http://127.0.0.1:{port}/instances",
                                   json={"role": "decode", "url": "http://127.0.0.1:9"},
                                   headers={"X-API-Key": key}, timeout=30)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "membership_store_unavailable"
    finally:
        _writable(folder)


@contextlib.contextmanager
def _serving(env: dict[str, str], port: int, what: str) -> Iterator[None]:
    """gunicorn on ``env`` until it answers /health, then SIGTERM once the block is done."""
    with subprocess.Popen([sys.executable, "-m", "gunicorn", "wsgi:app"], cwd=ROOT,
                          env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True) as proc:
        try:
            def up() -> bool:
                assert proc.poll() is None, f"gunicorn exited: {what}"
                return requests.get(f"http://127.0.0.1:{port}/health",
                                    timeout=1).status_code == 200
            eventually(up, 20, interval=0.05, ignoring=(requests.RequestException,),
                       what=f"gunicorn serving {what}")
            yield
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # leave nothing behind to wait for
                os.killpg(proc.pid, signal.SIGKILL)
                raise


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        line_end = body.index(b"\r\n", pos)
        size = int(body[pos:line_end], 16)
        if size == 0:
            return bytes(out)
        out += body[line_end + 2:line_end + 2 + size]
        assert body[line_end + 2 + size:line_end + 4 + size] == b"\r\n"
        pos = line_end + 4 + size


def test_a_client_that_stops_reading_gets_the_whole_stream_after(procs) -> None:
    """The worker's writes (one plain send per event, gevent's sendall for what a full
    buffer leaves) deliver every event whole and in order to a client whose receive window
    is tiny and who reads nothing for a second while ~3 MB are produced: more than the
    socket buffers take, so a send comes back short and gevent's sendall waits for the rest."""
    tokens = 2000
    p = procs["sim"]("prefill", "--max-model-len", "4096")
    d = procs["sim"]("decode", "--max-model-len", "4096", "--output-tokens", str(tokens))
    gw = procs["gunicorn"](roster([p], [d]))
    body = {**CHAT, "max_tokens": tokens, "stream": True, "logprobs": True, "top_logprobs": 20}
    reference = requests.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(payload), payload))
    time.sleep(1.0)
    raw = b""
    while data := sock.recv(65536):
        raw += data
    sock.close()
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    events = _dechunk(chunked).split(b"\n\n")
    assert events.pop() == b"" and events.pop() == b"data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events
             if json.loads(e[6:])["choices"]]
    want = [json.loads(e[6:])["choices"][0]["delta"].get("content", "")
            for e in reference.content.split(b"\n\n")
            if e.startswith(b"data: {") and json.loads(e[6:])["choices"]]
    assert len(raw) > 3_000_000
    assert texts == want and len(texts) >= tokens
