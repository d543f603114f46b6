"""The shipped rules and dashboard against a real Prometheus (Debian's package) scraping real
gunicorn every second, with the metrics key as the shipped configuration shows: after a short
load with retries, refusals, failures, waits for capacity and an eviction, every recording
rule and every dashboard query has data, and the alerts see the eviction and the shedding
under the labels a real scrape gives them."""

from __future__ import annotations

import time
from pathlib import Path

import gevent.pool
import pytest
import requests

from tests import prometheus as prom
from tests import rosters
from tests.bodies import chat, completion
from tests.helpers import eventually

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.prometheus,
    pytest.mark.skipif(prom.binary("prometheus") is None and not prom.REQUIRED,
                       reason="prometheus is not installed (Debian: apt-get install prometheus; "
                       ".ci/run installs it)"),
]

JOB = "epd-flask"
DATA_TIMEOUT = 20.0
METRICS_KEY = "prometheus-scrape-key-0123456789"
CHAT = chat(max_tokens=8, temperature=0)


def send(base: str, job: tuple[str, dict]) -> int:
    path, body = job
    r = requests.post(base + path, json=body, timeout=30)
    r.content  # noqa: B018 - read to the end: the request is over only then
    return r.status_code


def test_every_recording_rule_and_dashboard_query_has_data(procs, tmp_path: Path) -> None:
    started = time.monotonic()
    p = procs["sim"]("prefill")
    d1 = procs["sim"]("decode", "--token-delay-ms", "20", "--output-tokens", "8")
    d2 = procs["sim"]("decode", "--token-delay-ms", "20", "--output-tokens", "8")
    # Two places on the prefill: of three requests at once, one waits for a place (data for
    # admission's panels).
    roster = rosters.roster([(p, {"max_concurrency": 2})], [d1, d2], decode_retries=1,
                            probe_interval=1, fail_threshold=1)
    gw = procs["gunicorn"](roster, workers=1, env={"EPD_MAX_IN_FLIGHT": "4",
                                                   "EPD_METRICS_KEY": METRICS_KEY})
    assert requests.get(gw.url + "/metrics", timeout=10).status_code == 401
    key_file = tmp_path / "epd-flask-metrics.key"  # Prometheus sends it as a bearer token
    key_file.write_text(METRICS_KEY + "\n")
    server = prom.Prometheus(tmp_path / "prometheus", gw.url.removeprefix("http://"),
                             credentials_file=key_file)
    try:
        # Scraped before the load, so rates and quantiles cover it.
        eventually(lambda: server.query(f'up{{job="{JOB}"}} == 1'), DATA_TIMEOUT,
                   interval=0.25, what="a scrape")

        d1.control("faults", fail_next=2)  # two decode failures, retried on the other decode
        jobs = [("/v1/chat/completions", {**CHAT, "stream": True})] * 24
        jobs += [("/v1/completions", completion("hi", max_tokens=4))] * 8
        statuses = gevent.pool.Pool(3).map(lambda job: send(gw.url, job), jobs)
        assert statuses == [200] * len(jobs)
        burst = gevent.pool.Pool(12).map(lambda job: send(gw.url, job), jobs[:12])
        assert 503 in burst, burst  # past EPD_MAX_IN_FLIGHT: shed
        for d in (d1, d2):  # both decodes fail: the retry fails too, the client gets a 5xx
            d.control("faults", fail_next=1)
        assert send(gw.url, jobs[0]) >= 500
        d2.control("faults", health_fail=True)  # evicted at its next probe

        for name in sorted(prom.recorded_names()):
            eventually(lambda name=name: server.query(f'{name}{{job="{JOB}"}}'), DATA_TIMEOUT,
                       interval=0.25, what=f"data for recording rule {name}")
        for title, expr in prom.dashboard_queries(JOB):
            eventually(lambda expr=expr: server.query(expr), DATA_TIMEOUT, interval=0.25,
                       what=f"data for dashboard panel {title!r}: {expr}")

        # The numbers mean what they say.
        [chat] = server.query(f'job_route:epd_request_first_byte_seconds:quantile5m{{job="{JOB}",'
                              f'route="/v1/chat/completions",quantile="0.99"}}')
        assert 0 < float(chat["value"][1]) < 5
        [shed] = server.query(f'job_instance:epd_requests_refused:ratio_rate5m{{job="{JOB}"}}')
        assert 0 < float(shed["value"][1]) < 1
        [retried] = server.query(f'sum(epd_retries_total{{job="{JOB}",stage="decode"}})')
        assert float(retried["value"][1]) >= 2

        # The alerts match real series: pending until their `for` has passed. The shedding
        # alert reads a recording rule of another group, the eviction one a scraped series:
        # either may turn pending an evaluation before the other, so wait for both.
        expected = ("EPDInstanceEvicted", "EPDOverloadShedding")

        def pending() -> dict[str, list[dict[str, str]]]:
            alerts: dict[str, list[dict[str, str]]] = {}
            for alert in server.api("alerts")["alerts"]:
                alerts.setdefault(alert["labels"]["alertname"], []).append(
                    {**alert["labels"], "state": alert["state"]})
            return alerts if all(name in alerts for name in expected) else {}
        alerts = eventually(pending, DATA_TIMEOUT, interval=0.25,
                            what=" and ".join(expected) + " alerts")
        assert [(a["role"], a["exported_instance"], a["state"])
                for a in alerts["EPDInstanceEvicted"]] == [("decode", d2.url, "pending")]
        assert [a["state"] for a in alerts["EPDOverloadShedding"]] == ["pending"]
        assert "EPDNotReady" not in alerts and "EPDProxyDown" not in alerts
    finally:
        server.stop()
    assert server.proc.returncode is not None
    assert time.monotonic() - started < 45  # generous: typically ~10 s on 2 cores
