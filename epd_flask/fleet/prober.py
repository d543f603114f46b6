"""The background greenlet that probes every instance's ``/health``
(docs/behaviour.md#health-probes).

Started by the server (a gunicorn hook, or a test fixture), never by the app factory. The
first round runs at once, so a new worker learns about instances that died after the health
it inherited was written well before a full interval has passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import gevent.pool

from epd_flask.control.roster import Settings
from epd_flask.core import events
from epd_flask.core.errors import ProxyError
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.registry import InstanceState, Registry
from epd_flask.upstream.transport import Transport

logger = logging.getLogger(__name__)

PROBE_CONCURRENCY = 32


class Prober:
    def __init__(self, registry: Registry, transport: Transport,
                 settings: Callable[[], Settings]) -> None:
        self.registry = registry
        self.transport = transport
        self.settings = settings
        self._pool = gevent.pool.Pool(PROBE_CONCURRENCY)
        self._loop = Periodic("probe round", self.probe_all,
                              lambda: self.settings().probe_interval)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

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
                read_timeout=self.settings().probe_timeout, stream=False,
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
        events.probe.fire(state.instance.role, url, ok, time.monotonic() - started)
        if ok:
            self.registry.record_success(url, time.monotonic() - started)
        else:
            self.registry.record_failure(url, reason)
        return ok

