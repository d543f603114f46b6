"""The Flask factory: settings, blueprints, error handlers and per-worker services.

``create_app`` builds; it opens no sockets and spawns no greenlets. The server starts the
background work with ``services(app).start()`` (the gunicorn ``post_worker_init`` hook in
production, a fixture in tests), after gevent has patched the worker.
"""

from __future__ import annotations

import logging

from flask import Flask, Response
from werkzeug.exceptions import HTTPException

from epd_flask.control.config import ProxyConfig
from epd_flask.control.reload import boot_roster
from epd_flask.control.roles import PREFILL
from epd_flask.control.roster import Roster
from epd_flask.control.statedir import StateDir
from epd_flask.control.urlpolicy import URLPolicy
from epd_flask.core import errors
from epd_flask.core.errors import ClientError, ProxyError
from epd_flask.core.events import Events
from epd_flask.core.headers import REQUEST_ID_HEADER
from epd_flask.fleet.bootstrap import BootstrapDiscovery
from epd_flask.fleet.kvaware import Tokenizer
from epd_flask.fleet.kvevents import KVEvents
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.loadboard import LoadBoard
from epd_flask.fleet.loadshare import LoadShare, host_name
from epd_flask.fleet.prober import Prober
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.rostersync import RosterSync
from epd_flask.fleet.routing import Router
from epd_flask.fleet.saturation import Capacity
from epd_flask.fleet.sources import Context as SourceContext
from epd_flask.fleet.sources import build as build_sources
from epd_flask.observe.metrics import Metrics
from epd_flask.observe.tracing import TraceSettings, Tracing
from epd_flask.serving.admission import AdmissionGate
from epd_flask.serving.connectors import connector_class
from epd_flask.serving.context import LogSettings
from epd_flask.serving.pipeline import Pipeline
from epd_flask.serving.redisstore import Limiter
from epd_flask.upstream.tls import TLSFiles
from epd_flask.upstream.transport import Transport
from epd_flask.web.edge import KeyRing
from epd_flask.web.fastpath import FastPath
from epd_flask.web.inflight import InFlight, InFlightMiddleware
from epd_flask.web.services import EXTENSION, Services, services
from epd_flask.web.shutdown import Drain
from epd_flask.web.slowbody import BodyDeadline

logger = logging.getLogger(__name__)

__all__ = ["Services", "build_services", "create_app", "services"]


