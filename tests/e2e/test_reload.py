"""Live reconfiguration through real gunicorn (2 gevent workers) and simulator processes:
roster edits + SIGHUP under stream load, a decode that dies and comes back, and instances
registered through the admin API."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import gevent
import pytest
import requests
import yaml

from epd_flask.core.errors import instance_label
from tests.bodies import chat_stream
from tests.helpers import eventually, sample, scrape
from tests.rosters import roster

pytestmark = pytest.mark.e2e

CHAT = chat_stream(temperature=0)
DECODE_ARGS = ("--token-delay-ms", "10", "--output-tokens", "400", "--record-limit", "5000")
SHORT_TOKENS = 20  # ~0.2 s per stream
LONG_TOKENS = 150  # ~1.5 s: straddles a reload
#: ~8 s at 20 ms a token: still draining on an old worker after its successors booted on a
#: loaded machine.
DRAINED_TOKENS = 400
#: How long a wait on the gateway (ready, a log line, traffic) may take.
WAIT = 10.0
KEY = "e2e-admin-key"
# Ours: "2026-01-01 10:00:00,123 [pid] ..."; gunicorn's: "[2026-01-01 10:00:00 +0000] [pid] ..."
LOG_TIME = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,(\d{3})| [+-]\d{4}\])"
                      r" \[(\d+)\]")


def stream(session: requests.Session, url: str, tokens: int) -> dict[str, Any]:
    """One streamed chat completion, judged as a client would: status, [DONE], every token."""
    out: dict[str, Any] = {"ok": False, "complete": False, "error": None,
                           "started": time.time()}
    try:
        with session.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": tokens},
                          stream=True, timeout=30) as r:
            out["status"] = r.status_code
            events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    except requests.RequestException as exc:
        out["error"] = repr(exc)
        return out
    out["ok"] = out["status"] == 200
    if not events or events[-1] != b"[DONE]":
        out["error"] = f"stream ended without [DONE]: {events[-1:]!r}"
        return out
    chunks = [json.loads(e) for e in events[:-1]]
    text = [c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices")]
    out["complete"] = sum(1 for t in text if t) == tokens \
        and chunks[-1]["choices"][0]["finish_reason"] == "length"
    if not out["complete"]:
        out["error"] = f"truncated: {len(text)} chunks for {tokens} tokens"
    return out


class Load:
    """Clients streaming short answers back to back, each over its own kept-alive
    connection (as nginx would), until stopped; bounded in count."""

    def __init__(self, url: str, clients: int = 4, max_each: int = 2000) -> None:
        self.url = url
        self.results: list[dict[str, Any]] = []
        self._stop = False
        self._greenlets = [gevent.spawn(self._client, max_each) for _ in range(clients)]

    def _client(self, max_each: int) -> None:
        with requests.Session() as session:
            for _ in range(max_each):
                if self._stop:
                    return
                self.results.append(stream(session, self.url, SHORT_TOKENS))

    def stop(self) -> list[dict[str, Any]]:
        self._stop = True
        gevent.joinall(self._greenlets, timeout=30)
        return self.results


def call(method: str, url: str, **kw: Any) -> tuple[int, Any]:
    """One request on a session closed right after: a client connection left idle would keep
    a gevent worker alive through a graceful stop for up to gunicorn's keepalive."""
    with requests.Session() as s:
        r = s.request(method, url, timeout=5, **kw)
        return r.status_code, r.json()


def completion_times(sim: Any) -> list[float]:
    records = requests.get(sim.url + "/sim/requests", timeout=5).json()
    return [r["time"] for r in records if r["path"] == "/v1/chat/completions"]


def log_lines(proc: Any, *words: str) -> list[tuple[float, int, str]]:
    """(time, pid, line) of our own log lines containing every word."""
    out = []
    for line in proc.log.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if m and all(w in line for w in words):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            out.append((at + int(m.group(2) or 0) / 1000, int(m.group(3)), line))
    return out


