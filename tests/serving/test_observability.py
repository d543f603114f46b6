"""Metrics, request logs and the status page, seen the way an operator sees them: /metrics
scraped over HTTP, /status fetched as HTML, log records as written.

Each app has metrics of its own (one registry per app without a multiprocess directory), so a
test reads the values its own proxy reports, as they are.
"""

from __future__ import annotations

import json
import logging
import re
from xml.etree import ElementTree

import pytest
import requests

from tests.bodies import chat, completion, image, multimodal
from tests.helpers import RawStream, eventually, free_port, sample, scrape, total
from tests.rosters import roster

CHAT = chat(max_tokens=8, temperature=0)
COMPLETION = completion(max_tokens=6)
H = "epd_stage_duration_seconds_count"
SVG = "{http://www.w3.org/2000/svg}"


def request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "epd_flask.requests"]


def test_requests_are_counted_by_route_and_status_and_stages_timed_per_instance(
        sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    assert requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         timeout=10).status_code == 200
    assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    bad = requests.post(px.url + "/v1/completions", data=b"{nope", timeout=10,
                        headers={"Content-Type": "application/json"})
    assert bad.status_code == 400
    assert requests.get(px.url + "/v1/models", timeout=10).status_code == 200
    assert requests.get(px.url + "/some/scanner/path-123", timeout=10).status_code == 404
    after = scrape(px.url)

    routes = {"/v1/chat/completions": {"200": 1}, "/v1/completions": {"200": 1, "400": 1},
              "passthrough": {"200": 1, "404": 1}}
    for route, statuses in routes.items():
        for status, n in statuses.items():
            assert sample(after, "epd_requests_total", route=route, status=status) == n
    assert total(after, "epd_requests_total") == 5
    # A free-form path never becomes a label value.
    assert not any("scanner" in v for (_, labels) in after for _, v in labels)
    assert sample(after, H, stage="prefill", instance=p.url) == 2
    assert sample(after, H, stage="decode_first_byte", instance=d.url) == 2
    assert sample(after, "epd_request_first_byte_seconds_count",
                  route="/v1/chat/completions", instance=d.url) == 1
    # 8 tokens: a role chunk, 8 content chunks and [DONE] at least.
    assert sample(after, "epd_streamed_chunks_total", route="/v1/chat/completions",
                  instance=d.url) >= 9
    # Buckets reach from a millisecond to ten minutes.
    les = {dict(labels)["le"] for (name, labels) in after
           if name == "epd_stage_duration_seconds_bucket"}
    assert {"0.001", "600.0", "+Inf"} <= les


