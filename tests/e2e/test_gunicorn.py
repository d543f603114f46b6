"""The serving path under gunicorn with the gevent worker, as operators run it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time

import pytest
import requests

from tests.helpers import RawStream

pytestmark = pytest.mark.e2e

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "tell me a story"}],
        "temperature": 0}


def roster(prefill, decode, **settings) -> dict:
    return {"settings": settings, "instances": [{"role": "prefill", "url": prefill.url},
                                                {"role": "decode", "url": decode.url}]}


def test_tokens_arrive_one_by_one_through_gunicorn(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--token-delay-ms", "50", "--output-tokens", "20")
    gw = procs["gunicorn"](roster(p, d), "-k", "gevent")
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
    gw = procs["gunicorn"](roster(p, d), "-k", "gevent")
    client = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 400,
                                                        "stream": True})
    client.first_event()
    left_at = time.time()
    client.hang_up()
    deadline = time.monotonic() + 5
    while d.stats()["streams_aborted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = d.stats()
    assert stats["streams_aborted"] == 1
    print(f"\ndecode saw the abort {(stats['last_abort_at'] - left_at) * 1000:.0f} ms after "
          "the client left")
    assert stats["last_abort_at"] - left_at < 1.0
    assert stats["streams_completed"] == 0


def test_decode_failures_through_gunicorn(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--output-tokens", "30")
    gw = procs["gunicorn"](roster(p, d, decode_retries=1), "-k", "gevent")
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
    doc = roster(p, d, probe_interval=0.2, fail_threshold=1)
    doc["instances"].append({"role": "decode", "url": "http://127.0.0.1:9"})
    gw = procs["gunicorn"](doc, "-k", "gevent")
    deadline = time.monotonic() + 10
    evicted: list[str] = []
    while time.monotonic() < deadline:
        evicted = requests.get(gw.url + "/health", timeout=5).json()["instances"]["decode"][
            "evicted"]
        if evicted:
            break
        time.sleep(0.1)
    assert evicted == ["http://127.0.0.1:9"]
    assert requests.get(gw.url + "/ready", timeout=5).status_code == 200


def test_the_repository_config_file_reexports_the_packaged_one(procs) -> None:
    """`gunicorn -c etc/gunicorn.conf.py wsgi:app` still works: the file re-runs the packaged
    configuration (settings and hooks), at start and again when SIGHUP re-reads it."""
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--output-tokens", "4")
    gw = procs["gunicorn"](roster(p, d), "-c", "etc/gunicorn.conf.py")
    ok = requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                       timeout=30)
    assert ok.status_code == 200
    before = gw.workers()
    os.kill(gw.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 15
    while (not gw.workers() or gw.workers() & before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.workers() and not gw.workers() & before, gw.tail()
    assert "roster" in gw.tail() and "reloaded" in gw.tail()
    again = requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                          timeout=30)
    assert again.status_code == 200 and gw.proc.poll() is None
