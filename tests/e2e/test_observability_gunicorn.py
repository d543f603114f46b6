"""Metrics and request logs through real gunicorn with two gevent workers: one scrape must see
the sum of both workers, and every request must be counted and logged exactly once."""

from __future__ import annotations

import collections
import json
import re
import signal
import time

import gevent.pool
import pytest
import requests

from tests.bodies import chat, completion
from tests.helpers import RawStream, eventually, sample, scrape, total
from tests.rosters import roster

pytestmark = pytest.mark.e2e

CHAT = chat(max_tokens=10, temperature=0)
COMPLETION = completion(max_tokens=6)


def workers_serving(proc) -> set[str]:
    """Pids of the workers that have started their services: each logs what its first probe
    found, or that it took its health picture over from a worker that booted earlier."""
    return set(re.findall(r"\[(\d+)\] \[INFO\] epd_flask\.fleet\.(?:registry: instance .* serves"
                          r"|rostersync: inherited)", proc.log.read_text(errors="replace")))


def mixed_load(base: str) -> list[tuple[str, int]]:
    """A bounded mix sent 16 at a time: streams, whole answers, client errors, upstream
    rejections, injected upstream failures (armed by the caller) and pass-through calls."""
    jobs: list[tuple[str, str, dict]] = []
    jobs += [("/v1/chat/completions", "POST", {"json": {**CHAT, "stream": True}})] * 24
    jobs += [("/v1/completions", "POST", {"json": COMPLETION})] * 12
    jobs += [("/v1/completions", "POST", {"data": b"{oops",
                                          "headers": {"Content-Type": "application/json"}})] * 5
    jobs += [("/v1/chat/completions", "POST", {"json": {**CHAT, "model": "no-such-model"}})] * 5
    jobs += [("/v1/models", "GET", {})] * 4

    def send(job: tuple[str, str, dict]) -> tuple[str, int]:
        path, method, kw = job
        r = requests.request(method, base + path, timeout=30, **kw)
        r.content  # noqa: B018 - read to the end: the request is over only then
        route = path if path.startswith("/v1/c") else "passthrough"
        return route, r.status_code

    return gevent.pool.Pool(16).map(send, jobs)


def test_one_scrape_sums_both_workers_and_counts_every_request_once(procs) -> None:
    p = procs["sim"]("prefill")
    d = procs["sim"]("decode", "--token-delay-ms", "10", "--output-tokens", "10")
    gw = procs["gunicorn"](roster([p], [d], decode_retries=0), workers=2,
                           env={"EPD_LOG_FORMAT": "json"})
    # The fixture returns once one worker answers; a second still importing could take no
    # request of a short burst, and the sum across workers would not be tested.
    assert eventually(lambda: len(workers_serving(gw)) == 2, 30), workers_serving(gw)
    d.control("faults", fail_next=4)
    started = time.monotonic()
    load = gevent.spawn(mixed_load, gw.url)
    gevent.sleep(0.2)
    with requests.get(gw.url + "/status", timeout=30) as page:  # while the load runs
        assert page.status_code == 200
        assert re.search(rf"{re.escape(d.url)}\s+LIVE", re.sub(r"<[^>]+>", " ", page.text))
    results = load.get(timeout=60)
    elapsed = time.monotonic() - started
    sent = collections.Counter(results)
    assert sent[("/v1/chat/completions", 500)] + sent[("/v1/completions", 500)] == 4
    assert sent[("/v1/completions", 400)] == 5 and sent[("passthrough", 200)] == 4

    scrapes = [scrape(gw.url) for _ in range(6)]  # answered by either worker
    for metrics in scrapes:
        assert total(metrics, "epd_requests_total") == len(results) == 50
        for (route, status), n in sent.items():
            assert sample(metrics, "epd_requests_total", route=route, status=str(status)) == n
        assert sample(metrics, "epd_upstream_in_flight", role="decode", instance=d.url) == 0
        assert not any(name.startswith("epd_admission_") for name, _ in metrics)  # it is off

    # One bare JSON line per request, never two, from both workers.
    docs = [json.loads(line) for line in gw.log.read_text().splitlines()
            if line.startswith('{"ts"')]
    assert len(docs) == 50
    assert collections.Counter((doc["route"] if doc["route"].startswith("/v1/c")
                                else "passthrough", doc["status"]) for doc in docs) == sent
    per_worker = collections.Counter(doc["pid"] for doc in docs)
    assert len(per_worker) == 2, per_worker
    streamed = [doc for doc in docs if doc["chunks"] > 0]
    assert all(set(doc["timings_ms"]) == {"prefill", "decode_first_byte", "first_byte", "total"}
               for doc in streamed)
    chunks = sample(scrapes[0], "epd_streamed_chunks_total", route="/v1/chat/completions",
                    instance=d.url)
    assert chunks == sum(doc["chunks"] for doc in streamed)
    print(f"\n50 requests in {elapsed * 1000:.0f} ms; per worker {dict(per_worker)}; "
          f"client statuses {dict(sent)}; streamed chunks {chunks:.0f}")


