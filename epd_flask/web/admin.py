"""The admin API (docs/behaviour.md#roster): ``GET``/``POST /instances`` and
``DELETE /instances?url=``; ``POST /instances/add`` is ``POST /instances`` under the name
other EPD proxies' launchers call, as ``X-Admin-API-Key`` is ``X-API-Key``.

Thin views: check ``ADMIN_API_KEY``, parse, apply the SSRF policy for instance URLs, hand
the change to this worker's ``RosterSync``, which persists it to the roster file and makes every
worker follow, or, when the roster names an etcd store, to etcd, which every worker watches
(docs/behaviour.md#discovery). Without a key the API is disabled, and says so. Mounted under
``EPD_ADMIN_PREFIX`` when one is set.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

from flask import Blueprint, Response, request

from epd_flask.control.roster import (
    Instance,
    RoleConflict,
    RosterError,
    RosterTooLarge,
    normalize_url,
    parse_instance,
)
from epd_flask.control.rosterfile import RosterFileError, RosterWriteError
from epd_flask.control.urlpolicy import URLPolicy, URLPolicyError, check_addresses
from epd_flask.core.errors import (
    ClientError,
    Conflict,
    Forbidden,
    NotFound,
    ProxyError,
    Unprocessable,
)
from epd_flask.fleet.live import FILE, Fit, FleetView
from epd_flask.fleet.rostersync import RosterSync
from epd_flask.fleet.sources.etcdsource import EtcdSource
from epd_flask.upstream.etcd import EtcdError
from epd_flask.web.services import Services, services

bp = Blueprint("admin", __name__)

KEY_HEADER = "X-API-Key"
#: The same key under the header launchers written for other EPD proxies send.
ALIAS_KEY_HEADER = "X-Admin-API-Key"
BEARER = "bearer "


def _authorized() -> Services:
    """This worker's services, once the caller has shown the admin key."""
    svc = services()
    authorize(svc.config.admin_api_key)
    return svc


def _fleet() -> RosterSync:
    return _authorized().roster_sync


def presented_key() -> str:
    """The key the caller shows: ``X-API-Key`` (or its alias), else a Bearer token ("" for
    none)."""
    given = request.headers.get(KEY_HEADER, "") or request.headers.get(ALIAS_KEY_HEADER, "")
    auth = request.headers.get("Authorization", "")
    if not given and auth[:len(BEARER)].lower() == BEARER:
        given = auth[len(BEARER):].strip()
    return given


def authorize(key: str | None) -> None:
    """Operator actions (this API, the profiler switch) need the admin key; without one
    configured they are off."""
    if not key:
        raise Forbidden("the admin API is disabled: set ADMIN_API_KEY to enable it",
                        code="admin_api_disabled")
    given = presented_key()
    if not given:
        raise Forbidden(f"the admin API needs the admin key in {KEY_HEADER} (or "
                        f"{ALIAS_KEY_HEADER}) or as a Bearer token", code="missing_admin_key")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise Forbidden("the admin key is not valid", code="invalid_admin_key")


def _json(doc: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(doc), status=status, content_type="application/json")


@bp.get("/instances")
def list_instances() -> Response:
    svc = _authorized()
    return _json({**svc.roster_sync.status(),
                  "sources": [source.state.doc() for source in svc.sources.values()]})


