"""The shipped Prometheus rules and Grafana dashboard: promtool accepts them and their unit
tests pass, and they speak only of metrics the proxy exports and rules the file records."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import CollectorRegistry

from epd_flask.observe.families import HISTOGRAM_PARTS, Families, kind, sample
from tests import prometheus as prom

PROMTOOL = prom.binary("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not prom.REQUIRED,
    reason="promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")


def promtool(*args: str) -> str:
    assert PROMTOOL, "promtool is not installed, and CI=true requires it"
    done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def exported_names() -> set[str]:
    """Every sample name the proxy can expose, from its metric definitions (admission's and
    the shared stores' included, which exist only while they are configured)."""
    families = Families(CollectorRegistry())
    families.admission_on().store_up.set(True)
    families.load_store_up.set(True)
    return {sample(metric, part) for metric in families.collectors()
            for part in (HISTOGRAM_PARTS if kind(metric) == "histogram" else ("",))}


@needs_promtool
def test_promtool_accepts_the_rules_and_the_example_config() -> None:
    assert "SUCCESS" in promtool("check", "rules", str(prom.RULES))
    assert "SUCCESS" in promtool("check", "config", str(prom.SHIPPED_CONFIG))


@needs_promtool
def test_promtool_unit_tests_of_every_alert_and_recording_rule_pass() -> None:
    assert prom.RULE_TESTS
    promtool("test", "rules", *map(str, prom.RULE_TESTS))
    tested = "\n".join(p.read_text() for p in prom.RULE_TESTS)
    for rule in prom.rules():
        name = rule.get("alert") or rule["record"]
        assert name in tested, f"{name} has no promtool test"


def test_rules_and_dashboard_name_only_exported_metrics_and_recorded_rules() -> None:
    exported, recorded = exported_names(), prom.recorded_names()
    assert "epd_requests_total" in exported and "epd_stage_duration_seconds_bucket" in exported
    texts = [("rules", prom.RULES.read_text())]
    texts += [(title, expr) for title, expr in prom.dashboard_queries("epd-flask")]
    for where, text in texts:
        unknown = set(prom.METRIC_NAME.findall(text)) - exported
        assert not unknown, f"{where} uses metrics the proxy does not export: {unknown}"
        unrecorded = set(prom.RECORDED_NAME.findall(text)) - recorded
        assert not unrecorded, f"{where} uses rules that are not recorded: {unrecorded}"


def test_every_alert_says_what_to_do_and_how_bad_it_is() -> None:
    alerts = [rule for rule in prom.rules() if "alert" in rule]
    assert {a["alert"] for a in alerts} >= {
        "EPDInstanceEvicted", "EPDHighErrorRatio", "EPDHighTimeToFirstToken", "EPDNotReady",
        "EPDRosterReloadRejected", "EPDOverloadShedding", "EPDAdmissionStoreDown"}
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        assert len(alert["annotations"]["description"]) > 150, alert["alert"]


def test_dashboard_panels_are_laid_out_and_all_query_the_job_chosen() -> None:
    dash = prom.dashboard()
    assert dash["uid"] == "epd-flask"
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "job"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in prom.dashboard_panels():
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert 'job=~"$job"' in target["expr"], panel["title"]
    titles = " ".join(p["title"] for p in prom.dashboard_panels()).lower()
    for topic in ("requests per second", "5xx", "time to first token", "stage latency",
                  "instance live", "retries", "in flight vs cap"):
        assert topic in titles