def test_reloads_fold_exited_workers_files_and_keep_every_count(procs, tmp_path) -> None:
    """Every reload replaces both workers; their files are folded into one archive per kind,
    so the directory (and what a scrape reads) stays the size of the live workers', and the
    counters keep their sums across generations."""
    metrics_dir = tmp_path / "metrics"
    p, d = procs["sim"]("prefill"), procs["sim"]("decode")
    gw = procs["gunicorn"](roster([p], [d]), workers=2,
                           env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    generations, per_generation, files = 3, 6, []
    for _ in range(generations):
        assert eventually(lambda: len(gw.workers()) == 2, 30)
        for _ in range(per_generation):
            r = requests.post(gw.url + "/v1/completions", json=COMPLETION, timeout=30)
            assert r.status_code == 200, r.text
        old = gw.workers()
        gw.proc.send_signal(signal.SIGHUP)
        assert eventually(lambda old=old: not gw.workers() & old, 30), gw.tail()
        scrape(gw.url)  # any worker's scrape folds what the exited ones left
        files.append(sorted(p.name for p in metrics_dir.glob("*.db")))
    metrics = scrape(gw.url)
    assert sample(metrics, "epd_requests_total", route="/v1/completions",
                  status="200") == generations * per_generation
    # Two live workers' files (a counter, a histogram and three live gauges each) and the
    # two archives, after the first reload as after the last.
    assert all(len(names) <= 2 * 5 + 2 for names in files), files
    assert {"counter_archive.db", "histogram_archive.db"} <= set(files[-1])
    live = {str(pid) for pid in gw.workers()}
    assert {n.rsplit("_", 1)[1][:-3] for n in files[-1]} <= live | {"archive"}


def test_admission_series_sum_both_workers(procs) -> None:
    """Requests waiting in both workers' queues show in one scrape, whichever worker answers
    it (the queue depth is a live sum), and their counts sum like every counter."""
    one = procs["sim"]("prefill_decode", "--token-delay-ms", "50", "--output-tokens", "400")
    doc = roster(combined=[(one, {"max_concurrency": 1})],
                 admission={"tenant_header": "X-Tenant"})
    doc["tenants"] = {"a": {"weight": 2}, "b": {"priority": "low"}}
    gw = procs["gunicorn"](doc, workers=2, env={"EPD_LOG_FORMAT": "json"})
    assert eventually(lambda: len(workers_serving(gw)) == 2, 30), workers_serving(gw)
    before = scrape(gw.url)
    assert total(before, "epd_admission_queue_depth") == 0
    assert sample(before, "epd_admission_rejected_total", tenant="b", reason="queue_full") == 0
    held = RawStream(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 400, "stream": True})
    held.first_event()

    def ask(tenant: str) -> int:
        return requests.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                             headers={"X-Tenant": tenant}, timeout=30).status_code

    queued = [gevent.spawn(ask, tenant) for tenant in ("a", "b") * 6]
    assert eventually(lambda: total(scrape(gw.url), "epd_admission_queue_depth") == 12, 30)
    for metrics in [scrape(gw.url) for _ in range(6)]:  # answered by either worker
        assert sample(metrics, "epd_admission_queue_depth", tenant="a", priority="normal") == 6
        assert sample(metrics, "epd_admission_queue_depth", tenant="b", priority="low") == 6
    held.hang_up()
    assert [g.get(timeout=60) for g in queued] == [200] * 12
    for metrics in [scrape(gw.url) for _ in range(6)]:
        assert total(metrics, "epd_admission_queue_depth") == 0
        assert sample(metrics, "epd_admission_admitted_total", tenant="a") == 6
        assert sample(metrics, "epd_admission_admitted_total", tenant="b") == 6
        assert total(metrics, "epd_admission_wait_seconds_count") == 12
    # Both workers held some of the waiting requests: one worker's counts alone were not 12.
    docs = [json.loads(line) for line in gw.log.read_text().splitlines()
            if line.startswith('{"ts"')]
    waited = collections.Counter(d["pid"] for d in docs if d.get("tenant") in ("a", "b"))
    assert len(waited) == 2 and sum(waited.values()) == 12, waited
