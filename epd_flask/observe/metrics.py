"""The proxy's Prometheus metrics: their definitions, the observer that feeds them from the
serving path's events, the ``/metrics`` exposition and the snapshots ``/status`` is drawn from.

Under gunicorn every worker writes its values to ``PROMETHEUS_MULTIPROC_DIR`` (prepared by the
master, see metricsdir.py) and any worker's scrape sums them all, through prometheus_client's
multiprocess mode. Without that variable (tests, a single process) the values live in a private
in-memory registry. Label values are bounded: routes from a fixed list, instances only from the
roster, error kinds from the error taxonomy's codes, models only from what some instance of
the roster serves (docs/behaviour.md#models).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess as prom_multiprocess
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from epd_flask.control import settings
from epd_flask.control.metricsdir import ENV as MULTIPROC_ENV
from epd_flask.control.statedir import StateDir
from epd_flask.core.events import Events, FleetEntry
from epd_flask.core.periodic import Periodic
from epd_flask.observe import mpvalues, tracing
from epd_flask.serving.context import FIRST_BYTE, TOTAL, RequestContext

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# From a millisecond proxy step to a multi-minute generation.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))
KNOWN_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
OTHER_ROUTE = "passthrough"
NO_INSTANCE = ""
NO_MODEL = ""
# A stage spread over several instances at once (encoder fan-out) is timed as a whole.
SEVERAL_INSTANCES = "several"
# /status compares the newest sample with one this old.
STATUS_WINDOW_SECONDS = 300.0
SAMPLE_INTERVAL_SECONDS = 10.0
RELOAD_SOURCES = ("sighup", "admin")
RELOAD_OUTCOMES = ("ok", "rejected")

MULTIPROCESS = bool(settings.read(MULTIPROC_ENV))
mpvalues.install()  # before the first metric below creates its values
_REGISTRY: CollectorRegistry | None = None if MULTIPROCESS else CollectorRegistry()

REQUESTS = Counter("epd_requests_total", "Client requests answered, by route and HTTP status.",
                   ["route", "status"], registry=_REGISTRY)
STAGE_SECONDS = Histogram(
    "epd_stage_duration_seconds",
    "Time spent in one stage of a request (encode, rewrite, prefill, decode_first_byte), "
    "by the instance that served it.",
    ["stage", "instance"], buckets=LATENCY_BUCKETS, registry=_REGISTRY)
FIRST_BYTE_SECONDS = Histogram(
    "epd_request_first_byte_seconds",
    "From the request's arrival to its first byte to the client (successful requests).",
    ["route", "instance"], buckets=LATENCY_BUCKETS, registry=_REGISTRY)
DURATION_SECONDS = Histogram(
    "epd_request_duration_seconds", "From the request's arrival to its last byte.",
    ["route", "instance"], buckets=LATENCY_BUCKETS, registry=_REGISTRY)
CHUNKS = Counter(
    "epd_streamed_chunks_total",
    "SSE events relayed to clients (one per generated token with vLLM): rate() is tokens/s.",
    ["route", "instance"], registry=_REGISTRY)
BYTES = Counter("epd_response_bytes_total", "Response body bytes relayed to clients.",
                ["route"], registry=_REGISTRY)
RETRIES = Counter("epd_retries_total", "Attempts retried before the first byte, by the failed "
                  "stage and the error code that caused it.", ["stage", "cause"],
                  registry=_REGISTRY)
ROUTING = Counter(
    "epd_routing_decisions_total", "Routing decisions by role, policy and outcome (rotation, "
    "least, tie, hit, spill, nokey; kvhit, kvmiss, fallback: kv_aware's; skipped: a prompt "
    "short or mostly held by its decode went straight to decode) and the "
    "instance chosen.", ["role", "policy", "outcome", "instance"], registry=_REGISTRY)
PREFILL_PROMPT_TOKENS = Counter(
    "epd_prefill_prompt_tokens_total", "Prompt tokens of the requests each prefill answered, "
    "as its usage reported them.", ["instance"], registry=_REGISTRY)
PREFILL_CACHED_TOKENS = Counter(
    "epd_prefill_cached_tokens_total", "Of those prompt tokens, the ones the prefill served "
    "from its prefix cache (divided by the above: its cache-hit share).", ["instance"],
    registry=_REGISTRY)
UPSTREAM_ERRORS = Counter(
    "epd_upstream_errors_total", "Failed upstream calls of client requests, by instance and "
    "error code.", ["stage", "instance", "kind"], registry=_REGISTRY)
KV_EVENTS = Counter(
    "epd_kv_events_total", "KV-cache events heard from an instance's kv_events endpoint (per "
    "worker), by kind: stored, removed, cleared; malformed: messages skipped; gap: a jump in "
    "the sequence (messages lost); dropped: messages let go unread (the reader fell behind, "
    "or one was too large).", ["instance", "kind"], registry=_REGISTRY)
PROBE_FAILURES = Counter("epd_probe_failures_total", "Failed /health probes (per worker).",
                         ["role", "instance"], registry=_REGISTRY)
EVICTIONS = Counter("epd_evictions_total", "Instances evicted (each worker decides for itself).",
                    ["role", "instance"], registry=_REGISTRY)
REJOINS = Counter("epd_rejoins_total", "Evicted instances that rejoined (per worker).",
                  ["role", "instance"], registry=_REGISTRY)
IN_FLIGHT = Gauge("epd_upstream_in_flight", "Upstream calls open right now, per instance.",
                  ["role", "instance"], multiprocess_mode="livesum", registry=_REGISTRY)
INSTANCES = Gauge("epd_instances", "Roster instances per role that are live or evicted (the "
                  "latest view any worker reported).", ["role", "state"],
                  multiprocess_mode="livemostrecent", registry=_REGISTRY)
INSTANCE_LIVE = Gauge("epd_instance_live", "1 while the instance is live, 0 while evicted.",
                      ["role", "instance"], multiprocess_mode="livemostrecent",
                      registry=_REGISTRY)
PROBE_OK = Gauge("epd_instance_last_probe_ok", "1 if the latest /health probe passed.",
                 ["role", "instance"], multiprocess_mode="livemostrecent", registry=_REGISTRY)
PROBE_LATENCY = Gauge("epd_instance_last_probe_latency_seconds",
                      "How long the latest /health probe took.", ["role", "instance"],
                      multiprocess_mode="livemostrecent", registry=_REGISTRY)
PROBE_TIME = Gauge("epd_instance_last_probe_timestamp_seconds",
                   "When the latest /health probe ended (Unix time).", ["role", "instance"],
                   multiprocess_mode="livemostrecent", registry=_REGISTRY)


MODEL_REQUESTS = Counter(
    "epd_model_requests_total", "Completion requests answered, by the model they named (empty: "
    "a name no instance serves, or none).", ["model"], registry=_REGISTRY)
MODEL_ERRORS = Counter(
    "epd_model_errors_total", "Completion requests of a model that ended in a server-side error "
    "(a 5xx status, or an error in the stream).", ["model"], registry=_REGISTRY)
MODEL_FIRST_BYTE_SECONDS = Histogram(
    "epd_model_first_byte_seconds", "From a successful completion request's arrival to its "
    "first byte to the client (time to first token), by model.", ["model"],
    buckets=LATENCY_BUCKETS, registry=_REGISTRY)

DISCOVERY_UP = Gauge("epd_discovery_up", "1 while a membership source (etcd, dns) answers, "
                     "0 while the last membership it gave is served without it (the lowest "
                     "of the live workers).", ["source"], multiprocess_mode="livemin",
                     registry=_REGISTRY)
CLIENT_IN_FLIGHT = Gauge(
    "epd_requests_in_flight", "Client requests being served right now (streams included).",
    multiprocess_mode="livesum", registry=_REGISTRY)
IN_FLIGHT_LIMIT = Gauge(
    "epd_requests_in_flight_limit", "The per-worker cap on client requests in flight "
    "(EPD_MAX_IN_FLIGHT); past it requests get 503 overloaded.",
    multiprocess_mode="livemax", registry=_REGISTRY)
# The cap is per worker and gunicorn does not spread connections evenly, so the sum over
# workers above cannot say how close any one of them is to refusing.
BUSIEST_IN_FLIGHT = Gauge(
    "epd_requests_in_flight_busiest_worker", "Client requests in flight on the busiest worker "
    "right now: the one to compare with epd_requests_in_flight_limit.",
    multiprocess_mode="livemax", registry=_REGISTRY)
REFUSED = Counter("epd_requests_refused_total", "Client requests refused before they started, "
                  "by reason (overloaded: the worker was at its in-flight cap).", ["reason"],
                  registry=_REGISTRY)
# Series an alert takes increase() of exist from the start at 0: a counter that first appears
# already at 1 shows no increase to Prometheus, and its first event would never alert.
REFUSED.labels("overloaded")
TRACING_SPANS_EXPORTED = Counter(
    "epd_tracing_spans_exported_total", "Spans sent to the OTLP collector (tracing on).",
    registry=_REGISTRY)
TRACING_SPANS_DROPPED = Counter(
    "epd_tracing_spans_dropped_total", "Spans lost on their way to the collector, by reason: "
    "queue_full (the worker's queue, OTEL_BSP_MAX_QUEUE_SIZE, was full), export_failed (the "
    "collector refused a batch or took none in time), shutdown (a stopping worker could not "
    "send them).", ["reason"], registry=_REGISTRY)
for _reason in tracing.DROP_REASONS:
    TRACING_SPANS_DROPPED.labels(_reason)
ENDED_BY_SHUTDOWN = Counter(
    "epd_requests_ended_by_shutdown_total", "Requests a stopping worker ended (with an "
    "in-band error, or a 503) because they outlived its grace period.", registry=_REGISTRY)


def route_label(path: str) -> str:
    """A free-form path never becomes a label: anything but a completion route is one value."""
    return path if path in KNOWN_ROUTES else OTHER_ROUTE


class MetricsObserver:
    """Turns serving-path events into metric updates: one listener per hook of events.py.

    The per-request updates go to children looked up once per label set and kept here:
    prometheus_client's ``labels()`` checks and converts the values and takes a lock on every
    call (a gevent lock in a worker): this cut the observer's CPU per non-stream request from
    29.5 to 20.5 us. Label sets are bounded (see the module docstring), so is this cache.
    """

    def __init__(self) -> None:
        # Every URL any roster of this process listed: the only allowed instance labels.
        self.known: set[str] = set()
        self.roles_seen: set[str] = set()
        # Every model name an instance of this process's rosters served: the model labels.
        self.models_known: set[str] = set()
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self._limit: int | None = None
        # epd_instance_live as last set, for the instances of the latest fleet event.
        self._live: dict[tuple[str, str], int] = {}

    def model_label(self, model: str | None) -> str:
        return model if model in self.models_known else NO_MODEL

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def instance_label(self, url: str | None) -> str:
        if url and "," in url and all(u in self.known for u in url.split(",")):
            return SEVERAL_INSTANCES
        return url if url in self.known else NO_INSTANCE

    def request_finished(self, ctx: RequestContext) -> None:
        route = route_label(ctx.route)
        child = self._child
        child(REQUESTS, route, str(ctx.status or 0)).inc()
        served_by = self.instance_label(ctx.instances.get("decode"))
        for stage, ms in ctx.timings.items():
            seconds = ms / 1000.0
            if stage == TOTAL:
                child(DURATION_SECONDS, route, served_by).observe(seconds)
            elif stage == FIRST_BYTE:
                child(FIRST_BYTE_SECONDS, route, served_by).observe(seconds)
            else:
                role = stage.split("_", 1)[0]
                child(STAGE_SECONDS, stage,
                      self.instance_label(ctx.instances.get(role))).observe(seconds)
        if ctx.chunks:
            child(CHUNKS, route, served_by).inc(ctx.chunks)
        if ctx.bytes_out:
            child(BYTES, route).inc(ctx.bytes_out)
        if route != OTHER_ROUTE:
            self._per_model(ctx)

    def _per_model(self, ctx: RequestContext) -> None:
        model = self.model_label(ctx.model)
        self._child(MODEL_REQUESTS, model).inc()
        failed = (ctx.status or 0) >= 500 or (ctx.error is not None and ctx.status == 200)
        if failed:
            self._child(MODEL_ERRORS, model).inc()
        first = ctx.timings.get(FIRST_BYTE)
        if first is not None and not failed:
            self._child(MODEL_FIRST_BYTE_SECONDS, model).observe(first / 1000.0)

    def listen(self, events: Events) -> None:
        """Listen to every hook of ``events``, each with the method of its name (idempotent)."""
        for name, hook in events.hooks().items():
            hook.add_listener(getattr(self, name))

    def upstream_opened(self, role: str, url: str) -> None:
        self._child(IN_FLIGHT, role, self.instance_label(url)).inc()

    def upstream_closed(self, role: str, url: str) -> None:
        self._child(IN_FLIGHT, role, self.instance_label(url)).dec()

    def upstream_error(self, stage: str, url: str, kind: str) -> None:
        UPSTREAM_ERRORS.labels(stage, self.instance_label(url), kind).inc()

    def routed(self, role: str, policy: str, outcome: str, url: str) -> None:
        self._child(ROUTING, role, policy, outcome, self.instance_label(url)).inc()

    def prefill_tokens(self, url: str, prompt: int, cached: int) -> None:
        instance = self.instance_label(url)
        self._child(PREFILL_PROMPT_TOKENS, instance).inc(prompt)
        self._child(PREFILL_CACHED_TOKENS, instance).inc(cached)

    def kv_events(self, url: str, kind: str, count: int) -> None:
        KV_EVENTS.labels(self.instance_label(url), kind).inc(count)

    def retry(self, stage: str, cause: str) -> None:
        RETRIES.labels(stage, cause).inc()

    def probe(self, role: str, url: str, ok: bool, latency: float) -> None:
        instance = self.instance_label(url)
        if not ok:
            PROBE_FAILURES.labels(role, instance).inc()
        PROBE_OK.labels(role, instance).set(1 if ok else 0)
        PROBE_LATENCY.labels(role, instance).set(latency)
        PROBE_TIME.labels(role, instance).set(time.time())

    def evicted(self, role: str, url: str) -> None:
        EVICTIONS.labels(role, self.instance_label(url)).inc()

    def rejoined(self, role: str, url: str) -> None:
        REJOINS.labels(role, self.instance_label(url)).inc()

    def fleet(self, entries: Sequence[FleetEntry]) -> None:
        """Every change of a fleet (a source's change, an eviction) lists the whole fleet:
        only the instances whose state changed are written, so a change costs a fleet of
        thousands what it costs a small one (a gauge write per instance was 6 ms per change
        with 1,000 instances)."""
        self.known.update(e.url for e in entries)
        counts: dict[str, list[int]] = {role: [0, 0] for role in self.roles_seen}
        before, now = self._live, {}
        for e in entries:
            counts.setdefault(e.role, [0, 0])[0 if e.live else 1] += 1
            key, live = (e.role, e.url), 1 if e.live else 0
            now[key] = live
            if before.get(key) != live:
                INSTANCE_LIVE.labels(e.role, e.url).set(live)
        self._live = now
        for role, (live, evicted) in counts.items():
            INSTANCES.labels(role, "live").set(live)
            INSTANCES.labels(role, "evicted").set(evicted)
        self.roles_seen.update(counts)

    def forget_instances(self) -> None:
        """Drop the per-instance state gauges (tests: the apps of one process come and go,
        and a later one may reuse a port, so an instance label, of an earlier one)."""
        for gauge in (INSTANCE_LIVE, PROBE_OK, PROBE_LATENCY, PROBE_TIME):
            gauge.clear()
        self._live = {}

    def models(self, names: Sequence[str]) -> None:
        self.models_known.update(names)

    def reload(self, source: str, ok: bool) -> None:
        RELOADS.count_local(source, "ok" if ok else "rejected")

    def load(self, in_flight: int, limit: int) -> None:
        CLIENT_IN_FLIGHT.set(in_flight)
        BUSIEST_IN_FLIGHT.set(in_flight)
        if limit != self._limit:  # the cap changes with a reload, not per request
            IN_FLIGHT_LIMIT.set(limit)
            self._limit = limit

    def discovery(self, source: str, up: bool) -> None:
        DISCOVERY_UP.labels(source).set(1 if up else 0)

    def refused(self, reason: str) -> None:
        REFUSED.labels(reason).inc()

    def ended_by_shutdown(self, count: int) -> None:
        ENDED_BY_SHUTDOWN.inc(count)

    def tracing_spans(self, reason: str | None, count: int) -> None:
        if reason is None:
            TRACING_SPANS_EXPORTED.inc(count)
        else:
            TRACING_SPANS_DROPPED.labels(reason).inc(count)


OBSERVER = MetricsObserver()


class ReloadsCollector(Collector):
    """``epd_roster_reloads_total{source,outcome}``, read from the state directory's tally at
    scrape time: SIGHUP reloads happen in the gunicorn master, which cannot load
    prometheus_client (it imports ``ssl``), so the master counts them there and every worker
    shows the count; workers count admin changes beside them. A process without a state
    directory (a lone app) shows its own admin changes, counted from its events. Every
    series exists from the start at 0, so an alert's increase() sees the first reload."""

    def __init__(self) -> None:
        self.state: StateDir | None = None
        self._local: dict[str, int] = {}

    def count_local(self, source: str, outcome: str) -> None:
        key = f"{source}/{outcome}"
        self._local[key] = self._local.get(key, 0) + 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        tally = self.state.reloads() if self.state is not None else self._local
        family = CounterMetricFamily(
            "epd_roster_reloads", "Roster reloads by source (sighup: the master re-read the "
            "file; admin: an admin API change) and outcome (ok: applied, rejected: refused, "
            "the last good roster kept).", labels=["source", "outcome"])
        for source in RELOAD_SOURCES:
            for outcome in RELOAD_OUTCOMES:
                family.add_metric([source, outcome], tally.get(f"{source}/{outcome}", 0))
        yield family


RELOADS = ReloadsCollector()
if _REGISTRY is not None:
    _REGISTRY.register(RELOADS)


def install(events: Events, state_dir: str | None = None) -> None:
    """Subscribe the metrics to an app's events (idempotent); ``state_dir`` is where reloads
    are tallied."""
    OBSERVER.listen(events)
    RELOADS.state = StateDir(state_dir) if state_dir else None


def _collecting_registry() -> CollectorRegistry:
    if _REGISTRY is not None:
        return _REGISTRY
    registry = CollectorRegistry()
    prom_multiprocess.MultiProcessCollector(registry)
    registry.register(RELOADS)
    return registry


def exposition() -> bytes:
    """The ``/metrics`` body: every worker's values summed (or this process's, alone)."""
    return generate_latest(_collecting_registry())


Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Snapshot:
    """Every sample of one collection, keyed by sample name and sorted labels."""

    taken: float
    values: dict[Key, float]

    def series(self, name: str) -> Iterator[tuple[dict[str, str], float]]:
        for (sample, labels), value in self.values.items():
            if sample == name:
                yield dict(labels), value


def snapshot(keys: dict[Key, Key] | None = None) -> Snapshot:
    """Every sample now. ``keys``: the keys of an earlier snapshot, whose objects this one
    reuses (see ``History``)."""
    values: dict[Key, float] = {}
    for family in _collecting_registry().collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key: Key = (s.name, tuple(sorted(s.labels.items())))
            if keys is not None:
                key = keys.get(key, key)
            values[key] = s.value
    return Snapshot(time.monotonic(), values)


class History:
    """Snapshots of the last few minutes, so /status can show rates and percentiles over a
    recent window instead of since the start. One sampling greenlet per worker."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_SECONDS,
                 window: float = STATUS_WINDOW_SECONDS) -> None:
        self.interval = interval
        self.window = window
        self._samples: deque[Snapshot] = deque()
        # The newest sample's keys: each sample shares them with the one before instead of
        # holding its own copy of every label string (a fleet of 1,000 instances has tens of
        # thousands of series, and a window of 30 samples held them 30 times).
        self._keys: dict[Key, Key] = {}
        self._loop = Periodic("metrics sample", self.sample, lambda: self.interval)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def sample(self) -> Snapshot:
        snap = snapshot(self._keys)
        self._keys = {key: key for key in snap.values}
        self._samples.append(snap)
        while len(self._samples) > 1 and snap.taken - self._samples[1].taken >= self.window:
            self._samples.popleft()
        return snap

    def samples(self) -> list[Snapshot]:
        """The kept samples, oldest first (the status page's plots)."""
        return list(self._samples)

    def baseline(self, now: Snapshot) -> Snapshot | None:
        """The oldest kept sample within the window before ``now`` (None: nothing older)."""
        for snap in self._samples:
            if snap is not now and now.taken - snap.taken <= self.window + self.interval:
                return snap
        return None


