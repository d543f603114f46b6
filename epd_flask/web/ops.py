"""Operator endpoints: ``/metrics`` (Prometheus), ``/status`` (HTML), ``/debug/worker``, all
behind the metrics key once any key is configured (``authorize_reader``), and the profiler
fan-out (``/start_profile``, ``/stop_profile``, an operator action behind the admin key). Thin
views over metrics.py, statuspage.py (with tenanttable.py's section) and profiling.py. Also
which of vLLM's own routes are an operator's (``operator_route``): the pass-through asks for
the admin key on those.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import logging
import os

from flask import Blueprint, Response, request

from epd_flask.core.errors import Forbidden, NotFound, Unauthorized
from epd_flask.core.events import FleetEntry
from epd_flask.core.headers import REQUEST_ID_HEADER, request_id, upstream_headers
from epd_flask.observe import metrics, procstats, profiling, statuspage, tenanttable
from epd_flask.web import admin
from epd_flask.web.services import Services, services

logger = logging.getLogger(__name__)

bp = Blueprint("ops", __name__)

#: vLLM's routes that change an engine's state or report on its control plane
#: (docs/behaviour.md#edge): adapters loaded or unloaded, caches reset, the engine put to
#: sleep, paused, rescaled, reconfigured, its weights replaced, requests aborted, arbitrary
#: methods run on its workers (vLLM's docs/usage/security.md lists them; most need no API
#: key on vLLM itself). An operator's, like the profiler's; never a client's.
OPERATOR_PATHS = frozenset({
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/pause", "/resume", "/is_paused", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/init_weight_transfer_engine", "/update_weights", "/get_world_size", "/abort_requests",
    "/server_info", "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
    "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reconfigure",
})
#: vLLM's admin API (``--enable-admin-api``) lives under this prefix.
OPERATOR_PREFIX = "/v1/admin"


def operator_route(path: str) -> bool:
    """Whether ``path`` (in any spelling an instance would route alike) is an operator's."""
    canonical = "/" + "/".join(part for part in path.split("/") if part)
    return canonical in OPERATOR_PATHS or canonical == OPERATOR_PREFIX \
        or canonical.startswith(OPERATOR_PREFIX + "/")


def authorize_reader(svc: Services) -> None:
    """What the operator's read-only views show (every instance URL, the fleet's state) is
    not a client's to see: once any key is configured they need the metrics key, which
    Prometheus sends as a Bearer token, or the admin key; never a serving key. With no key
    configured at all (a proxy on a private network, a developer's), they stay open."""
    config = svc.config
    keys = [k for k in (config.metrics_key, config.admin_api_key) if k]
    if not keys:
        if svc.keys.enabled:
            raise Forbidden("/metrics and /status are closed while serving keys are "
                            "configured: set EPD_METRICS_KEY (or ADMIN_API_KEY) to read them",
                            code="metrics_key_unset")
        return
    given = admin.presented_key().encode()
    if not given:
        raise Unauthorized("this endpoint needs the metrics key as a Bearer token",
                           code="missing_metrics_key")
    valid = False
    for key in keys:  # every key compared: the time taken names none of them
        valid |= hmac.compare_digest(hashlib.sha256(given).digest(),
                                     hashlib.sha256(key.encode()).digest())
    if not valid:
        raise Unauthorized("the metrics key is not valid", code="invalid_metrics_key")


@bp.get("/metrics")
def prometheus_metrics() -> Response:
    svc = services()
    authorize_reader(svc)
    return Response(svc.metrics.exposition(), status=200, content_type=metrics.CONTENT_TYPE)


@bp.get("/status")
def status_page() -> Response:
    svc = services()
    authorize_reader(svc)
    history = svc.metrics.history
    now = svc.metrics.snapshot()
    ok, reason = svc.pipeline.ready()
    fleet = [FleetEntry(s.instance.role, s.instance.url, s.live) for s in svc.registry.states()]
    page = statuspage.build(svc.metrics.families, now, history.baseline(now), fleet,
                            "yes" if ok else reason, history.samples(),
                            [source.state.doc() for source in svc.sources.values()])
    gate, sections = svc.admission, []
    if gate is not None and gate.enabled:
        sections.append(tenanttable.render(tenanttable.build(
            svc.metrics.families, now, history.baseline(now), gate.snapshot())))
    return Response(statuspage.render(page, sections), status=200,
                    content_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-store"})


@bp.get("/debug/worker")
def debug_worker() -> Response:
    """What this worker holds (EPD_DEBUG_ENDPOINTS=1 only): for leak checks after faults."""
    svc = services()
    if not svc.config.debug_endpoints:
        raise NotFound("not found")
    authorize_reader(svc)
    peers = procstats.tcp_peers()
    origins = {s.instance.url.split("://", 1)[-1].split("/", 1)[0]: s.instance.url
               for s in svc.registry.states()}
    upstream = {url: peers.get(origin, 0) for origin, url in origins.items()}
    doc = {"pid": os.getpid(), "greenlets": procstats.greenlets(),
           "rss_bytes": procstats.rss_bytes(), "tcp_connections": sum(peers.values()),
           "upstream_connections": sum(upstream.values()), "upstream": upstream,
           "load": svc.inflight.snapshot(), "gc_frozen": gc.get_freeze_count(),
           "gc_thresholds": list(gc.get_threshold()),
           "gc_collections": [g["collections"] for g in gc.get_stats()]}
    if svc.discovery is not None:  # Mooncake engines per prefill (/health shows counts)
        doc["bootstrap"] = svc.discovery.snapshot()
    if svc.admission is not None and svc.admission.enabled:
        doc["admission"] = svc.admission.snapshot()  # this worker's queue and counts
    return Response(json.dumps(doc), status=200, content_type="application/json")


@bp.post("/start_profile")
def start_profile() -> Response:
    return _profile("start")


@bp.post("/stop_profile")
def stop_profile() -> Response:
    return _profile("stop")


def _profile(action: str) -> Response:
    """An operator action: the admin key opens it, and the instances hear the fleet's backend
    key (never the caller's credential, which is the admin key)."""
    svc = services()
    admin.authorize(svc.config.admin_api_key)
    rid = request_id(request.headers.get(REQUEST_ID_HEADER))
    client = [(k, v) for k, v in request.headers.items() if k.lower() != "authorization"]
    headers = upstream_headers(client, rid, svc.config.backend_api_key)
    body = request.get_data(cache=False) or None
    if body is not None and request.content_type:
        headers["Content-Type"] = request.content_type
    results = profiling.fan_out(action, svc.registry, svc.transport, headers, body)
    status, doc = profiling.summarize(action, results)
    logger.info("request_id=%s %s_profile: ok=%d not_found=%d failed=%d skipped=%d", rid,
                action, doc["ok"], doc["not_found"], doc["failed"], doc["skipped"])
    return Response(json.dumps(doc), status=status, content_type="application/json",
                    headers={REQUEST_ID_HEADER: rid})