def test_retries_and_upstream_errors_are_counted_by_cause_and_instance(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    dead = f"http://127.0.0.1:{free_port()}"
    doc = roster([p], [d], decode_retries=1, fail_threshold=100)
    doc["instances"].append({"role": "decode", "url": dead})
    px = proxy(doc)
    for _ in range(4):
        assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    after = scrape(px.url)
    refused = sample(after, "epd_upstream_errors_total", stage="decode", instance=dead,
                     kind="upstream_unavailable")
    assert refused >= 1  # round-robin sent some first attempts to the dead decode...
    # ...and each of those, only those, was retried for that cause.
    assert sample(after, "epd_retries_total", stage="decode",
                  cause="upstream_unavailable") == refused
    assert total(after, "epd_retries_total") == refused

    single = proxy(roster([p], [d], decode_retries=1))
    d.state.inject(fail_next=2)
    failed = requests.post(single.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert failed.status_code == 500
    after = scrape(single.url)
    assert sample(after, "epd_upstream_errors_total", stage="decode", instance=d.url,
                  kind="upstream_error") == 2
    assert sample(after, "epd_retries_total", stage="decode", cause="upstream_error") == 1
    assert sample(after, "epd_requests_total", route="/v1/completions", status="500") == 1
    assert total(after, "epd_requests_total") == 1
    # Nothing stays in flight after the failures.
    assert sample(after, "epd_upstream_in_flight", role="decode", instance=dead) == 0
    assert sample(after, "epd_upstream_in_flight", role="decode", instance=d.url) == 0


def test_in_flight_follows_an_open_stream(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=0.05, output_tokens=200)
    px = proxy(roster([p], [d]))
    client = RawStream(px.url, "/v1/chat/completions", {**CHAT, "max_tokens": 200,
                                                        "stream": True})
    client.first_event()
    during = scrape(px.url)
    assert sample(during, "epd_upstream_in_flight", role="decode", instance=d.url) == 1
    assert sample(during, "epd_upstream_in_flight", role="prefill", instance=p.url) == 0
    client.hang_up()
    assert eventually(lambda: sample(scrape(px.url), "epd_upstream_in_flight", role="decode",
                                     instance=d.url) == 0)


def test_counters_that_alerts_watch_are_exported_before_their_first_event(sim, proxy) -> None:
    """Prometheus sees no increase in a counter whose first sample is already 1, so the
    first refusal or rejected reload would never alert (etc/prometheus/epd-flask.rules.yml)."""
    px = proxy(roster([sim("prefill")], [sim("decode")]))
    names = {(name, dict(labels).get("reason") or dict(labels).get("outcome"))
             for name, labels in scrape(px.url)}
    assert {("epd_requests_refused_total", "overloaded"), ("epd_roster_reloads_total", "ok"),
            ("epd_roster_reloads_total", "rejected")} <= names


def test_probe_failures_evictions_rejoins_and_live_gauges(sim, proxy) -> None:
    p, d1, d2 = sim("prefill"), sim("decode"), sim("decode")
    px = proxy(roster([p], [d1, d2], probe_interval=0.05, fail_threshold=2), probes=True)
    assert eventually(lambda: sample(scrape(px.url), "epd_instance_last_probe_ok",
                                     role="decode", instance=d1.url) == 1)
    assert sample(scrape(px.url), "epd_probe_failures_total", role="decode",
                  instance=d1.url) == 0
    d1.state.inject(health_fail=True)
    assert eventually(lambda: sample(scrape(px.url), "epd_instance_live", role="decode",
                                     instance=d1.url) == 0)
    evicted = scrape(px.url)
    assert sample(evicted, "epd_instances", role="decode", state="evicted") == 1
    assert sample(evicted, "epd_instances", role="decode", state="live") == 1
    assert sample(evicted, "epd_instance_last_probe_ok", role="decode", instance=d1.url) == 0
    assert sample(evicted, "epd_evictions_total", role="decode", instance=d1.url) == 1
    assert sample(evicted, "epd_probe_failures_total", role="decode", instance=d1.url) >= 2
    d1.state.inject(health_fail=False)
    assert eventually(lambda: sample(scrape(px.url), "epd_instance_live", role="decode",
                                     instance=d1.url) == 1)
    after = scrape(px.url)
    assert sample(after, "epd_rejoins_total", role="decode", instance=d1.url) == 1
    assert total(after, "epd_evictions_total") == 1
    assert sample(after, "epd_instances", role="decode", state="live") == 2
    assert sample(after, "epd_instance_last_probe_latency_seconds", role="decode",
                  instance=d2.url) > 0


def test_status_page_shows_roster_state_and_stage_percentiles(sim, proxy) -> None:
    p, d1, d2 = sim("prefill"), sim("decode"), sim("decode")
    px = proxy(roster([p], [d1, d2], fail_threshold=1))
    px.services.metrics.history.sample()  # the window's start
    for _ in range(4):
        assert requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                             timeout=10).ok
    px.services.registry.record_failure(d2.url, "test: gone")
    r = requests.get(px.url + "/status", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html")
    page = r.text
    for asset in ("<script", "<link", "src=", "@import", "url("):
        assert asset not in page  # nothing to fetch: works offline and in a terminal
    text = re.sub(r"<[^>]+>", " ", page)  # what a terminal browser shows
    assert re.search(rf"{re.escape(d1.url)}\s+LIVE\s+", text)
    assert re.search(rf"{re.escape(d2.url)}\s+EVICTED\s+", text)
    assert "decode: 1 live, 1 evicted" in text
    assert "prefill: 1 live, 0 evicted" in text
    # Four chat requests in the window, with a rate and percentiles per stage and instance.
    routes = re.search(r"/v1/chat/completions\s+200\s+(\d+)\s+\d+\.\d\d", text)
    assert routes and int(routes.group(1)) == 4
    assert re.search(rf"{re.escape(p.url)}\s+LIVE\s+not yet\s+-\s+0\s+4\s+0", text)
    for url in (d1.url, d2.url):  # calls and errors per instance: round-robin, two each
        assert re.search(rf"{re.escape(url)}\s+[A-Z]+\s+not yet\s+-\s+0\s+2\s+0", text)
    for stage, instance, n in (("prefill", p.url, 4), ("decode_first_byte", d1.url, 2)):
        row = re.search(rf"{re.escape(instance)}\s+{n}\s+\S+\s+([\d.]+) ms\s+([\d.]+) ms", text)
        assert row, stage
        assert 0 < float(row.group(1)) <= float(row.group(2))
    for stage in ("first byte (end to end)", "total (end to end)"):
        row = re.search(rf"{re.escape(stage)}\s+(\d+)\s+\S+\s+([\d.]+) ms\s+([\d.]+) ms", text)
        assert row and int(row.group(1)) == 4, stage
    assert "over the last" in text


@pytest.mark.parametrize("connector", ["nixl", "none"])
def test_prefill_prompt_and_cached_tokens_are_counted_and_status_shows_the_share(
        sim, proxy, connector) -> None:
    p = sim("prefill", prompt_tokens_details=True)
    d = sim("decode", prompt_tokens_details=True)
    px = proxy(roster([p], [d], connector=connector))
    px.services.metrics.history.sample()  # the window's start
    body = completion("the quick brown fox jumps " * 24, max_tokens=2)
    answers = [requests.post(px.url + "/v1/completions", json=body, timeout=10).json()["usage"]
               for _ in range(2)]
    after = scrape(px.url)
    cached = p.state.stats()["prefix_cached_tokens"]
    prompt = sum(u["prompt_tokens"] for u in answers)
    assert 0 < cached < prompt  # the sim's cache hit the repeated prompt, not all of it
    assert answers[1]["prompt_tokens_details"]["cached_tokens"] == cached
    assert sample(after, "epd_prefill_prompt_tokens_total", instance=p.url) == prompt
    assert sample(after, "epd_prefill_cached_tokens_total", instance=p.url) == cached
    text = re.sub(r"<[^>]+>", " ", requests.get(px.url + "/status", timeout=10).text)
    assert "cache hits" in text
    share = f"{cached / prompt:.1%}"
    assert re.search(rf"{re.escape(p.url)}\s+LIVE\s+not yet\s+-\s+0\s+2\s+0\s+"
                     rf"{re.escape(share)}", text), share
    assert re.search(rf"{re.escape(d.url)}\s+LIVE\s+not yet\s+-\s+0\s+2\s+0\s+-", text)


def svg_charts(page: str) -> dict[str, ElementTree.Element]:
    """Every inline chart of the status page, parsed as XML (so it is well-formed), by title."""
    out = {}
    for markup in re.findall(r"<svg\b.*?</svg>", page, re.S):
        svg = ElementTree.fromstring(markup)
        out[svg.findtext(f"{SVG}title")] = svg
    return out


def plotted(svg: ElementTree.Element) -> list[list[tuple[float, float]]]:
    """Each drawn line's points, in SVG coordinates (a lone point is a circle)."""
    lines = [[tuple(map(float, xy.split(","))) for xy in line.get("points").split()]
             for line in svg.iter(f"{SVG}polyline")]
    lines += [[(float(c.get("cx")), float(c.get("cy")))] for c in svg.iter(f"{SVG}circle")]
    return lines


def test_status_page_plots_the_last_minutes_as_inline_svg(sim, proxy) -> None:
    p = sim("prefill")
    d1, d2 = (sim("decode", token_delay=0.02, output_tokens=300) for _ in range(2))
    px = proxy(roster([p], [d1, d2], decode_retries=0))
    history = px.services.metrics.history
    history.sample()
    for _ in range(4):
        assert requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10).ok
    history.sample()
    d2.state.inject(fail_next=1)
    codes = [requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code
             for _ in range(4)]
    assert sorted(codes) == [200, 200, 200, 500]
    streams = [RawStream(px.url, "/v1/chat/completions", {**CHAT, "max_tokens": 300,
                                                          "stream": True}) for _ in range(2)]
    for stream in streams:
        stream.first_event()  # one on each decode, both still running at the next sample
    # The page right after the last sample: it plots its own moment only when that is a
    # sampling step (MIN_STEP_SECONDS) after the newest sample.
    history.sample()
    page = requests.get(px.url + "/status", timeout=10).text
    for stream in streams:
        stream.hang_up()

    for asset in ("<script", "<link", "src=", "@import", "url("):
        assert asset not in page
    charts = svg_charts(page)
    assert list(charts) == ["Requests per second", "5xx ratio", "Time to first byte",
                            "Upstream calls in flight"]
    for title, svg in charts.items():
        assert svg.get("viewBox") and plotted(svg), title
    # Two intervals with traffic: two points per line, above the axis (y = 88) where the
    # interval had requests, errors or a first byte; the 5xx ratio is 0 then 1 in 4.
    [rate] = plotted(charts["Requests per second"])
    assert len(rate) == 2 and all(y < 88 for _, y in rate)
    [ratio] = plotted(charts["5xx ratio"])
    assert ratio[0][1] > ratio[1][1]
    shares = re.fullmatch(r"5xx / answered: ([\d.]+) %, ([\d.]+) %",
                          charts["5xx ratio"].findtext(f"{SVG}desc"))
    assert shares and (float(shares.group(1)), float(shares.group(2))) == (0.0, 25.0)
    p50, p99 = plotted(charts["Time to first byte"])
    assert len(p50) == len(p99) == 2
    assert all(hi[1] <= lo[1] < 88 for lo, hi in zip(p50, p99, strict=True))  # y grows down
    # Upstream calls in flight per instance at each sample: the two streams' decodes had one
    # each at the last sample, the prefill none.
    desc = charts["Upstream calls in flight"].findtext(f"{SVG}desc")
    assert f"prefill {p.url}: 0, 0, 0" in desc
    for d in (d1, d2):
        assert f"decode {d.url}: 0, 0, 1" in desc
    text = re.sub(r"<[^>]+>", " ", page)  # the legends, for a terminal browser
    assert re.search(r"answered: [\d.]+/s now, [\d.]+/s max", text)
    assert re.search(rf"5xx / answered: {shares.group(2)} % now", text)


def test_one_log_line_per_request_with_instances_and_stage_timings(
        sim, proxy, caplog: pytest.LogCaptureFixture) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    with caplog.at_level(logging.INFO, logger="epd_flask"):
        r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          headers={"X-Request-Id": "log-me-1"}, timeout=10)
        assert r.ok
        assert requests.post(px.url + "/v1/completions", data=b"[]", timeout=10,
                             headers={"Content-Type": "application/json"}).status_code == 400
    lines = request_lines(caplog)
    assert len(lines) == 2
    fields = dict(kv.split("=", 1) for kv in lines[0].split(" ") if "=" in kv)
    assert fields["request_id"] == "log-me-1" and fields["status"] == "200"
    assert fields["prefill"] == p.url and fields["decode"] == d.url
    for key in ("prefill_ms", "decode_first_byte_ms", "first_byte_ms", "total_ms"):
        assert float(fields[key]) > 0, key
    assert float(fields["first_byte_ms"]) <= float(fields["total_ms"])
    assert int(fields["chunks"]) >= 9 and int(fields["bytes"]) == len(r.content)
    assert fields["retries"] == "0"
    assert "status=400" in lines[1] and 'error="request body must be a JSON object' in lines[1]
    assert not [rec for rec in caplog.records if rec.name == "epd_flask.upstream"]