def build_services(config: ProxyConfig, roster: Roster, generation: int = 0, *,
                   seed: int | None = None) -> Services:
    """Every per-worker service, wired; nothing started. ``seed`` makes routing repeatable
    (round-robin from the first instance, seeded draws): for a lone app in tests; None, as
    under gunicorn, starts each worker somewhere random."""
    settings = roster.settings
    events = Events()
    # Before anything below fires.
    metrics = Metrics(events, config.prometheus_multiproc_dir, config.state_dir)
    # The host's open calls and running requests per instance, shared by its workers
    # (routing's load, admission's bounds).
    board = LoadBoard(config.state_dir)
    # The other proxy hosts' open calls, with a load store (docs/behaviour.md#routing-policies).
    share = LoadShare(board, host_name(config.state_dir), events, config.state_dir)
    live = LiveFleet(roster, generation,
                     Registry(roster.instances, settings.fail_threshold, settings.evicted_ttl,
                              events=events, board=board, share=share))
    share.follow(lambda: [s.instance.url for s in live.registry.states()])
    live.subscribe(lambda old, new: share.configure(new.settings.load_store))
    share.configure(settings.load_store)
    transport = Transport(
        settings.connect_timeout, config.pool_maxsize,
        idle_timeout=config.upstream_idle_timeout, keepalive=config.upstream_keepalive,
        tls=TLSFiles(config.upstream_ca_bundle, config.upstream_client_cert,
                     config.upstream_client_key),
        max_answer_bytes=config.max_upstream_body_bytes,
    )
    backend_auth = {"Authorization": f"Bearer {config.backend_api_key}"} \
        if config.backend_api_key else None
    kv_events = KVEvents(live.registry, events=events, state_dir=config.state_dir)
    connector = connector_class(settings.connector)()
    discovery = BootstrapDiscovery(live, transport) if connector.bootstrap else None
    # Admission (docs/behaviour.md#admission): every role a request may wait for routes
    # among the instances with room first.
    capacity = Capacity(live, board)
    sources = {PREFILL: discovery} if discovery is not None else {}
    router = Router(live, sources=sources, narrow=capacity.roomy,
                    pictures=kv_events.picture, no_pictures=kv_events.missing,
                    tokenizer=Tokenizer(transport, lambda: live.settings.kv_tokenize_timeout,
                                        backend_auth),
                    seed=seed)
    pipeline = Pipeline(live, router, transport, connector,
                        max_event_bytes=config.max_event_bytes)
    admission = AdmissionGate(live, capacity, Limiter(config.state_dir, events), events)
    prober = Prober(live, transport, models_headers=backend_auth, events=events)
    state = StateDir(config.state_dir) if config.state_dir else None
    roster_sync = RosterSync(live, config.roster_path, state, events=events)
    inflight = InFlight(config.max_in_flight, events=events)
    traced = TraceSettings.from_config(config)
    svc = Services(config, live, router, transport, pipeline, prober, roster_sync,
                   inflight, Drain(inflight, config.drain_idle_grace, events=events),
                   events, metrics, LogSettings(config.log_format, config.log_upstream),
                   discovery,
                   keys=KeyRing(config.api_keys, config.key_tenants),
                   url_policy=URLPolicy.build(config.instance_schemes,
                                              config.instance_networks),
                   kv_events=kv_events,
                   tracing=Tracing(traced, events) if traced is not None else None,
                   admission=admission)
    # The policy is read at each record: the server's own addresses join it after the build.
    svc.sources = build_sources(roster.sources,
                                SourceContext(live, lambda: svc.url_policy, state, events))
    return svc


def create_app(config: ProxyConfig | None = None, roster: Roster | None = None, *,
               seed: int | None = None) -> Flask:
    """``roster`` given (tests) is served as is; otherwise the newest validated copy the
    gunicorn master prepared, or the roster file when no master did. ``seed``: see
    ``build_services``."""
    config = config or ProxyConfig.from_env()
    generation = 0
    if roster is None:
        state = StateDir(config.state_dir) if config.state_dir else None
        roster, generation = boot_roster(config.roster_path, state)
    app = Flask("epd_flask")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    svc = app.extensions[EXTENSION] = build_services(config, roster, generation, seed=seed)
    app.wsgi_app = InFlightMiddleware(  # type: ignore[method-assign]
        BodyDeadline(FastPath(app, app.wsgi_app), config.body_timeout), svc.inflight)

    from epd_flask.web.admin import bp as admin_bp
    from epd_flask.web.api import bp
    from epd_flask.web.ops import bp as ops_bp

    app.register_blueprint(ops_bp)
    app.register_blueprint(admin_bp, url_prefix=config.admin_prefix or None)
    app.register_blueprint(bp)
    app.register_error_handler(ProxyError, error_response)
    app.register_error_handler(HTTPException, http_error_response)
    return app


def error_response(err: ProxyError) -> Response:
    status, body, content_type = errors.render(err)
    response = Response(body, status=status, content_type=content_type,
                        headers=errors.extra_headers(err))
    if err.request_id:
        response.headers[REQUEST_ID_HEADER] = err.request_id
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def http_error_response(exc: HTTPException) -> Response:
    """Werkzeug's own refusals (413, 405, 404 ...) in OpenAI's shape instead of HTML."""
    kinds: dict[int, type[ProxyError]] = {
        404: errors.NotFound, 405: errors.MethodNotAllowed, 413: errors.PayloadTooLarge,
    }
    cls = kinds.get(exc.code or 400, ClientError)
    message = exc.description or exc.name
    if exc.code == 413:
        message = "request body is larger than this proxy accepts"
    err = cls(message, status=exc.code)
    response = error_response(err)
    if exc.code == 405 and getattr(exc, "valid_methods", None):
        response.headers["Allow"] = ", ".join(exc.valid_methods)
    return response
