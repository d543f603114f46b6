"""Turns one app's serving-path events into updates of its metrics: one listener method per
hook of ``core.events.Events``, of the same name."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from epd_flask.control.roster import MAX_TENANTS
from epd_flask.core.events import Events, FleetEntry
from epd_flask.observe.families import Families
from epd_flask.serving.admission import REASONS
from epd_flask.serving.context import FIRST_BYTE, TOTAL, RequestContext

KNOWN_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
OTHER_ROUTE = "passthrough"
NO_INSTANCE = ""
# A stage spread over several instances at once (encoder fan-out) is timed as a whole.
SEVERAL_INSTANCES = "several"
#: Model names no instance serves any more that still label series: a request racing an
#: unload, or a scrape right after one, still finds its model's series.
RECENT_MODELS = 32
#: Instances that left the fleet whose series still show: their last requests drain after
#: they leave (docs/behaviour.md#discovery), and a scrape right after sees their last counts.
#: Older ones are left out of the exposition (a churning fleet, pods coming and going, would
#: otherwise grow it without end) and labelled "" if a straggler still reports one.
RECENT_INSTANCES = 64
#: At most this many distinct model labels in an app's life: a multiprocess file keeps every
#: series it was ever given (prometheus_client cannot remove one), so a fleet churning
#: adapter names would grow it, and every scrape, without end. Later names count under "".
MAX_MODEL_LABELS = 256
#: At most this many distinct tenant labels in an app's life: a roster names at most
#: MAX_TENANTS, but reloads may rename them, and a multiprocess file keeps every series it
#: was given. Later names count under "".
MAX_TENANT_LABELS = 4 * MAX_TENANTS

logger = logging.getLogger(__name__)


def route_label(path: str) -> str:
    """A free-form path never becomes a label: anything but a completion route is one value."""
    return path if path in KNOWN_ROUTES else OTHER_ROUTE


class LabelWindow:
    """Which names of one kind (models, instances) may label a series: the ones present now,
    and the ``recent`` last ones that left, so a request racing a departure, or a scrape right
    after one, still finds its series; with ``most``, at most that many distinct names in an
    app's life. Any other name is ``""`` (docs/behaviour.md#models, #discovery)."""

    def __init__(self, kind: str, recent: int, most: int | None = None) -> None:
        self.kind = kind
        self.served: frozenset[str] = frozenset()
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.used: set[str] = set()
        self._recent_cap = recent
        self._most = most
        self._warned = False

    def update(self, names: Iterable[str]) -> list[str]:
        """Names present now; returns those no longer allowed to label anything."""
        served = frozenset(names)
        for gone in sorted(self.served - served):
            self.recent[gone] = None
            self.recent.move_to_end(gone)
        for back in served:
            self.recent.pop(back, None)
        self.served = served
        dropped = []
        while len(self.recent) > self._recent_cap:
            dropped.append(self.recent.popitem(last=False)[0])
        return dropped

    def allowed(self, name: str) -> bool:
        return name == "" or name in self.served or name in self.recent

    def label(self, name: str | None) -> str:
        if not name or not self.allowed(name):
            return ""
        if self._most is not None and name not in self.used:
            if len(self.used) >= self._most:
                if not self._warned:
                    self._warned = True
                    logger.warning("metrics: %d %s names labelled already; later ones are "
                                   "counted under %s=\"\"", self._most, self.kind, self.kind)
                return ""
            self.used.add(name)
        return name


class TenantLabels:
    """Which tenant names may label a series: the gate names only the roster's tenants and
    ``default`` (docs/behaviour.md#admission); this bounds what a life of reloads adds up to."""

    def __init__(self, most: int = MAX_TENANT_LABELS) -> None:
        self.used: set[str] = set()
        self._most = most
        self._warned = False

    def label(self, tenant: str) -> str:
        if tenant not in self.used:
            if len(self.used) >= self._most:
                if not self._warned:
                    self._warned = True
                    logger.warning("metrics: %d tenant names labelled already; later ones are "
                                   "counted under tenant=\"\"", self._most)
                return ""
            self.used.add(tenant)
        return tenant