def test_json_log_lines_and_the_upstream_call_switch(
        sim, proxy, caplog: pytest.LogCaptureFixture) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]), log_format="json", log_upstream=True)
    with caplog.at_level(logging.INFO, logger="epd_flask"):
        assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    (line,) = request_lines(caplog)
    doc = json.loads(line)
    assert doc["status"] == 200 and doc["instances"] == {"prefill": p.url, "decode": d.url}
    assert set(doc["timings_ms"]) == {"prefill", "decode_first_byte", "first_byte", "total"}
    assert doc["ts"] and doc["request_id"]
    calls = [r.getMessage() for r in caplog.records if r.name == "epd_flask.upstream"]
    assert len(calls) == 2
    assert "stage=prefill" in calls[0] and f"instance={p.url}" in calls[0]
    assert "stage=decode" in calls[1] and "status=200" in calls[1]
    assert all(f"request_id={doc['request_id']}" in c for c in calls)


def test_each_app_logs_as_its_own_config_says(sim, proxy, caplog) -> None:
    """Log settings belong to the app, not to whichever app was built last."""
    p, d = sim("prefill"), sim("decode")
    as_json = proxy(roster([p], [d]), log_format="json", log_upstream=True)
    plain = proxy(roster([p], [d]))
    with caplog.at_level(logging.INFO, logger="epd_flask"):
        for px in (as_json, plain, as_json):
            assert requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    first, second, third = request_lines(caplog)
    assert json.loads(first)["status"] == json.loads(third)["status"] == 200
    assert second.startswith("request_id=") and " status=200 " in second
    upstream = [r.getMessage() for r in caplog.records if r.name == "epd_flask.upstream"]
    ids = {json.loads(line)["request_id"] for line in (first, third)}
    assert len(upstream) == 4
    assert {re.search(r"request_id=(\S+)", c).group(1) for c in upstream} == ids