@bp.post("/instances")
@bp.post("/instances/add")
def register() -> Response:
    svc = _authorized()
    fleet = svc.roster_sync
    try:
        doc = json.loads(request.get_data(cache=False).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ClientError(f"request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    try:
        inst = parse_instance(doc, "instance")
    except RosterError as exc:
        raise Unprocessable(str(exc)) from None
    _check_policy(inst, svc.url_policy)
    store = _store(svc)
    if store is not None and svc.live.view.sources.get(inst.url) != FILE:
        _check_fits(inst, svc.live.view)
        status = _stored(store.register, inst)
    else:  # no store, or the file lists it: its record is the one served
        status = _change(fleet.register, inst).status
    body = {"status": status, "generation": fleet.generation, "worker": os.getpid(),
            "instance": inst.record()}
    return _json(body, 201 if status == "registered" else 200)


def _check_policy(inst: Instance, policy: URLPolicy) -> None:
    """SSRF policy before anything is written: the URLs are requests the proxy will make,
    the transfer addresses connections the instances will make on the proxy's word."""
    try:
        check_addresses(inst.addresses(), policy)
    except URLPolicyError as exc:
        raise Unprocessable(str(exc), code="instance_url_not_allowed",
                            param=exc.field) from None


def _check_fits(inst: Instance, view: FleetView) -> None:
    """What the roster check says of a file registration, said of a store's: a record the
    live fleet would leave out is refused, not written (docs/behaviour.md#discovery)."""
    misfit = Fit(view.settings, (i for i in view.instances if i.url != inst.url)).misfit(inst)
    if misfit is not None and misfit.role:
        raise Conflict(misfit.message, code="role_conflict")
    if misfit is not None:
        raise Unprocessable(misfit.message)


def _store(svc: Services) -> EtcdSource | None:
    """The membership store the admin API writes to instead of the file
    (docs/behaviour.md#discovery), when the roster names one."""
    store = svc.sources.get("etcd")
    return store if isinstance(store, EtcdSource) else None


@bp.delete("/instances")
def unregister() -> Response:
    svc = _authorized()
    fleet = svc.roster_sync
    raw = request.args.get("url")
    if not raw:
        raise ClientError("name the instance to remove: DELETE /instances?url=<base URL>",
                          code="missing_url", param="url")
    try:
        url = normalize_url(raw)
    except ValueError as exc:
        raise Unprocessable(f"url {exc}", param="url") from None
    source = svc.live.view.sources.get(url)
    store = _store(svc)
    if source is not None and source != FILE and (store is None or source != store.name):
        raise Conflict(f"instance {url} comes from {source}, which the admin API does not "
                       f"write: remove it there", code="instance_not_writable", param="url")
    try:
        if store is not None and source != FILE:
            gone = _stored(store.unregister, url)
            record = gone.record() if gone is not None else {"url": url}
            return _json({"status": "removed", "generation": fleet.generation,
                          "worker": os.getpid(), "instance": record})
        change = _change(fleet.unregister, url)
    except KeyError:
        where = "in etcd" if store is not None else "in the roster"
        raise NotFound(f"instance {url} is not {where}", code="unknown_instance",
                       param="url") from None
    assert change.instance is not None
    return _json({"status": change.status, "generation": fleet.generation,
                  "worker": os.getpid(), "instance": change.instance.record()})


def _stored(action: Any, arg: Any) -> Any:
    """A write to the membership store, its failure as the client's status."""
    try:
        return action(arg)
    except EtcdError as exc:
        raise ProxyError(f"etcd did not take the change: {exc}", status=503,
                         code="membership_store_unavailable") from None


def _change(action: Any, arg: Any) -> Any:
    """One place maps a roster edit's failure to the client's status."""
    try:
        return action(arg)
    except RoleConflict as exc:
        raise Conflict(str(exc), code="role_conflict") from None
    except RosterTooLarge as exc:
        raise Conflict(str(exc), code="roster_too_large") from None
    except RosterFileError as exc:
        raise Conflict(str(exc), code="roster_file_invalid") from None
    except RosterWriteError as exc:
        if exc.read_only:
            raise Conflict(str(exc), code="roster_read_only") from None
        raise ProxyError(str(exc), code="roster_write_failed") from None
    except TimeoutError as exc:
        raise ProxyError(f"the roster is being changed by another process: {exc}",
                         status=503, code="roster_busy") from None
    except RosterError as exc:
        raise Unprocessable(str(exc)) from None