class MetricsObserver:
    """The per-request updates go to children looked up once per label set and kept here:
    prometheus_client's ``labels()`` checks and converts the values and takes a lock on every
    call (a gevent lock in a worker): this cut the observer's CPU per non-stream request from
    29.5 to 20.5 us. Label sets are bounded (see families.py), so is this cache.
    """

    def __init__(self, families: Families) -> None:
        self.m = families
        self.roles_seen: set[str] = set()
        self.model_labels = LabelWindow("model", RECENT_MODELS, MAX_MODEL_LABELS)
        self.instance_labels = LabelWindow("instance", RECENT_INSTANCES)
        self.tenant_labels = TenantLabels()
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self._limit: int | None = None
        # epd_instance_live as last set, for the instances of the latest fleet event.
        self._live: dict[tuple[str, str], int] = {}

    def listen(self, events: Events) -> None:
        """Listen to every hook of ``events``, each with the method of its name (idempotent)."""
        for name, hook in events.hooks().items():
            hook.add_listener(getattr(self, name))

    def model_label(self, model: str | None) -> str:
        return self.model_labels.label(model)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def instance_label(self, url: str | None) -> str:
        allowed = self.instance_labels.allowed
        if url and "," in url and all(allowed(u) for u in url.split(",")):
            return SEVERAL_INSTANCES
        return self.instance_labels.label(url)

    def shown(self, kind: str, instance: str) -> bool:
        """Whether the exposition shows a series of this ``instance`` label: a gauge says how
        things are now, so only while the instance is in the fleet (an alert on
        ``epd_instance_live == 0`` must not fire for one that left); counts a while longer."""
        if instance in (NO_INSTANCE, SEVERAL_INSTANCES):
            return True
        if kind == "gauge":
            return instance in self.instance_labels.served
        return self.instance_labels.allowed(instance)

    def request_finished(self, ctx: RequestContext) -> None:
        m = self.m
        route = route_label(ctx.route)
        child = self._child
        child(m.requests, route, str(ctx.status or 0)).inc()
        served_by = self.instance_label(ctx.instances.get("decode"))
        for stage, ms in ctx.timings.items():
            seconds = ms / 1000.0
            if stage == TOTAL:
                child(m.duration_seconds, route, served_by).observe(seconds)
            elif stage == FIRST_BYTE:
                child(m.first_byte_seconds, route, served_by).observe(seconds)
            else:
                role = stage.split("_", 1)[0]
                child(m.stage_seconds, stage,
                      self.instance_label(ctx.instances.get(role))).observe(seconds)
        if ctx.chunks:
            child(m.chunks, route, served_by).inc(ctx.chunks)
        if ctx.bytes_out:
            child(m.bytes, route).inc(ctx.bytes_out)
        if route != OTHER_ROUTE:
            self._per_model(ctx)

    def _per_model(self, ctx: RequestContext) -> None:
        m = self.m
        model = self.model_label(ctx.model)
        self._child(m.model_requests, model).inc()
        failed = (ctx.status or 0) >= 500 or (ctx.error is not None and ctx.status == 200)
        if failed:
            self._child(m.model_errors, model).inc()
        first = ctx.timings.get(FIRST_BYTE)
        if first is not None and not failed:
            self._child(m.model_first_byte_seconds, model).observe(first / 1000.0)

    def upstream_opened(self, role: str, url: str) -> None:
        self._child(self.m.in_flight, role, self.instance_label(url)).inc()

    def upstream_closed(self, role: str, url: str) -> None:
        self._child(self.m.in_flight, role, self.instance_label(url)).dec()

    def upstream_error(self, stage: str, url: str, kind: str) -> None:
        self.m.upstream_errors.labels(stage, self.instance_label(url), kind).inc()

    def routed(self, role: str, policy: str, outcome: str, url: str) -> None:
        self._child(self.m.routing, role, policy, outcome, self.instance_label(url)).inc()

    def prefill_tokens(self, url: str, prompt: int, cached: int) -> None:
        instance = self.instance_label(url)
        self._child(self.m.prefill_prompt_tokens, instance).inc(prompt)
        self._child(self.m.prefill_cached_tokens, instance).inc(cached)

    def kv_events(self, url: str, kind: str, count: int) -> None:
        self.m.kv_events.labels(self.instance_label(url), kind).inc(count)

    def retry(self, stage: str, cause: str) -> None:
        self.m.retries.labels(stage, cause).inc()

    def probe(self, role: str, url: str, ok: bool, latency: float) -> None:
        m = self.m
        instance = self.instance_label(url)
        if not ok:
            m.probe_failures.labels(role, instance).inc()
        m.probe_ok.labels(role, instance).set(1 if ok else 0)
        m.probe_latency.labels(role, instance).set(latency)
        m.probe_time.labels(role, instance).set(time.time())

    def evicted(self, role: str, url: str) -> None:
        self.m.evictions.labels(role, self.instance_label(url)).inc()

    def rejoined(self, role: str, url: str) -> None:
        self.m.rejoins.labels(role, self.instance_label(url)).inc()

    def fleet(self, entries: Sequence[FleetEntry]) -> None:
        """Every change of a fleet (a source's change, an eviction) lists the whole fleet:
        only the instances whose state changed are written, so a change costs a fleet of
        thousands what it costs a small one (a gauge write per instance was 6 ms per change
        with 1,000 instances)."""
        m = self.m
        self._forget(self.instance_labels.update(e.url for e in entries))
        counts: dict[str, list[int]] = {role: [0, 0] for role in self.roles_seen}
        before, now = self._live, {}
        for e in entries:
            counts.setdefault(e.role, [0, 0])[0 if e.live else 1] += 1
            key, live = (e.role, e.url), 1 if e.live else 0
            now[key] = live
            if before.get(key) != live:
                m.instance_live.labels(e.role, e.url).set(live)
        self._live = now
        for role, (live, evicted) in counts.items():
            m.instances.labels(role, "live").set(live)
            m.instances.labels(role, "evicted").set(evicted)
        self.roles_seen.update(counts)

    def _forget(self, urls: Iterable[str]) -> None:
        """Let go of the children kept for instances that may no longer label anything."""
        gone = set(urls)
        if gone:
            for key in [k for k in self._children if gone.intersection(k[1])]:
                del self._children[key]

    def models(self, names: Sequence[str]) -> None:
        for name in self.model_labels.update(names):
            self.m.forget_model(name)
            for metric in self.m.by_model():
                self._children.pop((metric, (name,)), None)

    def reload(self, source: str, ok: bool) -> None:
        self.m.reloads.count_local(source, "ok" if ok else "rejected")

    def load(self, in_flight: int, limit: int) -> None:
        m = self.m
        m.client_in_flight.set(in_flight)
        m.busiest_in_flight.set(in_flight)
        if limit != self._limit:  # the cap changes with a reload, not per request
            m.in_flight_limit.set(limit)
            self._limit = limit

    def discovery(self, source: str, up: bool) -> None:
        self.m.discovery_up.labels(source).set(1 if up else 0)

    def tracing_spans(self, reason: str | None, count: int) -> None:
        if reason is None:
            self.m.tracing_spans_exported.inc(count)
        else:
            self.m.tracing_spans_dropped.labels(reason).inc(count)

    def refused(self, reason: str) -> None:
        self.m.refused.labels(reason).inc()

    def ended_by_shutdown(self, count: int) -> None:
        self.m.ended_by_shutdown.inc(count)

    # -- admission (docs/behaviour.md#admission) -------------------------------------------

    def admission_tenants(self, tenants: Sequence[tuple[str, str]]) -> None:
        """Admission is on: its metrics exist from now, each tenant's counters and queue at 0
        (an alert's increase() sees a tenant's first refusal)."""
        if not tenants:
            return
        a, child = self.m.admission_on(), self._child
        for name, priority in tenants:
            tenant = self.tenant_labels.label(name)
            child(a.queue_depth, tenant, priority)
            child(a.admitted, tenant)
            child(a.tokens, tenant)
            for reason in REASONS:
                child(a.rejected, tenant, reason)

    def admission_queue(self, tenant: str, priority: str, change: int) -> None:
        self._child(self.m.admission_on().queue_depth, self.tenant_labels.label(tenant),
                    priority).inc(change)

    def admission_admitted(self, tenant: str, priority: str, waited: float | None) -> None:
        a, label = self.m.admission_on(), self.tenant_labels.label(tenant)
        self._child(a.admitted, label).inc()
        if waited is not None:
            self._child(a.wait_seconds, label, priority).observe(waited)

    def admission_rejected(self, tenant: str, reason: str) -> None:
        self._child(self.m.admission_on().rejected, self.tenant_labels.label(tenant),
                    reason).inc()

    def admission_tokens(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            self._child(self.m.admission_on().tokens, self.tenant_labels.label(tenant)).inc(
                tokens)

    def admission_store(self, up: bool | None) -> None:
        if up is not None:
            self.m.admission_on().store_up.set(up)
        elif self.m.admission is not None:
            self.m.admission.store_up.set(None)

    def load_store(self, up: bool | None) -> None:
        self.m.load_store_up.set(up)