def write_roster(path: Path, doc: dict[str, Any]) -> None:
    path.write_text("# e2e roster\n" + yaml.safe_dump(doc))


def test_reload_under_stream_load(procs, tmp_path) -> None:
    """Three edits + SIGHUP while clients stream: add a decode, remove a decode, a broken
    file. Nothing fails or is cut, routing follows each good edit, the bad one is ignored."""
    p = procs["sim"]("prefill")
    d1, d2, d3 = (procs["sim"]("decode", *DECODE_ARGS) for _ in range(3))
    roster_file = tmp_path / "roster.yaml"
    settings = {"probe_interval": 0.5, "fail_threshold": 2}
    write_roster(roster_file, roster([p], [d1, d2], **settings))
    gw = procs["gunicorn"](None, roster_file=roster_file, workers=2)
    eventually(lambda: requests.get(gw.url + "/ready", timeout=5).ok, WAIT, what="ready")
    master = gw.proc.pid
    load = Load(gw.url)
    long_results: list[dict[str, Any]] = []

    def long_streams(n: int, on: Any = None) -> list[gevent.Greenlet]:
        """Start long streams, at least one on ``on`` (bounded tries), before a reload."""
        started: list[gevent.Greenlet] = []
        for _ in range(24):  # round robin over 3 decodes: one lands on ``on`` soon
            g = gevent.spawn(lambda: long_results.append(
                stream(requests.Session(), gw.url, LONG_TOKENS)))
            started.append(g)
            time.sleep(0.15)
            if len(started) >= n and (on is None or on.stats()["in_flight"] > 0):
                break
        if on is not None:
            assert on.stats()["in_flight"] > 0, "no long stream landed on the instance"
        return started

    time.sleep(0.5)
    # 1: add d3.
    longs = long_streams(2)
    write_roster(roster_file, roster([p], [d1, d2, d3], **settings))
    hup1 = time.time()
    os.kill(master, signal.SIGHUP)
    first_d3 = eventually(lambda: completion_times(d3), WAIT,
                          what="traffic on the added decode")[0]
    gevent.joinall(longs, timeout=30)
    # 2: remove d1 while a long stream runs on it.
    longs = long_streams(2, on=d1)
    write_roster(roster_file, roster([p], [d2, d3], **settings))
    hup2 = time.time()
    os.kill(master, signal.SIGHUP)
    gevent.joinall(longs, timeout=30)
    time.sleep(0.5)
    d1_after_settle = d1.stats()["streams_started"]
    # 3: a broken file.
    longs = long_streams(2)
    roster_file.write_text("instances:\n  - {role: decode, url: 'http://127.0.0.1:1', "
                           "dp_sise: 2}\n")
    hup3 = time.time()
    os.kill(master, signal.SIGHUP)
    rejected = eventually(lambda: log_lines(gw, "REJECTED"), WAIT, what="the rejection in the log")
    seen_rejected = time.time()
    gevent.joinall(longs, timeout=30)
    mark = time.time()
    time.sleep(1.0)
    results = load.stop()

    failed = [r for r in results + long_results if not (r["ok"] and r["complete"])]
    assert not failed, (len(failed), failed[:5])
    assert len(long_results) >= 6
    assert gw.proc.poll() is None, "the master must survive the broken roster"
    # The added decode got traffic; the removed one got none after the reload settled, yet
    # the stream it carried when it was removed finished in full (counted above).
    assert first_d3 > hup1
    last_d1 = max(completion_times(d1))
    assert d1.stats()["streams_started"] == d1_after_settle, \
        f"the removed decode got new streams after the reload (last at {last_d1 - hup2:.3f} s)"
    assert d1.stats()["streams_completed"] == d1.stats()["streams_started"]
    # The broken file was reported with the validation message and ignored: the last good
    # roster (d2 + d3) still serves after it.
    assert "dp_sise" in rejected[0][2] and "unknown key" in rejected[0][2]
    assert any(t > mark for t in completion_times(d2))
    assert any(t > mark for t in completion_times(d3))
    # The master counted both applied reloads and the refused one, and a worker shows them
    # (gunicorn may re-read a file changed before its queued reload ran: at least, then).
    samples = scrape(gw.url)
    applied = sample(samples, "epd_roster_reloads_total", source="sighup", outcome="ok")
    refused = sample(samples, "epd_roster_reloads_total", source="sighup", outcome="rejected")
    assert applied >= 2 and refused >= 1, (applied, refused)
    workers = {pid for _, pid, _ in log_lines(gw, "epd_flask.")} - {master}
    print(f"\n{len(results)} short + {len(long_results)} long streams, 0 failed, 0 truncated; "
          f"{len(workers)} worker pids over 3 reloads"
          f"\nSIGHUP -> first request on the added decode: {first_d3 - hup1:.3f} s"
          f"\nSIGHUP -> last new request on the removed decode: {last_d1 - hup2:.3f} s"
          f"\nSIGHUP -> broken roster rejected in the log: <= {seen_rejected - hup3:.3f} s"
          f"\nepd_roster_reloads_total sighup: ok={applied:g} rejected={refused:g}")


