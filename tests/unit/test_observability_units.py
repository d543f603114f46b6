"""Pure pieces of observability: the request log line, percentile math, the status page's
charts, settings, and the multiprocess metrics directory the gunicorn master manages."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import multiprocess as prom_multiprocess

from epd_flask.control import metricsdir
from epd_flask.control.config import ProxyConfig
from epd_flask.core.events import Events
from epd_flask.observe import plots
from epd_flask.observe.families import Families
from epd_flask.observe.metrics import Metrics
from epd_flask.observe.observer import LabelWindow, MetricsObserver, TenantLabels
from epd_flask.observe.statuspage import quantile
from epd_flask.serving.context import DEFAULT_LOG, LogSettings, RequestContext

FIVE_STAGES = {"encode": 41.5, "rewrite": 0.2, "prefill": 12.25, "decode_first_byte": 30.0,
               "total": 900.0}


def epd_ctx(log: LogSettings = DEFAULT_LOG) -> RequestContext:
    ctx = RequestContext("rid-1", "/v1/chat/completions", {}, upstream_id="up-1", log=log)
    ctx.instances.update({"encode": "http://e:1", "prefill": "http://p:1", "decode": "http://d:1"})
    ctx.timings.update(FIVE_STAGES)
    ctx.status, ctx.chunks, ctx.bytes_out = 200, 3, 123
    return ctx


def test_logfmt_line_renders_every_stage_present() -> None:
    line = epd_ctx().log_line()
    for stage, ms in FIVE_STAGES.items():
        assert f" {stage}_ms={ms:g}" in line or f" {stage}_ms={ms}" in line
    assert line.startswith(
        "request_id=rid-1 upstream_id=up-1 route=/v1/chat/completions status=200 ")
    assert "encode=http://e:1 prefill=http://p:1 decode=http://d:1" in line


def test_json_line_renders_every_stage_present() -> None:
    doc = json.loads(epd_ctx(LogSettings("json")).log_line())
    assert doc["timings_ms"] == FIVE_STAGES
    assert (doc["request_id"], doc["upstream_id"]) == ("rid-1", "up-1")
    assert doc["instances"]["encode"] == "http://e:1"
    assert (doc["status"], doc["chunks"], doc["bytes"]) == (200, 3, 123)


def test_logfmt_quotes_values_that_would_break_the_line() -> None:
    ctx = RequestContext("r", "/a b", {})
    ctx.error = 'decode said "no" = bad\nnext'
    line = ctx.log_line()
    assert 'route="/a b"' in line
    assert 'error="decode said \\"no\\" = bad\\nnext"' in line
    assert "\n" not in line


def test_chunk_rate_uses_the_time_after_the_first_byte() -> None:
    ctx = RequestContext("r", "/v1/completions", {})
    ctx.timings.update({"first_byte": 100.0, "total": 1100.0})
    ctx.chunks = 51
    assert ctx.chunks_per_second() == 50.0
    ctx.chunks = 1
    assert ctx.chunks_per_second() is None


def test_quantile_interpolates_like_prometheus() -> None:
    # 10 observations: 4 in (0, 0.1], 6 in (0.1, 1]
    cumulative = [(0.1, 4.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert quantile(0.5, cumulative) == pytest.approx(0.1 + 0.9 * (1 / 6))
    assert quantile(0.2, cumulative) == pytest.approx(0.05)
    assert quantile(0.99, [(0.1, 0.0), (float("inf"), 5.0)]) == 0.1
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_chart_axis_tops_are_round_numbers() -> None:
    assert [plots.nice_ceiling(v) for v in (0, 0.003, 0.7, 1, 1.2, 3, 7, 42, 1000)] == [
        1, 0.005, 1, 1, 2, 5, 10, 50, 1000]


def test_a_chart_is_well_formed_svg_and_a_gap_breaks_its_line() -> None:
    chart = plots.Chart("5xx <ratio> & more", "ratio", 300, [
        plots.Line("a", [(-300, 0.5), (-290, 0.25), (-280, None), (-270, 2.0), (-260, None),
                         (-10, 0.0), (0, 0.1)]),
        plots.Line("b & c", [(-20, None)])])
    svg = ElementTree.fromstring(plots.svg(chart))
    ns = "{http://www.w3.org/2000/svg}"
    assert svg.findtext(f"{ns}title") == "5xx <ratio> & more"
    lines = [p.get("points").split() for p in svg.iter(f"{ns}polyline")]
    dots = [(c.get("cx"), c.get("cy")) for c in svg.iter(f"{ns}circle")]
    # Plotting area x 46..312 (-300 s..now), y 88..6 (0..100 %: a ratio axis stops there, so
    # the 2.0 outlier is drawn at the top, alone between two gaps).
    assert lines == [["46.0,47.0", "54.9,67.5"], ["303.1,88.0", "312.0,79.8"]]
    assert dots == [("72.6", "6.0")]
    assert "100.0 %" in [t.text for t in svg.iter(f"{ns}text")]
    assert plots.legend(chart).endswith("b &amp; c: - now, - max")


def test_log_settings_from_the_environment() -> None:
    assert ProxyConfig.from_env({}).log_format == "logfmt"
    assert ProxyConfig.from_env({}).log_upstream is False
    cfg = ProxyConfig.from_env({"EPD_LOG_FORMAT": "JSON", "EPD_LOG_UPSTREAM": "1"})
    assert (cfg.log_format, cfg.log_upstream) == ("json", True)
    with pytest.raises(ValueError, match="EPD_LOG_FORMAT"):
        ProxyConfig.from_env({"EPD_LOG_FORMAT": "xml"})
    with pytest.raises(ValueError, match="EPD_LOG_UPSTREAM"):
        ProxyConfig.from_env({"EPD_LOG_UPSTREAM": "maybe"})


def test_live_gauge_modes_match_the_library() -> None:
    assert set(metricsdir.LIVE_GAUGE_MODES) == set(
        prom_multiprocess._LIVE_GAUGE_MULTIPROCESS_MODES)


def test_prepare_empties_an_operator_directory_or_makes_a_private_one(tmp_path: Path) -> None:
    stale = tmp_path / "counter_123.db"
    stale.write_bytes(b"old")
    env = {metricsdir.ENV: str(tmp_path)}
    assert metricsdir.prepare(env) == str(tmp_path)
    assert not stale.exists()
    metricsdir.cleanup(str(tmp_path))
    assert tmp_path.exists()  # the operator's directory stays
    env = {}
    made = metricsdir.prepare(env)
    assert env[metricsdir.ENV] == made and os.path.isdir(made)
    metricsdir.cleanup(made)
    assert not os.path.exists(made)


def test_a_dead_workers_live_gauges_go_and_its_counters_stay(tmp_path: Path) -> None:
    worker = textwrap.dedent("""
        from prometheus_client import Counter, Gauge
        Counter("served_total", "x").inc(3)
        Gauge("open_calls", "x", multiprocess_mode="livesum").inc(2)
    """)
    env = {**os.environ, metricsdir.ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", worker], env=env, timeout=30, check=True)
    assert proc.returncode == 0

    def collected() -> dict[str, float]:
        registry = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
        return {s.name: s.value for m in registry.collect() for s in m.samples}

    assert collected() == {"served_total": 3.0, "open_calls": 2.0}
    pid = int(next(tmp_path.glob("gauge_livesum_*.db")).stem.rsplit("_", 1)[1])
    metricsdir.mark_process_dead(pid, str(tmp_path))
    assert collected() == {"served_total": 3.0}


def test_observer_counts_exactly_through_its_cached_children() -> None:
    """The observer keeps each label set's child: every update still lands, on the series
    ``labels()`` names, and the in-flight limit follows a changed cap."""
    registry = CollectorRegistry()
    obs = MetricsObserver(Families(registry))
    obs.instance_labels.update({"http://p:1", "http://d:1"})
    route = "/v1/chat/completions"
    value = registry.get_sample_value
    for _ in range(3):
        obs.upstream_opened("decode", "http://d:1")
        obs.upstream_closed("decode", "http://d:1")
        obs.upstream_opened("decode", "http://d:1")
        ctx = RequestContext("rid", route, {})
        ctx.status, ctx.instances = 200, {"decode": "http://d:1"}
        obs.request_finished(ctx)
    assert value("epd_requests_total", {"route": route, "status": "200"}) == 3
    assert value("epd_upstream_in_flight", {"role": "decode", "instance": "http://d:1"}) == 3
    obs.load(1, 10)
    obs.load(0, 10)
    assert value("epd_requests_in_flight_limit") == 10
    obs.load(0, 7)
    assert value("epd_requests_in_flight_limit") == 7


def test_an_app_whose_metrics_dir_disagrees_with_its_process_is_refused(
        tmp_path: Path) -> None:
    """prometheus_client chose in-memory values when this process imported it (no
    multiprocess directory): an app asking for files would write none."""
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR set before"):
        Metrics(Events(), multiprocess_dir=str(tmp_path))
    Metrics(Events())  # its own registry: fine


def test_model_labels_are_the_names_served_now_and_a_few_recent_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    labels = LabelWindow("model", recent=2, most=4)
    assert labels.update(["a", "b"]) == []
    assert [labels.label(m) for m in ("a", "b", "z", None, "")] == ["a", "b", "", "", ""]
    assert labels.update(["c"]) == []  # a and b left: still labels, for a while
    assert [labels.label(m) for m in ("a", "b", "c")] == ["a", "b", "c"]
    assert labels.update(["d"]) == ["a"]  # c left too: the oldest to leave goes
    assert labels.label("a") == "" and labels.label("c") == "c"
    assert labels.update(["b", "d"]) == []  # served again: no longer merely recent
    assert list(labels.recent) == ["c"]
    with caplog.at_level(logging.WARNING, logger="epd_flask.observe.observer"):
        assert labels.label("d") == "d"  # the fourth distinct name: the last allowed
        labels.update(["e", "f"])
        assert (labels.label("e"), labels.label("f")) == ("", "")
    assert len(caplog.records) == 1 and "4 model names" in caplog.records[0].getMessage()


def test_tenant_labels_are_bounded_over_an_apps_life(caplog: pytest.LogCaptureFixture) -> None:
    labels = TenantLabels(most=2)
    with caplog.at_level(logging.WARNING, logger="epd_flask.observe.observer"):
        assert [labels.label(t) for t in ("a", "b", "a", "c", "d")] == ["a", "b", "a", "", ""]
    assert len(caplog.records) == 1 and "2 tenant names" in caplog.records[0].getMessage()


def test_admission_metrics_are_made_when_admission_is_on_and_the_store_gauge_with_a_store(
        ) -> None:
    registry = CollectorRegistry()
    families = Families(registry)
    observer = MetricsObserver(families)
    before = {m.name for m in registry.collect()}
    observer.admission_tenants([])  # admission off: nothing made
    observer.admission_store(None)
    assert families.admission is None and {m.name for m in registry.collect()} == before
    observer.admission_tenants([("default", "normal"), ("batch", "low")])
    assert families.admission is not None
    assert registry.get_sample_value("epd_admission_rejected_total",
                                     {"tenant": "batch", "reason": "client_gone"}) == 0
    assert registry.get_sample_value("epd_admission_store_up") is None  # no store named
    observer.admission_store(True)
    assert registry.get_sample_value("epd_admission_store_up") == 1
    observer.admission_store(False)
    assert registry.get_sample_value("epd_admission_store_up") == 0
    observer.admission_store(None)  # the roster dropped its store: nothing says it is down
    assert registry.get_sample_value("epd_admission_store_up") is None
    assert families.admission.queue_depth in families.collectors()
