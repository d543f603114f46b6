"""The ``/status`` page: what it shows, computed from two metric snapshots (now and a few
minutes ago, the same samples ``/metrics`` exposes) and, for its plots, from every sample the
worker kept in between; and its HTML. Samples are named through the app's metric objects
(``families.sample``), never spelled here.

Plain HTML with inline style and no external assets, laid out as headings and tables so it
reads in a terminal browser (w3m, lynx) too; state is written out in words, not only colours.
"""

from __future__ import annotations

import html
import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd_flask import __version__
from epd_flask.control.roles import ROLES
from epd_flask.core.events import FleetEntry
from epd_flask.observe import plots
from epd_flask.observe.families import Families, sample
from epd_flask.observe.history import STATUS_WINDOW_SECONDS, Snapshot

STAGE_ORDER = ("encode", "rewrite", "prefill", "decode_first_byte")
REFRESH_SECONDS = 5
# The current snapshot is plotted after the newest kept sample only if it is at least this much
# newer: a rate over a fraction of a second is noise.
MIN_STEP_SECONDS = 2.0

Rows = list[tuple[dict[str, str], float]]


def delta(now: Snapshot, then: Snapshot | None, name: str) -> Rows:
    """Each series' growth since ``then`` (everything since start when there is no ``then``)."""
    out = []
    for labels, value in now.series(name):
        before = 0.0
        if then is not None:
            before = then.values.get((name, tuple(sorted(labels.items()))), 0.0)
        out.append((labels, value - before if value >= before else value))
    return out


def summed(rows: Rows, by: Sequence[str]) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for labels, value in rows:
        key = tuple(labels.get(name, "") for name in by)
        out[key] = out.get(key, 0.0) + value
    return out


def buckets(rows: Rows, by: Sequence[str]) -> dict[tuple[str, ...], list[tuple[float, float]]]:
    """Cumulative bucket counts summed over every label not in ``by``."""
    grouped: dict[tuple[str, ...], dict[float, float]] = {}
    for labels, value in rows:
        per_le = grouped.setdefault(tuple(labels.get(name, "") for name in by), {})
        le = float(labels["le"])
        per_le[le] = per_le.get(le, 0.0) + value
    return {key: sorted(per_le.items()) for key, per_le in grouped.items()}