def test_dead_decode_is_evicted_then_rejoins(procs, tmp_path) -> None:
    """Kill a decode: each worker stops routing to it after at most fail_threshold failed
    attempts (passive signals and probes alike); restart it: it rejoins on the next probe."""
    p = procs["sim"]("prefill")
    d1, d2 = procs["sim"]("decode", *DECODE_ARGS), procs["sim"]("decode", *DECODE_ARGS)
    interval, threshold = 0.5, 3
    roster_file = tmp_path / "roster.yaml"
    write_roster(roster_file, roster([p], [d1, d2], probe_interval=interval,
                                     fail_threshold=threshold, decode_retries=1))
    gw = procs["gunicorn"](None, roster_file=roster_file, workers=2)
    eventually(lambda: requests.get(gw.url + "/ready", timeout=5).ok, WAIT, what="ready")
    load = Load(gw.url, clients=4)
    time.sleep(0.5)
    port = int(d1.url.rsplit(":", 1)[1])
    killed = time.time()
    os.killpg(d1.proc.pid, signal.SIGKILL)
    d1.proc.wait(5)
    evictions = eventually(lambda: (lines := log_lines(gw, "evicted", d1.url)) and
                           len({pid for _, pid, _ in lines}) == 2 and lines,
                           WAIT, what="eviction in both workers")
    offset = len(log_lines(gw, "attempt 1 failed", d1.url))
    time.sleep(1.0)
    routed_after = log_lines(gw, "attempt 1 failed", d1.url)[offset:]
    d1b = procs["sim"]("decode", *DECODE_ARGS, port=port)
    restarted = time.time()  # answering /health from now on
    rejoins = eventually(lambda: (lines := log_lines(gw, "rejoined", d1.url)) and
                         len({pid for _, pid, _ in lines}) == 2 and lines,
                         WAIT, what="rejoin in both workers")
    eventually(lambda: completion_times(d1b), WAIT, what="traffic on the restarted decode")
    results = load.stop()

    # Only streams the killed decode was generating when it died may end early (in band,
    # as stream_interrupted); every other request succeeds, retried elsewhere if need be.
    cut = [r for r in results if not (r["ok"] and r["complete"])]
    assert all(r["started"] < killed and "stream_interrupted" in r["error"]
               and instance_label(d1.url) in r["error"] for r in cut), cut
    assert len(cut) <= 4
    assert routed_after == []
    attempts = log_lines(gw, "attempt 1 failed", d1.url)
    for pid in {pid for _, pid, _ in evictions}:
        mine = [line for _, q, line in attempts if q == pid]
        # Passive signals count like failed probes: a worker stops after the threshold
        # (plus requests it had already routed when the threshold was reached).
        assert len(mine) <= threshold + 3, mine
    evicted_in = [t - killed for t, _, _ in evictions]
    rejoined_in = [t - restarted for t, _, _ in rejoins]
    met = [sum(1 for _, q, _ in attempts if q == pid) for pid in {e[1] for e in evictions}]
    print(f"\n{len(results)} requests, {len(cut)} cut by the kill; requests that met the "
          f"dead decode per worker: {met}"
          f" (threshold {threshold}); kill -> evicted: "
          f"{', '.join(f'{t:.3f}' for t in evicted_in)} s (threshold x interval = "
          f"{threshold * interval:g} s); restart -> rejoined: "
          f"{', '.join(f'{t:.3f}' for t in rejoined_in)} s (interval {interval:g} s)")


