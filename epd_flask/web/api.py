"""Thin Flask views: parse the request, hand it to the pipeline, return its reply."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Request, Response, request
from werkzeug.exceptions import HTTPException

from epd_flask.control import settings
from epd_flask.core import cooperate, jsoncodec
from epd_flask.core.errors import ClientError, NotFound, ProxyError
from epd_flask.core.headers import (
    REQUEST_ID_HEADER,
    new_upstream_id,
    request_id,
    upstream_headers,
)
from epd_flask.serving.admission import admission_error
from epd_flask.serving.context import RequestContext
from epd_flask.serving.fields import CHAT_PATH
from epd_flask.serving.pipeline import Reply
from epd_flask.web import admin, edge, validation
from epd_flask.web.ops import operator_route
from epd_flask.web.services import Services, services

bp = Blueprint("api", __name__)

COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions")
JSON_TYPES = ("application/json", "")
#: Where the admin API lives without EPD_ADMIN_PREFIX; with one, these paths are no one's.
ADMIN_PATH = "/instances"


def _context(req: Request, svc: Services) -> RequestContext:
    rid = request_id(req.headers.get(REQUEST_ID_HEADER))
    uid = new_upstream_id()
    # Traced, every upstream call names its own span instead of the client's
    # (docs/behaviour.md#tracing).
    trace = svc.tracing.begin(req.headers, req.method, req.path, rid, uid) \
        if svc.tracing is not None else None
    headers = upstream_headers(req.headers.items(), uid, svc.config.backend_api_key,
                               client_trace=trace is None)
    if (svc.keys.enabled and not svc.config.backend_api_key) \
            or edge.is_key(headers.get("Authorization"), svc.config.admin_api_key):
        # The client's bearer was our serving key, or the admin key sent to the wrong path:
        # either stays at the edge.
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    ctx = RequestContext(rid, req.path, headers, upstream_id=uid, trace=trace,
                         events=svc.events, log=svc.log)
    ctx.client = svc.clients.client(req.environ)
    session_header = svc.live.settings.session_header
    if session_header:
        ctx.session = req.headers.get(session_header) or None
    return ctx


def _authorize(req: Request, svc: Services) -> str | None:
    """Raise unless the request carries a serving key (when keys are configured); the
    tenant its key belongs to, if the keys file names one."""
    return svc.keys.check(req.headers.get("Authorization"))


def _body(req: Request, svc: Services) -> bytes:
    """The request body, decoded, within the size limit (413 before reading an oversized
    body whose length is declared, 415 before reading one in an unsupported coding; chunked
    bodies are cut off as they pass the limit)."""
    limit = svc.config.max_body_bytes
    length = req.content_length
    edge.check_length(length, limit)
    edge.content_coding(req.headers.get("Content-Encoding"))
    try:
        if length is None:
            raw = edge.read_capped(req.stream.read, limit)
        else:
            raw = _read_body(req, length)
    except (ProxyError, HTTPException):
        raise
    except Exception as exc:
        # The server parses the body's framing as the view reads it: gunicorn raises its
        # InvalidChunkSize (a negative or non-hex chunk size) here, which would be a 500.
        raise edge.unreadable(exc) from None
    edge.check_complete(len(raw), length)
    return edge.decode_body(raw, req.headers.get("Content-Encoding"), limit)


def parse_object(
    raw: bytes, max_depth: int = settings.default("EPD_MAX_JSON_DEPTH")
) -> dict[str, Any]:
    """The body must be one JSON object; anything else is refused before any backend
    (docs/behaviour.md#edge)."""
    if not raw.strip():
        raise ClientError("request body is empty; send a JSON object", code="invalid_json")
    try:
        doc = jsoncodec.loads(raw)
    except UnicodeDecodeError:
        raise ClientError("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise edge.nested_too_deeply(max_depth) from None
    except ValueError as exc:
        raise ClientError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise ClientError(
            f"request body must be a JSON object, got a JSON {_json_kind(doc)}",
            code="invalid_json")
    edge.check_depth(doc, max_depth)
    return doc


def _json_kind(doc: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(doc), "number")


def _read_body(req: Request, length: int) -> bytes:
    """The request body; a large one in steps, so the worker's other streams run meanwhile
    (read in one go, a few megabytes already in the socket buffer hold the loop ~10 ms)."""
    if length < cooperate.LARGE_BYTES:
        return req.get_data(cache=False)
    parts = []
    while part := req.stream.read(cooperate.LARGE_BYTES):
        parts.append(part)
        cooperate.after_step(len(part))
    return b"".join(parts)


def _respond(reply: Reply) -> Response:
    return Response(reply.body, status=reply.status, headers=reply.headers,
                    direct_passthrough=True)


@contextlib.contextmanager
def _accounted(ctx: RequestContext) -> Iterator[None]:
    """Whatever refuses the request, its log line and request id are written once."""
    try:
        yield
    except ProxyError as err:
        ctx.finish(status=err.status, error=err)
        err.request_id = ctx.request_id
        admission_error(err, ctx.admitted)
        raise
    except HTTPException as exc:  # werkzeug's own refusals (413 ...) are requests too
        ctx.finish(status=exc.code, error=exc.description or exc.name)
        raise
    except BaseException as exc:
        # A bug, or the worker stopping: still one log line, and what the request held
        # (admission's places, its legs) is given back.
        ctx.finish(status=500, error=f"internal error: {type(exc).__name__}")
        raise


@bp.post("/v1/chat/completions")
@bp.post("/v1/completions")
def completions() -> Response:
    return completion(request._get_current_object(), services())  # type: ignore[attr-defined]


def completion(req: Request, svc: Services) -> Response:
    """The two completion routes: the one implementation, which Flask's route above and the
    WSGI fast path (web/fastpath.py) both call."""
    ctx = _context(req, svc)
    with _accounted(ctx):
        key_tenant = _authorize(req, svc)
        ctype = (req.mimetype or "").lower()
        if ctype not in JSON_TYPES:
            raise ClientError(f"Content-Type must be application/json, got {ctype}",
                              status=415, code="unsupported_media_type")
        raw = _body(req, svc)
        ctx.bytes_in = len(raw)
        body = parse_object(raw, svc.config.max_json_depth)
        cooperate.after_step(len(raw))
        validation.check_completion(req.path, body)
        body = edge.without_proxy_fields(body)
        gate, ticket, plan = svc.admission, None, None
        if gate is not None and gate.enabled:
            # docs/behaviour.md#admission: refused, or let through after a wait for capacity
            plan = svc.pipeline.plan(body, ctx)
            body, ticket, plan = gate.admit(ctx, req.path == CHAT_PATH, body,
                                            gate.tenant_of(req.headers.get, key_tenant), plan)
        reply = svc.pipeline.completion(req.path, body, ctx, plan)
        if ticket is not None:
            reply.headers.extend(ticket.answered(reply.body))
    return _respond(reply)


@bp.get("/health")
@bp.get("/healthz")
def health() -> Response:
    svc = services()
    ready, reason = svc.pipeline.ready()
    # Counts, never URLs: the shipped nginx publishes /health.
    instances = {role: {state: len(urls) for state, urls in states.items()}
                 for role, states in svc.registry.snapshot().items()}
    doc = {"status": "ok", "ready": ready, "reason": reason,
           "connector": svc.live.settings.connector, "instances": instances,
           "counters": dict(svc.pipeline.counters),
           "load": svc.inflight.snapshot()}
    if svc.discovery is not None:
        found = svc.discovery.snapshot().values()
        doc["bootstrap"] = {"prefills": len(found),
                            "engines": sum(len(e["engine_ids"]) for e in found),
                            "stale": sum(not e["current"] for e in found)}
    return Response(json.dumps(doc), status=200, content_type="application/json")


@bp.get("/ready")
@bp.get("/readyz")
@bp.get("/healthcheck")
def ready() -> Response:
    """Readiness; ``/healthcheck`` is a probe path other proxies in front of vLLM answer, so
    deployments moved from one keep working instead of having their probe forwarded to decode
    (docs/behaviour.md#edge)."""
    svc = services()
    ok, reason = svc.pipeline.ready()
    if svc.inflight.draining:
        ok, reason = False, "shutting down"
    doc = {"ready": ok, "reason": reason}
    return Response(json.dumps(doc), status=200 if ok else 503, content_type="application/json")


@bp.get("/v1/models")
def models() -> Response:
    """The union of what live decode-side instances serve (docs/behaviour.md#models); until
    any of them has told us its models, one of them answers, as for any other route."""
    svc = services()
    ctx = _context(request, svc)
    with _accounted(ctx):
        _authorize(request, svc)
        body = svc.pipeline.catalog.listing_json()
        if body is None:
            reply = svc.pipeline.passthrough(
                "GET", request.path, request.query_string.decode("latin-1"), None, None, ctx)
            return _respond(reply)
    ctx.bytes_out = len(body)
    ctx.finish(status=200)
    return Response(body, status=200, content_type="application/json",
                    headers={REQUEST_ID_HEADER: ctx.request_id})


@bp.route("/", defaults={"path": ""}, methods=["GET", "POST"])
@bp.route("/<path:path>", methods=["GET", "POST"])
def passthrough(path: str) -> Response:
    """Everything else reaches a decode-side instance with its query string; vLLM's operator
    routes only with the admin key (docs/behaviour.md#edge)."""
    svc = services()
    ctx = _context(request, svc)
    with _accounted(ctx):
        _refuse_other_spellings(request.path)
        if operator_route(request.path):
            admin.authorize(svc.config.admin_api_key)
        else:
            _authorize(request, svc)
        raw: bytes | None = None
        model = None
        if request.method == "POST":
            raw, model = _forwarded_body(_body(request, svc), (request.mimetype or "").lower())
        reply = svc.pipeline.passthrough(
            request.method, request.path, request.query_string.decode("latin-1"), raw,
            request.headers.get("Content-Type"), ctx, model)
    return _respond(reply)


def _refuse_other_spellings(path: str) -> None:
    """404 for a path that only looks like another of our routes.

    ``/v1/chat/completions/`` (or with doubled slashes) would otherwise reach decode alone,
    skipping encode, prefill and the completion checks; vLLM itself answers it with a
    redirect, not a completion, so it is refused rather than served under a second name.
    With ``EPD_ADMIN_PREFIX`` set, the admin API's unprefixed path is refused too, so an
    admin call sent there (with the admin key) never reaches an instance.
    """
    canonical = "/" + "/".join(part for part in path.split("/") if part)
    if canonical in COMPLETION_ROUTES and canonical != path:
        raise NotFound(f"no route {path}; did you mean {canonical}?")
    prefix = services().config.admin_prefix
    if prefix and (canonical == ADMIN_PATH or canonical.startswith(ADMIN_PATH + "/")):
        raise NotFound(f"no route {path}")


def _forwarded_body(raw: bytes, mimetype: str) -> tuple[bytes, str | None]:
    """The body a pass-through sends: without the fields only the proxy may set; and the
    ``model`` it names, if any, to route by (docs/behaviour.md#models).

    vLLM reads a body as JSON when its type is JSON or missing (and some routes whatever
    the type), so every body that is or looks like a JSON object is parsed; one that
    does not parse is refused rather than forwarded unread. Other bodies (multipart audio)
    pass untouched. Unchanged bodies are forwarded byte for byte.
    """
    if not raw.strip():
        return raw, None
    looks_json = mimetype in JSON_TYPES or mimetype.endswith("+json") \
        or raw.lstrip()[:1] == b"{"
    if not looks_json:
        return raw, None
    doc = parse_object(raw, services().config.max_json_depth)
    forwarded = edge.without_proxy_fields(doc)
    model = doc.get("model")
    return (raw if forwarded is doc else jsoncodec.dumps(forwarded),
            model if isinstance(model, str) and model else None)