ADMIN_KEY = "admin-key-abcdefghijkl"
ADMIN = {"X-API-Key": ADMIN_KEY}


def test_profiling_reaches_every_live_instance_and_reports_each(sim, proxy) -> None:
    p1, p2 = sim("prefill", profiler=True), sim("prefill")
    d1, d2 = sim("decode", profiler=True), sim("decode", profiler=True)
    px = proxy(roster([p1, p2], [d1, d2]), admin_api_key=ADMIN_KEY)
    r = requests.post(px.url + "/start_profile", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["ok"], doc["not_found"], doc["failed"]) == (3, 1, 0)
    outcome = {i["url"]: i["outcome"] for i in doc["instances"]}
    assert outcome == {p1.url: "ok", p2.url: "not_found", d1.url: "ok", d2.url: "ok"}
    assert all(s.state.stats()["profiling"] for s in (p1, d1, d2))
    assert requests.post(px.url + "/stop_profile", headers=ADMIN, timeout=10).json()["ok"] == 3
    assert not any(s.state.stats()["profiling"] for s in (p1, d1, d2))
    assert [s.state.stats()["profiles_stopped"] for s in (p1, d1, d2)] == [1, 1, 1]


def test_profiling_reports_failures_and_evicted_instances(sim, proxy) -> None:
    p, d = sim("prefill", profiler=True), sim("decode", profiler=True)
    dead = f"http://127.0.0.1:{free_port()}"
    gone = sim("decode", profiler=True)
    doc = roster([p], [d, gone], fail_threshold=1)
    doc["instances"].append({"role": "decode", "url": dead})
    px = proxy(doc, admin_api_key=ADMIN_KEY)
    px.services.registry.record_failure(gone.url, "test: evicted")
    r = requests.post(px.url + "/start_profile", headers=ADMIN, timeout=10)
    assert r.status_code == 502
    body = r.json()
    assert body["error"]["code"] == "profile_failed"
    outcome = {i["url"]: i["outcome"] for i in body["instances"]}
    assert outcome == {p.url: "ok", d.url: "ok", dead: "failed", gone.url: "skipped"}
    assert gone.state.stats()["profiles_started"] == 0
    nobody = proxy(roster([sim("prefill")], [sim("decode")]), admin_api_key=ADMIN_KEY)
    r = requests.post(nobody.url + "/start_profile", headers=ADMIN, timeout=10)
    assert r.status_code == 503 and r.json()["not_found"] == 2