def test_admin_registration_reaches_every_worker_and_survives_restart(procs, tmp_path) -> None:
    p = procs["sim"]("prefill")
    d1, d2 = procs["sim"]("decode", *DECODE_ARGS), procs["sim"]("decode", *DECODE_ARGS)
    roster_file = tmp_path / "roster.yaml"
    write_roster(roster_file, roster([p], [d1], probe_interval=0.5))
    env = {"ADMIN_API_KEY": KEY}
    gw = procs["gunicorn"](None, roster_file=roster_file, workers=2, env=env)
    auth = {"X-API-Key": KEY}
    status, _ = call("POST", gw.url + "/instances", json={"role": "decode", "url": d2.url},
                     headers={"X-API-Key": "wrong"})
    assert status == 403
    posted = time.time()
    status, doc = call("POST", gw.url + "/instances", json={"role": "decode", "url": d2.url},
                       headers=auth)
    assert status == 201, doc
    took_it = doc["worker"]

    def both_workers_routed() -> dict[int, float]:
        first: dict[int, float] = {}
        for t, pid, _ in log_lines(gw, "request_id=", f"decode={d2.url}"):
            first.setdefault(pid, t)
        return first if len(first) == 2 else {}

    def fresh_stream() -> dict[str, Any]:  # a new connection, so the kernel picks a worker
        with requests.Session() as s:
            return stream(s, gw.url, 4)

    first: dict[int, float] = {}
    for _ in range(40):  # a few requests at a time until both workers used d2
        gevent.joinall([gevent.spawn(fresh_stream) for _ in range(4)])
        first = both_workers_routed()
        if first:
            break
    assert len(first) == 2, "both workers must route to the registered instance"
    other = next(pid for pid in first if pid != took_it)
    assert "# e2e roster" in roster_file.read_text()
    assert d2.url in roster_file.read_text()

    procs_before = d2.stats()["streams_started"]
    gw.stop()
    gw2 = procs["gunicorn"](None, roster_file=roster_file, workers=2, env=env)
    _, listed = call("GET", gw2.url + "/instances", headers=auth)
    assert d2.url in [row["url"] for row in listed["data"]]
    eventually(lambda: requests.get(gw2.url + "/ready", timeout=5).ok, WAIT, what="ready")
    with requests.Session() as s:
        for _ in range(6):
            assert stream(s, gw2.url, 4)["complete"]
    assert d2.stats()["streams_started"] > procs_before
    print(f"\nPOST /instances -> first request routed to it by the worker that took the "
          f"call: {first[took_it] - posted:.3f} s, by the other worker: "
          f"{first[other] - posted:.3f} s; still registered after a gunicorn restart")