def quantile(q: float, cumulative: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket that holds
    the rank; None without observations."""
    ordered = sorted(cumulative)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if upper == float("inf"):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


@dataclass
class Latency:
    name: str
    count: float
    p50: float | None
    p99: float | None
    detail: list[Latency] = field(default_factory=list)


@dataclass
class InstanceRow:
    role: str
    url: str
    live: bool
    probe_ok: bool | None
    probe_age: float | None
    probe_latency: float | None
    in_flight: float
    calls: float
    errors: float
    # Share of the prompt tokens it answered for that came from its prefix cache (None: none).
    cache_hits: float | None = None


@dataclass
class ModelRow:
    """One model's completions (docs/behaviour.md#models); name "" gathers unserved names."""

    name: str
    requests: float
    errors: float
    ttft: Latency


@dataclass
class SourceRow:
    """A membership source (docs/behaviour.md#discovery): whether it answers every worker
    (``epd_discovery_up``, the lowest of the live workers) and what it last told this one."""

    name: str
    up: bool
    detail: str
    since: float
    members: int


@dataclass
class Status:
    window: float | None  # seconds the numbers cover; None: since the process started
    ready: str
    instances: list[InstanceRow]
    requests: list[tuple[str, str, float]]
    latencies: list[Latency]
    chunks: float
    counters: list[tuple[str, list[tuple[str, float]]]]
    charts: list[plots.Chart] = field(default_factory=list)
    models: list[ModelRow] = field(default_factory=list)
    generated: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    sources: list[SourceRow] = field(default_factory=list)


def _latencies(m: Families, now: Snapshot, then: Snapshot | None) -> list[Latency]:
    out = []
    stage_rows = delta(now, then, sample(m.stage_seconds, "_bucket"))
    by_stage = buckets(stage_rows, ["stage"])
    by_instance = buckets(stage_rows, ["stage", "instance"])
    names = [s for s in STAGE_ORDER if (s,) in by_stage]
    names += sorted(k[0] for k in by_stage if k[0] not in STAGE_ORDER)
    for stage in names:
        row = _latency(stage, by_stage[(stage,)])
        row.detail = [_latency(instance or "(no instance)", b)
                      for (s, instance), b in sorted(by_instance.items()) if s == stage]
        if all(d.name == "(no instance)" for d in row.detail):
            row.detail = []  # a proxy-side step (rewrite): the stage row says it all
        out.append(row)
    for metric, label in ((m.first_byte_seconds, "first byte (end to end)"),
                          (m.duration_seconds, "total (end to end)")):
        total = buckets(delta(now, then, sample(metric, "_bucket")), [])
        if () in total:
            out.append(_latency(label, total[()]))
    return out


def _latency(name: str, cumulative: list[tuple[float, float]]) -> Latency:
    count = cumulative[-1][1] if cumulative else 0.0
    return Latency(name, count, quantile(0.5, cumulative), quantile(0.99, cumulative))


def charts(m: Families, samples: Sequence[Snapshot], now: Snapshot,
           fleet: Sequence[FleetEntry], span: float = STATUS_WINDOW_SECONDS) -> list[plots.Chart]:
    """Requests/s, 5xx ratio, time to first byte (p50, p99) and upstream calls in flight per
    instance, one point per sampling interval over the last ``span`` seconds."""
    points = [s for s in samples if s is not now and 0 < now.taken - s.taken <= span]
    if not points or now.taken - points[-1].taken >= MIN_STEP_SECONDS:
        points.append(now)
    rate: list[plots.Point] = []
    errors: list[plots.Point] = []
    p50: list[plots.Point] = []
    p99: list[plots.Point] = []
    requests, first_byte = sample(m.requests), sample(m.first_byte_seconds, "_bucket")
    in_flight_name = sample(m.in_flight)
    for then, snap in itertools.pairwise(points):
        at, seconds = snap.taken - now.taken, snap.taken - then.taken
        answered = delta(snap, then, requests)
        total = sum(n for _, n in answered)
        failed = sum(n for labels, n in answered if labels.get("status", "").startswith("5"))
        rate.append((at, total / seconds if seconds > 0 else None))
        errors.append((at, failed / total if total else None))
        ttfb = buckets(delta(snap, then, first_byte), []).get((), [])
        p50.append((at, quantile(0.5, ttfb)))
        p99.append((at, quantile(0.99, ttfb)))
    in_flight = []
    for e in sorted(fleet, key=lambda e: (_role_rank(e.role), e.url)):
        values = [(snap.taken - now.taken, summed(list(snap.series(in_flight_name)),
                                                  ["instance"]).get((e.url,), 0.0))
                  for snap in points]
        in_flight.append(plots.Line(f"{e.role} {e.url}", values))
    return [plots.Chart("Requests per second", "/s", span, [plots.Line("answered", rate)]),
            plots.Chart("5xx ratio", "ratio", span, [plots.Line("5xx / answered", errors)]),
            plots.Chart("Time to first byte", "seconds", span,
                        [plots.Line("p50", p50), plots.Line("p99", p99)]),
            plots.Chart("Upstream calls in flight", "", span, in_flight)]


def build(m: Families, now: Snapshot, then: Snapshot | None, fleet: Sequence[FleetEntry],
          ready: str, samples: Sequence[Snapshot] = (),
          sources: Sequence[Mapping[str, Any]] = ()) -> Status:
    """The page's content from the newest snapshot of the app's metrics ``m``, an older one,
    this worker's roster, (for the plots) the samples kept between them, and this worker's
    membership sources (``SourceState.doc()``)."""
    live_g, ok_g, latency_g, probed_g, in_flight_g = (
        summed(list(now.series(sample(g))), ["instance"]) for g in (
            m.instance_live, m.probe_ok, m.probe_latency, m.probe_time, m.in_flight))
    calls = summed(delta(now, then, sample(m.stage_seconds, "_count")), ["instance"])
    errors = summed(delta(now, then, sample(m.upstream_errors)), ["instance"])
    prompt = summed(delta(now, then, sample(m.prefill_prompt_tokens)), ["instance"])
    cached = summed(delta(now, then, sample(m.prefill_cached_tokens)), ["instance"])
    wall = time.time()
    rows = []
    for e in sorted(fleet, key=lambda e: (_role_rank(e.role), e.url)):
        key = (e.url,)
        live, probed, ok = live_g.get(key), probed_g.get(key), ok_g.get(key)
        rows.append(InstanceRow(
            e.role, e.url, e.live if live is None else live >= 1,
            None if ok is None else ok >= 1,
            None if probed is None else max(0.0, wall - probed),
            latency_g.get(key), in_flight_g.get(key, 0.0),
            calls.get(key, 0.0), errors.get(key, 0.0),
            cached.get(key, 0.0) / prompt[key] if prompt.get(key) else None))
    requests = sorted((route, status, n) for (route, status), n in summed(
        delta(now, then, sample(m.requests)), ["route", "status"]).items() if n > 0)
    counters = []
    for title, metric, by in (
            ("Retries by stage and cause", m.retries, ["stage", "cause"]),
            ("Routing decisions by role, policy, outcome and instance", m.routing,
             ["role", "policy", "outcome", "instance"]),
            ("Upstream errors by instance and kind", m.upstream_errors,
             ["instance", "stage", "kind"]),
            ("Probe failures", m.probe_failures, ["instance"]),
            ("Evictions", m.evictions, ["instance"]),
            ("Rejoins", m.rejoins, ["instance"]),
            ("Roster reloads", m.reloads, ["source", "outcome"])):
        items = [(" ".join(k), n) for k, n in
                 sorted(summed(delta(now, then, sample(metric)), by).items()) if n > 0]
        counters.append((title, items))
    chunks = sum(n for _, n in delta(now, then, sample(m.chunks)))
    window = None if then is None else now.taken - then.taken
    return Status(window, ready, rows, requests, _latencies(m, now, then), chunks, counters,
                  charts(m, samples, now, fleet), _models(m, now, then),
                  sources=_sources(m, now, sources))


def _sources(m: Families, now: Snapshot,
             sources: Sequence[Mapping[str, Any]]) -> list[SourceRow]:
    up = {labels.get("source"): value for labels, value in now.series(sample(m.discovery_up))}
    return [SourceRow(s["source"], bool(s["up"]) if up.get(s["source"]) is None
                      else up[s["source"]] >= 1, s["detail"], s["since"], s["members"])
            for s in sources]


def _models(m: Families, now: Snapshot, then: Snapshot | None) -> list[ModelRow]:
    served = summed(delta(now, then, sample(m.model_requests)), ["model"])
    errors = summed(delta(now, then, sample(m.model_errors)), ["model"])
    ttft = buckets(delta(now, then, sample(m.model_first_byte_seconds, "_bucket")), ["model"])
    return [ModelRow(model, n, errors.get((model,), 0.0),
                     _latency("time to first byte", ttft.get((model,), [])))
            for (model,), n in sorted(served.items()) if n > 0]


def _role_rank(role: str) -> int:
    return ROLES.index(role) if role in ROLES else len(ROLES)


# -- rendering ---------------------------------------------------------------------------------

STYLE = """
body{font-family:monospace;margin:1em 2em;color:#111;background:#fff}
table{border-collapse:collapse;margin:.3em 0 1em}
th,td{border:1px solid #bbb;padding:.15em .6em;text-align:right}
th{background:#eee}td.l,th.l{text-align:left}
.live{color:#060;font-weight:bold}.evicted{color:#b00;font-weight:bold}
.sub td.l{padding-left:1.5em;color:#444}
.chart{display:inline-block;vertical-align:top;margin:0 1.5em 1em 0}
.chart p{margin:.2em 0;font-size:90%}
"""


def render(status: Status, sections: Sequence[str] = ()) -> str:
    """The page; ``sections`` (HTML, e.g. tenanttable.py's) go before the instances."""
    e = html.escape
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.generated))
    if status.window is None:
        span = "since this worker started (no older sample yet)"
    else:
        span = f"over the last {status.window:.0f} s"
    out = [
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\">",
        f"<meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS}\">",
        f"<title>epd-flask status</title><style>{STYLE}</style></head><body>",
        "<h1>epd-flask status</h1>",
        f"<p>epd-flask {e(__version__)}. Generated {e(when)} by worker {status.pid}. "
        f"Ready: <b>{e(status.ready)}</b>. "
        f"Counts and rates are {e(span)}, summed over all workers.</p>",
    ]
    if status.charts:
        out.append("<h2>Last minutes</h2>")
        out.extend(f'<div class="chart"><h3>{e(chart.title)}</h3>{plots.svg(chart)}'
                   f"<p>{plots.legend(chart)}</p></div>" for chart in status.charts)
    if status.sources:
        out.append("<h2>Membership sources</h2>")
        out.append("<table><tr><th class=\"l\">source</th><th class=\"l\">state</th>"
                   "<th class=\"l\">since</th><th>instances</th>"
                   "<th class=\"l\">this worker</th></tr>")
        for src in status.sources:
            state = "UP" if src.up else "DOWN"
            out.append(f"<tr><td class=\"l\">{e(src.name)}</td>"
                       f"<td class=\"l {'live' if src.up else 'evicted'}\">{state}</td>"
                       f"<td class=\"l\">{_age(max(0.0, time.time() - src.since))}</td>"
                       f"<td>{src.members}</td><td class=\"l\">{e(src.detail)}</td></tr>")
        out.append("</table>")
    out.extend(sections)
    out.append("<h2>Instances</h2>")
    roles = []
    for row in status.instances:
        if row.role not in roles:
            roles.append(row.role)
    if not roles:
        out.append("<p>The roster is empty.</p>")
    for role in roles:
        rows = [r for r in status.instances if r.role == role]
        live = sum(r.live for r in rows)
        out.append(f"<h3>{e(role)}: {live} live, {len(rows) - live} evicted</h3>")
        out.append("<table><tr><th class=\"l\">instance</th><th class=\"l\">state</th>"
                   "<th class=\"l\">last probe</th><th>probe latency</th><th>in flight</th>"
                   "<th>calls</th><th>errors</th><th>cache hits</th></tr>")
        for r in rows:
            state = "LIVE" if r.live else "EVICTED"
            if r.probe_ok is None:
                probe = "not yet"
            else:
                probe = f"{'ok' if r.probe_ok else 'FAILED'}, {_age(r.probe_age)}"
            out.append(
                f"<tr><td class=\"l\">{e(r.url)}</td>"
                f"<td class=\"l {state.lower()}\">{state}</td><td class=\"l\">{e(probe)}</td>"
                f"<td>{_ms(r.probe_latency)}</td><td>{r.in_flight:.0f}</td>"
                f"<td>{r.calls:.0f}</td><td>{r.errors:.0f}</td>"
                f"<td>{_share(r.cache_hits)}</td></tr>")
        out.append("</table>")
    out.append("<h2>Requests</h2>")
    if status.requests:
        out.append("<table><tr><th class=\"l\">route</th><th>status</th><th>requests</th>"
                   "<th>per second</th></tr>")
        for route, code, n in status.requests:
            out.append(f"<tr><td class=\"l\">{e(route)}</td><td>{e(code)}</td><td>{n:.0f}</td>"
                       f"<td>{_rate(n, status.window)}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No requests.</p>")
    if status.models:
        out.append("<h2>Models</h2>")
        out.append("<table><tr><th class=\"l\">model</th><th>requests</th><th>per second</th>"
                   "<th>errors</th><th>TTFT p50</th><th>TTFT p99</th></tr>")
        for m in status.models:
            out.append(f"<tr><td class=\"l\">{e(m.name or '(not served)')}</td>"
                       f"<td>{m.requests:.0f}</td><td>{_rate(m.requests, status.window)}</td>"
                       f"<td>{m.errors:.0f}</td><td>{_ms(m.ttft.p50)}</td>"
                       f"<td>{_ms(m.ttft.p99)}</td></tr>")
        out.append("</table>")
    out.append(f"<p>Streamed chunks (about one per token): {status.chunks:.0f}, "
               f"{_rate(status.chunks, status.window)} per second.</p>")
    out.append("<h2>Latency by stage</h2>")
    if status.latencies:
        out.append("<table><tr><th class=\"l\">stage / instance</th><th>count</th>"
                   "<th>per second</th><th>p50</th><th>p99</th></tr>")
        for lat in status.latencies:
            out.append(_latency_row(lat, status.window, ""))
            out.extend(_latency_row(d, status.window, " class=\"sub\"", "&nbsp;&nbsp;")
                       for d in lat.detail)
        out.append("</table>")
    else:
        out.append("<p>No timed stages.</p>")
    for title, items in status.counters:
        out.append(f"<h2>{e(title)}</h2>")
        if not items:
            out.append("<p>None.</p>")
            continue
        out.append("<table>")
        out.extend(f"<tr><td class=\"l\">{e(k)}</td><td>{n:.0f}</td></tr>" for k, n in items)
        out.append("</table>")
    out.append("<p>Machine-readable: <a href=\"/metrics\">/metrics</a>.</p></body></html>")
    return "\n".join(out)


def _latency_row(lat: Latency, window: float | None, cls: str, indent: str = "") -> str:
    return (f"<tr{cls}><td class=\"l\">{indent}{html.escape(lat.name)}</td>"
            f"<td>{lat.count:.0f}</td>"
            f"<td>{_rate(lat.count, window)}</td><td>{_ms(lat.p50)}</td>"
            f"<td>{_ms(lat.p99)}</td></tr>")


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    return f"{seconds * 1000:.1f} ms"


def _share(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1%}"


def _rate(n: float, window: float | None) -> str:
    if not window:
        return "-"
    return f"{n / window:.2f}"


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s ago"
