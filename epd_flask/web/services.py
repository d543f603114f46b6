"""The per-worker services object and the one typed way a view reaches it.

``app.create_app`` builds a ``Services`` and stores it in ``app.extensions``; views call
``services()`` instead of reading the extension themselves, so they see its real type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from flask import Flask, current_app

from epd_flask.control.config import ProxyConfig
from epd_flask.control.urlpolicy import URLPolicy
from epd_flask.core.events import Events
from epd_flask.fleet.bootstrap import BootstrapDiscovery
from epd_flask.fleet.kvevents import KVEvents
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.prober import Prober
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.rostersync import RosterSync
from epd_flask.fleet.routing import Router
from epd_flask.fleet.sources import Source
from epd_flask.observe.metrics import Metrics
from epd_flask.observe.tracing import Tracing
from epd_flask.serving.admission import AdmissionGate
from epd_flask.serving.clientwatch import ClientWatch
from epd_flask.serving.context import LogSettings
from epd_flask.serving.pipeline import Pipeline
from epd_flask.upstream.transport import Transport
from epd_flask.web.edge import KeyRing
from epd_flask.web.inflight import InFlight
from epd_flask.web.shutdown import Drain

EXTENSION = "epd_flask"


@dataclass
class Services:
    config: ProxyConfig
    live: LiveFleet
    router: Router
    transport: Transport
    pipeline: Pipeline
    prober: Prober
    roster_sync: RosterSync
    inflight: InFlight
    drain: Drain
    #: The app's hooks: everything above fires on them, its metrics listen to them.
    events: Events
    metrics: Metrics
    #: How its requests are logged: each request context carries it.
    log: LogSettings
    discovery: BootstrapDiscovery | None = None
    keys: KeyRing = field(default_factory=lambda: KeyRing(()))
    url_policy: URLPolicy = field(default_factory=URLPolicy)
    kv_events: KVEvents | None = None
    #: Membership sources besides the file (fleet/sources), by name.
    sources: dict[str, Source] = field(default_factory=dict)
    #: None while tracing is off (docs/behaviour.md#tracing).
    tracing: Tracing | None = None
    admission: AdmissionGate | None = None
    #: Looks at the clients of waiting requests (one sweep for the worker).
    clients: ClientWatch = field(default_factory=ClientWatch)

    @property
    def registry(self) -> Registry:
        """Each live instance's health (the live fleet's)."""
        return self.live.registry

    def listening_on(self, addresses: Iterable[Any]) -> None:
        """The server's listening addresses, so registration refuses the proxy itself (a
        request loop). UNIX socket paths are skipped: no instance URL can name them."""
        own = tuple((str(a[0]), int(a[1])) for a in addresses
                    if isinstance(a, tuple) and len(a) >= 2)
        self.url_policy = replace(self.url_policy, own=own)

    def start(self) -> None:
        self.registry.board.start()  # in the worker: its file is named for its pid
        if self.registry.share is not None:
            self.registry.share.start()
        self.transport.start()
        self.roster_sync.start()  # inherit health first, so the first probe round builds on it
        self.prober.start()
        if self.discovery is not None:
            self.discovery.start()
        self.metrics.start()
        if self.kv_events is not None:
            self.kv_events.start()
        for source in self.sources.values():
            source.start()
        if self.tracing is not None:
            self.tracing.start()

    def stop(self) -> None:
        self.drain.stop()
        for source in self.sources.values():
            source.stop()
        self.prober.stop()
        if self.discovery is not None:
            self.discovery.stop()
        self.metrics.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        self.roster_sync.stop()
        if self.tracing is not None:
            self.tracing.stop()
        if self.admission is not None:
            self.admission.stop()
        if self.registry.share is not None:
            self.registry.share.stop()
        self.registry.board.stop()
        self.transport.close()


def services(app: Flask | None = None) -> Services:
    """``app``'s services, or those of the app handling the current request."""
    svc: Services = (current_app if app is None else app).extensions[EXTENSION]
    return svc
