"""The profiler switch for the whole fleet (docs/behaviour.md#edge): ``POST /start_profile``
or ``/stop_profile`` goes to every live instance of every role at once, and the answer reports
each instance.

vLLM serves these routes only when it was started with a profiler configured; elsewhere they
are 404, which is reported for that instance and does not fail the call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import gevent.pool

from epd_flask.core.errors import ProxyError
from epd_flask.fleet.registry import Registry
from epd_flask.upstream.transport import Transport

logger = logging.getLogger(__name__)

ACTIONS = ("start", "stop")
# stop_profile answers only once the trace is written, which takes a while on a busy engine.
PROFILE_TIMEOUT_SECONDS = 300.0
PROFILE_CONCURRENCY = 32


@dataclass
class InstanceResult:
    role: str
    url: str
    outcome: str  # ok | not_found | failed | skipped (evicted)
    status: int | None = None
    detail: str | None = None
    ms: float | None = None


def fan_out(action: str, registry: Registry, transport: Transport, headers: dict[str, str],
            body: bytes | None) -> list[InstanceResult]:
    """Call every live instance concurrently; evicted ones are listed as skipped."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    states = registry.states()
    live = [s.instance for s in states if s.live]
    pool = gevent.pool.Pool(PROFILE_CONCURRENCY)
    results = pool.map(lambda inst: _call(action, inst.role, inst.url, transport, headers, body),
                       live)
    results += [InstanceResult(s.instance.role, s.instance.url, "skipped", detail="evicted")
                for s in states if not s.live]
    return results


def _call(action: str, role: str, url: str, transport: Transport, headers: dict[str, str],
          body: bytes | None) -> InstanceResult:
    started = time.monotonic()
    try:
        resp = transport.send("POST", f"{url}/{action}_profile", stage="profile",
                              headers=headers, body=body, read_timeout=PROFILE_TIMEOUT_SECONDS,
                              stream=False)
    except ProxyError as err:
        return InstanceResult(role, url, "failed", detail=err.message, ms=_ms(started))
    status = resp.status_code
    resp.close()
    if 200 <= status < 300:
        outcome, detail = "ok", None
    elif status == 404:
        outcome, detail = "not_found", "no profiler configured on this instance"
    else:
        outcome, detail = "failed", f"answered {status}"
    return InstanceResult(role, url, outcome, status, detail, _ms(started))


def summarize(action: str, results: list[InstanceResult]) -> tuple[int, dict[str, Any]]:
    """HTTP status and body: 200 when every reached instance did it or has no profiler (and at
    least one did it), 502 when any failed, 503 when none could profile."""
    counts = {k: sum(r.outcome == k for r in results)
              for k in ("ok", "not_found", "failed", "skipped")}
    doc: dict[str, Any] = {"action": action, **counts,
                           "instances": [asdict(r) for r in results]}
    if counts["failed"]:
        status, code = 502, "profile_failed"
        message = f"{action}_profile failed on {counts['failed']} instance(s)"
    elif not counts["ok"]:
        status, code = 503, "profiler_unavailable"
        message = "no live instance has a profiler configured"
    else:
        return 200, doc
    doc["error"] = {"message": message, "type": "upstream_error", "param": None, "code": code}
    return status, doc


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000.0, 3)