def test_an_edit_applies_while_an_earlier_reload_still_drains(procs, tmp_path) -> None:
    """gunicorn's master waits in its reload until the old workers have finished their
    streams (up to graceful_timeout) before it handles the next signal. A second edit +
    SIGHUP must still reach the workers at once, not when the long stream ends."""
    p = procs["sim"]("prefill")
    d1 = procs["sim"]("decode", "--token-delay-ms", "20", "--output-tokens", str(DRAINED_TOKENS),
                      "--record-limit", "5000")
    d2 = procs["sim"]("decode", *DECODE_ARGS)
    roster_file = tmp_path / "roster.yaml"
    write_roster(roster_file, roster([p], [d1], probe_interval=0.5))
    gw = procs["gunicorn"](None, roster_file=roster_file, workers=2)
    eventually(lambda: requests.get(gw.url + "/ready", timeout=5).ok, WAIT, what="ready")
    long_done: list[float] = []

    def long_stream() -> None:
        with requests.Session() as s:
            assert stream(s, gw.url, DRAINED_TOKENS)["complete"]
        long_done.append(time.time())

    g = gevent.spawn(long_stream)
    eventually(lambda: d1.stats()["in_flight"] > 0, WAIT, what="the long stream")
    os.kill(gw.proc.pid, signal.SIGHUP)  # reload 1: its old worker drains the long stream
    # The second edit is for the workers reload 1 started: wait until they serve (a boot
    # takes seconds on a loaded machine; until then only a draining worker, which stops
    # accepting within a second, could take a request at all).
    eventually(lambda: len(log_lines(gw, "inherited the health")) >= 2, 30,
               what="the workers of the first reload")
    assert d1.stats()["in_flight"] > 0, "the long stream ended before the new workers booted"
    write_roster(roster_file, roster([p], [d1, d2], probe_interval=0.5))
    hup2 = time.time()
    os.kill(gw.proc.pid, signal.SIGHUP)
    with requests.Session() as s:
        for _ in range(200):
            assert stream(s, gw.url, 2)["complete"]
            if completion_times(d2):
                break
    reached = completion_times(d2)
    g.join(timeout=30)
    assert reached and long_done
    assert reached[0] < long_done[0]
    # gunicorn handles the queued second SIGHUP once the drain is over; let it finish
    # starting those workers before the fixture stops everything.
    eventually(lambda: len(log_lines(gw, "Hang up")) == 2
               and len(log_lines(gw, "inherited the health")) >= 4, WAIT, what="the queued reload")
    print(f"\nsecond SIGHUP -> first request on its new decode: {reached[0] - hup2:.3f} s; "
          f"the long stream of the first reload ended {long_done[0] - hup2:.3f} s after it")


def test_new_workers_inherit_a_reload_the_master_could_not_publish(procs, tmp_path) -> None:
    """The state directory's copy cannot be written (here its name is taken by a directory):
    the workers a SIGHUP starts, and a worker started later to replace one that died, serve
    the roster the master validated, handed to them through fork (post_fork), even once the
    file itself is broken."""
    p = procs["sim"]("prefill")
    d1, d2 = procs["sim"]("decode"), procs["sim"]("decode")
    roster_file = tmp_path / "roster.yaml"
    write_roster(roster_file, roster([p], [d1]))
    gw = procs["gunicorn"](None, roster_file=roster_file, workers=1)
    published = tmp_path / f"state-{gw.url.rsplit(':', 1)[1]}" / "roster.json"
    published.unlink()
    published.mkdir()
    write_roster(roster_file, roster([p], [d2]))
    os.kill(gw.proc.pid, signal.SIGHUP)
    eventually(lambda: log_lines(gw, "cannot publish the reloaded roster"), WAIT,
               what="the failed publish")
    eventually(lambda: d2.url in requests.get(gw.url + "/status", timeout=5).text, 30,
               what="a new worker serving the reloaded roster")
    (worker,) = eventually(lambda: len(gw.workers()) == 1 and gw.workers(), 30,
                           what="the old worker's exit")
    roster_file.write_text("instances: [\n")  # what a worker must never boot from
    os.kill(worker, signal.SIGKILL)
    eventually(lambda: gw.workers() - {worker}, 30, what="the replacement worker")
    eventually(lambda: requests.get(gw.url + "/ready", timeout=5).ok, 30,
               what="the replacement worker ready")
    with requests.Session() as s:
        assert stream(s, gw.url, 4)["complete"]
    assert gw.proc.poll() is None
    assert completion_times(d2) and not completion_times(d1)
