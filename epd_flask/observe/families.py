"""Every metric the proxy exports, declared once: one ``Families`` per app, its metric objects
registered in the app's private registry, or in none when the app writes prometheus_client's
multiprocess files (observe/metrics.py decides which).

Label values are bounded: routes from a fixed list, instances only from the roster, error
kinds from the error taxonomy's codes, models only from what some instance of the roster
serves now or served lately (docs/behaviour.md#models). Other code names a metric through
these objects, never by a string of its own (``sample`` gives the name a sample is exposed
under).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from epd_flask.control.statedir import StateDir
from epd_flask.observe import tracing

# From a millisecond proxy step to a multi-minute generation.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))
#: A wait for capacity: up to ``admission.queue_timeout`` (30 s by default), coarser than
#: LATENCY_BUCKETS because each bucket is a series per tenant.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                float("inf"))
RELOAD_SOURCES = ("sighup", "admin")
RELOAD_OUTCOMES = ("ok", "rejected")


HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def _family(metric: Collector) -> Metric:
    return next(iter(metric.describe()))  # type: ignore[attr-defined, no-any-return]


def kind(metric: Collector) -> str:
    """``counter``, ``gauge`` or ``histogram``."""
    return str(_family(metric).type)


def sample(metric: Collector, part: str = "") -> str:
    """The name ``metric``'s samples are exposed under: a counter's ``_total``, a histogram's
    ``part`` (one of ``HISTOGRAM_PARTS``), a gauge's own name."""
    family = _family(metric)
    if (family.type == "histogram") != (part in HISTOGRAM_PARTS):
        raise ValueError(f"{family.name} is a {family.type}: no samples {part!r}")
    return family.name + ("_total" if family.type == "counter" else part)


class ReloadsCollector(Collector):
    """``epd_roster_reloads_total{source,outcome}``, read from the state directory's tally at
    scrape time: SIGHUP reloads happen in the gunicorn master, which cannot load
    prometheus_client (it imports ``ssl``), so the master counts them there and every worker
    shows the count; workers count admin changes beside them. An app without a state
    directory (a lone app) shows its own admin changes, counted from its events. Every
    series exists from the start at 0, so an alert's increase() sees the first reload."""

    NAME = "epd_roster_reloads"
    HELP = ("Roster reloads by source (sighup: the master re-read the file; admin: an admin API "
            "change) and outcome (ok: applied, rejected: refused, the last good roster kept).")

    def __init__(self, state: StateDir | None = None) -> None:
        self.state = state
        self._local: dict[str, int] = {}

    def count_local(self, source: str, outcome: str) -> None:
        key = f"{source}/{outcome}"
        self._local[key] = self._local.get(key, 0) + 1

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.NAME, self.HELP, labels=["source", "outcome"])

    def collect(self) -> Iterator[Metric]:
        tally: Mapping[str, int] = self.state.reloads() if self.state is not None \
            else self._local
        family = CounterMetricFamily(self.NAME, self.HELP, labels=["source", "outcome"])
        for source in RELOAD_SOURCES:
            for outcome in RELOAD_OUTCOMES:
                family.add_metric([source, outcome], tally.get(f"{source}/{outcome}", 0))
        yield family


class UpGauge:
    """A gauge without labels, 1 while a shared store answers and 0 while it does not, that
    exists only while a store is configured: a multiprocess gauge without labels writes its
    0 the moment it is made, which would say that a store nobody configured is down."""

    def __init__(self, name: str, documentation: str,
                 registry: CollectorRegistry | None) -> None:
        self.name = name
        self.documentation = documentation
        self._registry = registry
        self.gauge: Gauge | None = None

    def set(self, up: bool | None) -> None:
        """``up``: whether the store answered its latest call; None: none is configured any
        more, and the series goes from a registry of the app's own (multiprocess files cannot
        lose one: it stays at 1, nothing is down)."""
        if up is not None:
            if self.gauge is None:
                self.gauge = Gauge(self.name, self.documentation, multiprocess_mode="livemin",
                                   registry=self._registry)
            self.gauge.set(1 if up else 0)
        elif self.gauge is not None:
            if self._registry is not None:
                self._registry.unregister(self.gauge)
                self.gauge = None
            else:
                self.gauge.set(1)


