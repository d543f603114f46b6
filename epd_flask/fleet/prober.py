"""The background greenlet that probes every instance's ``/health``
(docs/behaviour.md#health-probes), and reads the models of those that answer
(docs/behaviour.md#models) and their engine's queue (docs/behaviour.md#routing-policies).

Started by the server (a gunicorn hook, or a test fixture), never by the app factory. The
first round runs at once, so a new worker learns about instances that died after the health
it inherited was written well before a full interval has passed.
"""

from __future__ import annotations

import logging
import time

import gevent.pool

from epd_flask.core import jsoncodec
from epd_flask.core.errors import ProxyError
from epd_flask.core.events import Events
from epd_flask.core.periodic import Periodic
from epd_flask.fleet import enginemetrics
from epd_flask.fleet.live import FleetView, LiveFleet, added
from epd_flask.fleet.models import ModelListError, parse_models
from epd_flask.fleet.registry import InstanceState
from epd_flask.upstream.transport import Transport

logger = logging.getLogger(__name__)

PROBE_CONCURRENCY = 32
#: An engine read is due once this share of ``engine_metrics_interval`` has passed.
ENGINE_SLACK = 0.9


class Prober:
    def __init__(self, live: LiveFleet, transport: Transport,
                 models_headers: dict[str, str] | None = None,
                 events: Events | None = None) -> None:
        self.live = live
        self.events = events if events is not None else Events()
        self.registry = live.registry
        # /health needs no credentials; /v1/models does on an instance started with --api-key.
        self.models_headers = models_headers or {}
        self.transport = transport
        self._pool = gevent.pool.Pool(PROBE_CONCURRENCY)
        #: When each instance's engine queue was last asked for (monotonic).
        self._engine_tried: dict[str, float] = {}
        self._loop = Periodic("probe round", self.probe_all,
                              lambda: self.live.settings.probe_interval)
        live.subscribe(self.on_change)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def on_change(self, old: FleetView, new: FleetView) -> None:
        """Instances that joined are probed at once; those that left are forgotten (a fleet
        whose addresses churn, as pods do, leaves no trace here)."""
        kept = new.urls()
        for url in [u for u in self._engine_tried if u not in kept]:
            del self._engine_tried[url]
        urls = added(old, new)
        if urls:
            self.probe_now(urls)

    def probe_now(self, urls: list[str]) -> None:
        """Probe these instances at once, outside the rhythm of the rounds: an instance added
        to a running worker counts for readiness, or is evicted if it is down, without
        waiting for the next round."""
        for url in urls:
            state = self.registry.get(url)
            if state is not None:
                self._pool.spawn(self.probe_one, state)

    def probe_all(self) -> None:
        self._pool.map(self.probe_one, self.registry.states())
        self.registry.forget_expired()

    def probe_one(self, state: InstanceState) -> bool:
        url = state.instance.url
        started = time.monotonic()
        ok, reason = False, ""
        try:
            resp = self.transport.send(
                "GET", url + "/health", stage="probe", headers={},
                read_timeout=self.live.settings.probe_timeout, stream=False,
            )
            ok = resp.status_code == 200
            reason = f"/health answered {resp.status_code}"
            resp.close()
        except ProxyError as err:
            reason = err.message
        if self.registry.get(url) is not state:
            return ok  # removed (or removed and listed anew) meanwhile: this result is stale
        state.last_probe_at = time.time()
        state.last_probe_ok = ok
        self.events.probe.fire(state.instance.role, url, ok, time.monotonic() - started)
        if ok:
            self.registry.record_success(url, time.monotonic() - started)
            if self.models_due(state):
                self.read_models(state)
            if self.engine_due(state):
                self.read_engine(state)
        else:
            self.registry.record_failure(url, reason)
        return ok

    @staticmethod
    def models_due(state: InstanceState) -> bool:
        """Every round for an instance whose models are discovered (an adapter loaded or
        unloaded shows within one interval); once for one whose roster lists them, whose
        answer only lends its cards' fields to ``/v1/models``."""
        return state.instance.models is None or state.cards is None

    def engine_due(self, state: InstanceState) -> bool:
        """Whether this round reads the instance's engine queue: ``engine_metrics_interval``
        (0: never) since the last attempt, so never more often than the probes."""
        interval = self.live.settings.engine_metrics_interval
        if interval <= 0:
            return False
        last = self._engine_tried.get(state.instance.url)
        # A round's probes are not all at the same instant: a little slack keeps an interval
        # equal to the probe interval from skipping every other round.
        return last is None or time.monotonic() - last >= interval * ENGINE_SLACK

    def read_engine(self, state: InstanceState) -> None:
        url = state.instance.url
        self._engine_tried[url] = time.monotonic()
        try:
            load = enginemetrics.read(self.transport, url, self.live.settings.probe_timeout,
                                      self.models_headers)
        except (ProxyError, ValueError) as err:
            if self.registry.get(url) is state:
                self.registry.record_engine_failure(url, getattr(err, "message", None)
                                                    or str(err))
            return
        if self.registry.get(url) is state:
            self.registry.record_engine(url, load)

    def read_models(self, state: InstanceState) -> None:
        url = state.instance.url
        cards, error = None, None
        try:
            resp = self.transport.send(
                "GET", url + "/v1/models", stage="probe", headers=self.models_headers,
                read_timeout=self.live.settings.probe_timeout, stream=False,
            )
            try:
                if resp.status_code != 200:
                    raise ModelListError(f"/v1/models answered {resp.status_code}")
                cards = parse_models(jsoncodec.loads(resp.content or b""))
            finally:
                resp.close()
        except (ProxyError, ValueError) as err:
            error = getattr(err, "message", None) or str(err)
        if self.registry.get(url) is state:
            self.registry.record_models(url, cards, error)