@pytest.mark.parametrize("action", ["start", "stop"])
def test_profiling_is_an_operator_action(sim, proxy, action: str) -> None:
    """The serving key does not switch the fleet's profiler; the admin key does, and without
    one configured the switch is off like the admin API."""
    serving = "sk-serving-one-0123456789"
    p, d = sim("prefill", profiler=True), sim("decode", profiler=True)
    off = proxy(roster([p], [d]), api_keys=(serving,))
    r = requests.post(off.url + f"/{action}_profile", timeout=10,
                      headers={"Authorization": f"Bearer {serving}", **ADMIN})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_api_disabled"
    px = proxy(roster([p], [d]), api_keys=(serving,), admin_api_key=ADMIN_KEY)
    for headers, code in (({}, "missing_admin_key"),
                          ({"Authorization": f"Bearer {serving}"}, "invalid_admin_key"),
                          ({"X-API-Key": "wrong"}, "invalid_admin_key")):
        r = requests.post(px.url + f"/{action}_profile", headers=headers, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == code, r.text
    assert p.state.stats()["requests"].get(f"/{action}_profile", 0) == 0
    assert d.state.stats()["requests"].get(f"/{action}_profile", 0) == 0
    r = requests.post(px.url + f"/{action}_profile", headers=ADMIN, timeout=10)
    assert r.status_code == 200 and r.json()["ok"] == 2


@pytest.mark.parametrize("header", [ADMIN, {"Authorization": f"Bearer {ADMIN_KEY}"}])
def test_profiling_sends_the_backend_key_never_the_callers(sim, proxy, header) -> None:
    p, d = sim("prefill", profiler=True), sim("decode", profiler=True)
    keyed = proxy(roster([p], [d]), admin_api_key=ADMIN_KEY, backend_api_key="sk-fleet")
    assert requests.post(keyed.url + "/start_profile", headers=header, timeout=10).ok
    for server in (p, d):
        seen = server.state.requests(1)[0]["headers"]
        assert seen["authorization"] == "Bearer sk-fleet"
        assert ADMIN_KEY not in json.dumps(seen)
    plain = proxy(roster([p], [d]), admin_api_key=ADMIN_KEY)
    assert requests.post(plain.url + "/stop_profile", headers=header, timeout=10).ok
    for server in (p, d):
        seen = server.state.requests(1)[0]["headers"]
        assert "authorization" not in seen and ADMIN_KEY not in json.dumps(seen)


def test_multimodal_epd_request_logs_all_five_stage_timings(
        sim, proxy, caplog: pytest.LogCaptureFixture) -> None:
    e0, e1 = sim("encode", ttft=0.05), sim("encode", ttft=0.05)
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e0, e1]), log_upstream=True)
    images = [image(f"https://media.invalid/{i}.png") for i in range(3)]
    body = {**CHAT, **multimodal(*images, stream=True)}
    with caplog.at_level(logging.INFO, logger="epd_flask"):
        r = requests.post(px.url + "/v1/chat/completions", json=body, timeout=20,
                          headers={"X-Request-Id": "epd-log-1"})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    after = scrape(px.url)
    (line,) = request_lines(caplog)
    print(f"\n{line}")
    fields = dict(kv.split("=", 1) for kv in line.split(" ") if "=" in kv)
    stages = ("encode", "rewrite", "prefill", "decode_first_byte", "total")
    ms = {stage: float(fields[f"{stage}_ms"]) for stage in stages}
    assert ms["encode"] >= 50  # the encoders' time to answer
    assert ms["total"] >= ms["encode"] + ms["rewrite"] + ms["prefill"] + ms["decode_first_byte"]
    assert fields["encode"] == f"{e0.url},{e1.url}" and fields["decode"] == d.url
    # Per-upstream-call lines: one batched call per encoder, prefill, decode.
    calls = [rec.getMessage() for rec in caplog.records if rec.name == "epd_flask.upstream"]
    print("\n".join(calls))
    assert sorted(re.search(r"stage=(\w+)", c).group(1) for c in calls) == [
        "decode", "encode", "encode", "prefill"]
    assert all("request_id=epd-log-1" in c and "status=200" in c for c in calls)
    # Per-encoder bookkeeping in the metrics; the stage as a whole spans both encoders.
    assert sample(after, H, stage="encode", instance="several") == 1
    assert sample(after, H, stage="rewrite", instance="") == 1
    for e in (e0, e1):
        assert sample(after, "epd_upstream_in_flight", role="encode", instance=e.url) == 0