class AdmissionFamilies:
    """Admission's metrics (docs/behaviour.md#admission), made when admission is first on: a
    proxy without it exposes none of them. Tenant labels are the roster's (at most 256 and
    ``default``, see observe/observer.py's ``TenantLabels``)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self.queue_depth = Gauge(
            "epd_admission_queue_depth", "Requests waiting for capacity right now, by tenant "
            "and its priority (all workers).", ["tenant", "priority"],
            multiprocess_mode="livesum", registry=r)
        self.admitted = Counter(
            "epd_admission_admitted_total", "Completion requests admission let through, by "
            "tenant (at once or after a wait).", ["tenant"], registry=r)
        self.wait_seconds = Histogram(
            "epd_admission_wait_seconds", "How long the requests that waited for capacity "
            "waited before they went out, by tenant and its priority.", ["tenant", "priority"],
            buckets=WAIT_BUCKETS, registry=r)
        self.rejected = Counter(
            "epd_admission_rejected_total", "Completion requests admission refused, by tenant "
            "and reason: rate_limit_requests, rate_limit_tokens (429), too_large (429, over "
            "the tokens limit on its own), queue_full, queue_timeout (503), client_gone (the "
            "client left while it waited).", ["tenant", "reason"], registry=r)
        self.tokens = Counter(
            "epd_admission_tokens_total", "Tokens of the requests admission let through (the "
            "answer's usage, prompt plus completion; a stream without one: its estimate), by "
            "tenant.", ["tenant"], registry=r)
        self.store_up = UpGauge(
            "epd_admission_store_up", "1 while the shared rate-limit store (admission.store) "
            "answered its latest call, 0 while each host counts on its own (the lowest of the "
            "live workers).", r)

    def collectors(self) -> list[Collector]:
        found: list[Collector] = [v for v in vars(self).values()
                                  if isinstance(v, Counter | Gauge | Histogram)]
        return found + ([self.store_up.gauge] if self.store_up.gauge is not None else [])


class Families:
    """One app's metric objects. ``registry`` None: not registered anywhere, their values
    live in this process's multiprocess files and a scrape reads the directory."""

    def __init__(self, registry: CollectorRegistry | None,
                 state: StateDir | None = None) -> None:
        self.registry = r = registry
        self.requests = Counter(
            "epd_requests_total", "Client requests answered, by route and HTTP status.",
            ["route", "status"], registry=r)
        self.stage_seconds = Histogram(
            "epd_stage_duration_seconds",
            "Time spent in one stage of a request (encode, rewrite, prefill, "
            "decode_first_byte), by the instance that served it.",
            ["stage", "instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_byte_seconds = Histogram(
            "epd_request_first_byte_seconds",
            "From the request's arrival to its first byte to the client (successful requests).",
            ["route", "instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.duration_seconds = Histogram(
            "epd_request_duration_seconds", "From the request's arrival to its last byte.",
            ["route", "instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.chunks = Counter(
            "epd_streamed_chunks_total",
            "SSE events relayed to clients (one per generated token with vLLM): rate() is "
            "tokens/s.", ["route", "instance"], registry=r)
        self.bytes = Counter(
            "epd_response_bytes_total", "Response body bytes relayed to clients.", ["route"],
            registry=r)
        self.retries = Counter(
            "epd_retries_total", "Attempts retried before the first byte, by the failed stage "
            "and the error code that caused it.", ["stage", "cause"], registry=r)
        self.routing = Counter(
            "epd_routing_decisions_total", "Routing decisions by role, policy and outcome "
            "(rotation, least, tie, hit, spill, nokey; kvhit, kvmiss, fallback: kv_aware's; "
            "skipped: a prompt short or mostly held by its decode went straight to decode) and "
            "the instance chosen.",
            ["role", "policy", "outcome", "instance"], registry=r)
        self.prefill_prompt_tokens = Counter(
            "epd_prefill_prompt_tokens_total", "Prompt tokens of the requests each prefill "
            "answered, as its usage reported them.", ["instance"], registry=r)
        self.prefill_cached_tokens = Counter(
            "epd_prefill_cached_tokens_total", "Of those prompt tokens, the ones the prefill "
            "served from its prefix cache (divided by the above: its cache-hit share).",
            ["instance"], registry=r)
        self.upstream_errors = Counter(
            "epd_upstream_errors_total", "Failed upstream calls of client requests, by "
            "instance and error code.", ["stage", "instance", "kind"], registry=r)
        self.kv_events = Counter(
            "epd_kv_events_total", "KV-cache events heard from an instance's kv_events "
            "endpoint (per worker), by kind: stored, removed, cleared; malformed: messages "
            "skipped; gap: a jump in the sequence (messages lost); dropped: messages let go "
            "unread (the reader fell behind, or one was too large).", ["instance", "kind"],
            registry=r)
        self.probe_failures = Counter(
            "epd_probe_failures_total", "Failed /health probes (per worker).",
            ["role", "instance"], registry=r)
        self.evictions = Counter(
            "epd_evictions_total", "Instances evicted (each worker decides for itself).",
            ["role", "instance"], registry=r)
        self.rejoins = Counter(
            "epd_rejoins_total", "Evicted instances that rejoined (per worker).",
            ["role", "instance"], registry=r)
        self.in_flight = Gauge(
            "epd_upstream_in_flight", "Upstream calls open right now, per instance.",
            ["role", "instance"], multiprocess_mode="livesum", registry=r)
        self.instances = Gauge(
            "epd_instances", "Roster instances per role that are live or evicted (the latest "
            "view any worker reported).", ["role", "state"],
            multiprocess_mode="livemostrecent", registry=r)
        self.instance_live = Gauge(
            "epd_instance_live", "1 while the instance is live, 0 while evicted.",
            ["role", "instance"], multiprocess_mode="livemostrecent", registry=r)
        self.probe_ok = Gauge(
            "epd_instance_last_probe_ok", "1 if the latest /health probe passed.",
            ["role", "instance"], multiprocess_mode="livemostrecent", registry=r)
        self.probe_latency = Gauge(
            "epd_instance_last_probe_latency_seconds", "How long the latest /health probe "
            "took.", ["role", "instance"], multiprocess_mode="livemostrecent", registry=r)
        self.probe_time = Gauge(
            "epd_instance_last_probe_timestamp_seconds", "When the latest /health probe ended "
            "(Unix time).", ["role", "instance"], multiprocess_mode="livemostrecent",
            registry=r)
        self.model_requests = Counter(
            "epd_model_requests_total", "Completion requests answered, by the model they named "
            "(empty: a name no instance serves, or none).", ["model"], registry=r)
        self.model_errors = Counter(
            "epd_model_errors_total", "Completion requests of a model that ended in a "
            "server-side error (a 5xx status, or an error in the stream).", ["model"],
            registry=r)
        self.model_first_byte_seconds = Histogram(
            "epd_model_first_byte_seconds", "From a successful completion request's arrival to "
            "its first byte to the client (time to first token), by model.", ["model"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.discovery_up = Gauge(
            "epd_discovery_up", "1 while a membership source (etcd, dns) answers, 0 while the "
            "last membership it gave is served without it (the lowest of the live workers).",
            ["source"], multiprocess_mode="livemin", registry=r)
        self.client_in_flight = Gauge(
            "epd_requests_in_flight", "Client requests being served right now (streams "
            "included).", multiprocess_mode="livesum", registry=r)
        self.in_flight_limit = Gauge(
            "epd_requests_in_flight_limit", "The per-worker cap on client requests in flight "
            "(EPD_MAX_IN_FLIGHT); past it requests get 503 overloaded.",
            multiprocess_mode="livemax", registry=r)
        # The cap is per worker and gunicorn does not spread connections evenly, so the sum
        # over workers above cannot say how close any one of them is to refusing.
        self.busiest_in_flight = Gauge(
            "epd_requests_in_flight_busiest_worker", "Client requests in flight on the busiest "
            "worker right now: the one to compare with epd_requests_in_flight_limit.",
            multiprocess_mode="livemax", registry=r)
        self.refused = Counter(
            "epd_requests_refused_total", "Client requests refused before they started, by "
            "reason (overloaded: the worker was at its in-flight cap).", ["reason"],
            registry=r)
        # Series an alert takes increase() of exist from the start at 0: a counter that first
        # appears already at 1 shows no increase to Prometheus, and its first event would
        # never alert.
        self.refused.labels("overloaded")
        self.tracing_spans_exported = Counter(
            "epd_tracing_spans_exported_total", "Spans sent to the OTLP collector (tracing "
            "on).", registry=r)
        self.tracing_spans_dropped = Counter(
            "epd_tracing_spans_dropped_total", "Spans lost on their way to the collector, by "
            "reason: queue_full (the worker's queue, OTEL_BSP_MAX_QUEUE_SIZE, was full), "
            "export_failed (the collector refused a batch or took none in time), shutdown (a "
            "stopping worker could not send them).", ["reason"], registry=r)
        for reason in tracing.DROP_REASONS:
            self.tracing_spans_dropped.labels(reason)
        self.ended_by_shutdown = Counter(
            "epd_requests_ended_by_shutdown_total", "Requests a stopping worker ended (with an "
            "in-band error, or a 503) because they outlived its grace period.", registry=r)
        self.load_store_up = UpGauge(
            "epd_load_store_up", "1 while the store where proxy hosts share their open calls "
            "(load_store) answered the host's latest exchange, 0 while routing counts the "
            "other hosts through the engines' queues alone (the lowest of the live workers).",
            r)
        self.reloads = ReloadsCollector(state)
        if r is not None:
            r.register(self.reloads)
        #: None until admission is first on (``admission_on``).
        self.admission: AdmissionFamilies | None = None

    def admission_on(self) -> AdmissionFamilies:
        if self.admission is None:
            self.admission = AdmissionFamilies(self.registry)
        return self.admission

    def by_model(self) -> tuple[Counter | Histogram, ...]:
        """The metrics labelled by model alone."""
        return (self.model_requests, self.model_errors, self.model_first_byte_seconds)

    def forget_model(self, name: str) -> None:
        """Drop ``name``'s series. Only a registry of the app's own can: prometheus_client
        cannot remove a series from multiprocess files (the exposition leaves it out
        instead, see observe/mpdir.py)."""
        if self.registry is None:
            return
        for metric in self.by_model():
            with contextlib.suppress(KeyError):
                metric.remove(name)

    def collectors(self) -> list[Collector]:
        """Every metric above, in declaration order (admission's once it is on)."""
        found: list[Collector] = [v for v in vars(self).values()
                                  if isinstance(v, Counter | Gauge | Histogram | ReloadsCollector)]
        if self.load_store_up.gauge is not None:
            found.append(self.load_store_up.gauge)
        return found + (self.admission.collectors() if self.admission is not None else [])