def test_a_failing_encoder_is_counted_against_that_encoder(sim, proxy) -> None:
    e, p, d = sim("encode"), sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e]))
    e.state.inject(fail_next=1, fail_status=500)
    body = {**CHAT, **chat([image("https://media.invalid/x.png")])}
    r = requests.post(px.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 500
    after = scrape(px.url)
    assert sample(after, "epd_upstream_errors_total", stage="encode", instance=e.url,
                  kind="upstream_error") == 1
    assert sample(after, "epd_upstream_in_flight", role="encode", instance=e.url) == 0
    assert p.state.stats()["completions"] == 0


def test_a_body_over_the_limit_is_logged_and_counted_too(
        sim, proxy, caplog: pytest.LogCaptureFixture) -> None:
    px = proxy(roster([sim("prefill")], [sim("decode")]), max_body_bytes=100)
    with caplog.at_level(logging.INFO, logger="epd_flask"):
        r = requests.post(px.url + "/v1/completions", json={"prompt": "x" * 500}, timeout=5)
    assert r.status_code == 413
    after = scrape(px.url)
    assert sample(after, "epd_requests_total", route="/v1/completions", status="413") == 1
    (line,) = request_lines(caplog)
    assert "status=413" in line


def test_a_failing_observer_never_breaks_a_request(sim, proxy, caplog) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("observer bug")

    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]))
    events = px.services.events
    for hook in (events.upstream_opened, events.upstream_closed, events.request_finished,
                 events.load):
        hook.add_listener(broken)
    with caplog.at_level(logging.ERROR, logger="epd_flask.core.events"):
        r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=10)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    failed = {rec.getMessage().split(" failed in ")[1] for rec in caplog.records
              if " failed in " in rec.getMessage()}
    assert failed == {"upstream_opened", "upstream_closed", "request_finished", "load"}


def test_two_apps_in_one_process_keep_metrics_of_their_own(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    busy = proxy(roster([p], [d]))
    idle = proxy(roster([p], [d], fail_threshold=1))
    for _ in range(3):
        assert requests.post(busy.url + "/v1/completions", json=COMPLETION, timeout=10).ok
    idle.services.registry.record_failure(d.url, "test: this app alone saw it fail")
    mine, other = scrape(busy.url), scrape(idle.url)
    assert total(mine, "epd_requests_total") == 3
    assert total(other, "epd_requests_total") == 0
    assert sample(mine, "epd_instance_live", role="decode", instance=d.url) == 1
    assert sample(other, "epd_instance_live", role="decode", instance=d.url) == 0
    assert sample(other, "epd_evictions_total", role="decode", instance=d.url) == 1
    assert total(mine, "epd_evictions_total") == 0
