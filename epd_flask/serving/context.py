"""One client request's identity and bookkeeping, carried through every stage, and the one log
line written from it.

Plain data: each upstream call is a ``leg`` block (open at its start, closed however the block
ends), the pipeline records stage timings, the relay adds what it streamed, and ``finish``
writes the request's log line (logfmt or JSON, as its app's ``LogSettings`` say) and tells
its app's observers (its ``Events``), exactly once, whichever path ends the request.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from epd_flask.control.settings import LOG_FORMATS
from epd_flask.core.errors import ProxyError
from epd_flask.core.events import Events
from epd_flask.core.headers import new_upstream_id
from epd_flask.core.logfmt import quote
from epd_flask.core.tracing import CallTrace, RequestTrace
from epd_flask.fleet.policies import Decision
from epd_flask.serving.clientwatch import Client

logger = logging.getLogger("epd_flask.requests")
upstream_logger = logging.getLogger("epd_flask.upstream")

FIRST_BYTE = "first_byte"
TOTAL = "total"
#: The wait for capacity (docs/behaviour.md#admission): ``queue_ms`` in the log line.
QUEUE = "queue"


class Admitted(Protocol):
    """What admission keeps for a request it let through (serving/admission.py), told of
    the request's routing, retries and end."""

    def routed(self, role: str, url: str) -> None: ...

    def answering(self) -> None:
        """Decode's answer began (its first bytes arrived)."""

    def retried(self) -> None: ...

    def finished(self, ctx: RequestContext) -> None: ...

    def usage_seen(self, events: bytes) -> bytes:
        """A piece of a streamed answer that carries a usage object (returned unchanged)."""


@dataclass(frozen=True)
class LogSettings:
    """How an app's requests are logged (EPD_LOG_FORMAT, EPD_LOG_UPSTREAM); each request
    context carries its app's."""

    format: str = "logfmt"
    # One line per upstream call: useful when chasing a bad instance, too chatty for the hot
    # path, so off unless asked for.
    upstream_calls: bool = False

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got "
                             f"{self.format!r}")


DEFAULT_LOG = LogSettings()


@dataclass(eq=False)
class OpenLeg:
    """One upstream call of the request, open from the send until its answer is consumed."""

    stage: str
    role: str
    url: str
    started: float = field(default_factory=time.monotonic)
    #: The upstream's status, for the log line when the leg ends well.
    status: int | None = None
    held: bool = False
    closed: bool = False
    #: Its span while the request is traced: the call sends ``span.headers``.
    span: CallTrace | None = None

    def hold(self) -> None:
        """The answer outlives the block (a stream the relay forwards): the leg stays open
        until the request finishes."""
        self.held = True

    def first_byte(self) -> None:
        if self.span is not None:
            self.span.first_byte()


@dataclass
class RequestContext:
    #: The client's id (or one made up for it): the response header and the logs carry it.
    request_id: str
    route: str
    upstream_headers: dict[str, str]
    #: The id instances know this request by: unique per proxied request, whatever the
    #: client sent (see ``headers.new_upstream_id``); each attempt adds to it (``attempt_id``).
    upstream_id: str = field(default_factory=new_upstream_id)
    # The model the request is routed by, once the fleet is known to serve it.
    model: str | None = None
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    legs: list[OpenLeg] = field(default_factory=list)
    retries: int = 0
    chunks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    status: int | None = None
    error: str | None = None
    # The client's connection, for the worker's watch while the request waits (when the
    # server says where it is: gunicorn's workers do); without it, a departure is noticed at
    # the first write.
    client: Client | None = field(default=None, repr=False)
    # The session the client named in the roster's ``session_header``, if any.
    session: str | None = None
    # One ``role:policy(why)`` per routing decision (docs/behaviour.md#routing-policies).
    routing: list[str] = field(default_factory=list)
    # Told of every upstream call opened (+1) and closed (-1): the load routing reads.
    on_leg: Callable[[str, int], None] | None = field(default=None, repr=False)
    #: The request's trace while tracing is on (docs/behaviour.md#tracing).
    trace: RequestTrace | None = field(default=None, repr=False)
    #: The request's tenant, with admission on (docs/behaviour.md#admission).
    tenant: str | None = None
    #: What admission holds for the request while it runs.
    admitted: Admitted | None = field(default=None, repr=False)
    #: When the request waited for capacity (wall-clock nanoseconds, start and end): the
    #: admission wait a trace shows.
    queue_wait: tuple[int, int] | None = None
    #: The app's hooks, which this request fires (a context made outside an app has its own,
    #: which nobody hears).
    events: Events = field(default_factory=Events, repr=False)
    log: LogSettings = field(default=DEFAULT_LOG, repr=False)
    _logged: bool = False

    @property
    def finished(self) -> bool:
        """Whether ``finish`` ran: the request's line is written."""
        return self._logged

    @property
    def attempt_id(self) -> str:
        """The upstream id of the current attempt: a retry never meets state an earlier
        attempt left on an instance (KV kept for a decode that never pulled it)."""
        return self.upstream_id if not self.retries else f"{self.upstream_id}-retry{self.retries}"

    def mark(self, name: str, since: float) -> None:
        """Record a stage's duration in milliseconds."""
        self.timings[name] = round((time.monotonic() - since) * 1000.0, 3)

    def queued(self, since: float) -> None:
        """Admission let the request through; it waited since ``since`` (monotonic)."""
        waited = time.monotonic() - since
        self.timings[QUEUE] = round(waited * 1000.0, 3)
        ended = time.time_ns()
        self.queue_wait = (ended - int(waited * 1e9), ended)
        if self.trace is not None:
            self.trace.waited("admission", *self.queue_wait)

    def relayed(self, nbytes: int, events: int = 1) -> None:
        """Bytes (whole SSE events, or a raw piece) went to the client; the first are timed."""
        if FIRST_BYTE not in self.timings:
            self.mark(FIRST_BYTE, self.started)
        self.chunks += events
        self.bytes_out += nbytes

    def decided(self, role: str, decision: Decision) -> None:
        """One routing decision for this request (docs/behaviour.md#routing-policies): the
        log line names it, the metrics count it. Every choice of an instance reports here."""
        self.routing.append(decision.describe(role))
        self.events.routed.fire(role, decision.policy, decision.outcome, decision.instance.url)
        if self.trace is not None:
            self.trace.decided(role, decision.policy, decision.outcome, decision.instance.url)
        if self.admitted is not None:
            self.admitted.routed(role, decision.instance.url)

    def answer_began(self) -> None:
        """Decode's first bytes arrived: the prompt is computed (admission stops counting it
        as ahead of other requests, docs/behaviour.md#admission)."""
        if self.admitted is not None:
            self.admitted.answering()

    def retry(self, err: ProxyError) -> None:
        self.retries += 1
        self.events.retry.fire(err.stage or "unknown", err.code)
        if self.trace is not None:
            self.trace.retried(err.stage or "unknown", err.code)
        if self.admitted is not None:
            self.admitted.retried()

    @contextmanager
    def leg(self, stage: str, role: str, url: str) -> Iterator[OpenLeg]:
        """One upstream call as a block: open from here, closed when the block ends (unless
        ``hold`` hands it on). A ``ProxyError`` leaving the block counts against the call, and
        when the work is worth another instance this one is avoided by the next attempt; any
        other way out (the request killed, its client gone) closes it blaming nobody."""
        leg = OpenLeg(stage, role, url)
        if self.trace is not None:
            leg.span = self.trace.call(stage, role, url)
        self.legs.append(leg)
        if self.on_leg is not None:
            self.on_leg(url, 1)
        self.events.upstream_opened.fire(role, url)
        try:
            yield leg
        except ProxyError as err:
            self._close(leg, error=err)
            if err.retryable:
                self.failed.add(url)
            raise
        except BaseException:
            self._close(leg)
            raise
        if not leg.held:
            self._close(leg)

    def _close(self, leg: OpenLeg, error: ProxyError | None = None) -> None:
        if leg.closed:
            return
        leg.closed = True
        self.legs.remove(leg)
        if self.on_leg is not None:
            self.on_leg(leg.url, -1)
        self.events.upstream_closed.fire(leg.role, leg.url)
        if error is not None:
            self.events.upstream_error.fire(leg.stage, leg.url, error.code)
        if leg.span is not None:
            leg.span.end(leg.status, error)
        if self.log.upstream_calls:
            ms = round((time.monotonic() - leg.started) * 1000.0, 3)
            outcome = f"error={quote(error.message)}" if error else f"status={leg.status}"
            upstream_logger.info(
                "request_id=%s upstream_id=%s stage=%s role=%s instance=%s ms=%s %s",
                self.request_id, self.upstream_id, leg.stage, leg.role, leg.url, ms, outcome)

    def finish(self, status: int | None = None, error: str | ProxyError | None = None) -> None:
        """Write the request's single log line and tell the observers, once, whichever path
        ends it; upstream legs still open end here."""
        if self._logged:
            return
        self._logged = True
        if status is not None:
            self.status = status
        failure = error if isinstance(error, ProxyError) else None
        if failure is not None:
            self.error = failure.message
        elif error is not None:
            self.error = error
        ok = self.status is not None and self.status < 400
        if ok and self.bytes_out and FIRST_BYTE not in self.timings:
            self.mark(FIRST_BYTE, self.started)  # a whole body sent at once
        self.mark(TOTAL, self.started)
        for leg in list(self.legs):
            blamed = failure if failure is not None and failure.stage == leg.stage else None
            if leg.status is None:
                leg.status = self.status
            self._close(leg, error=blamed)
        if self.trace is not None:
            self.trace.finish(self, failure)
        if self.admitted is not None:
            self.admitted.finished(self)
        if logger.isEnabledFor(logging.INFO):  # no formatting cost when nobody reads it
            logger.info("%s", self.log_line())
        self.events.request_finished.fire(self)

    def log_line(self) -> str:
        """The request's line: logfmt (built piece by piece, at ~1/3 the cost of a field list
        joined through a generic formatter: it is written for every request) or JSON."""
        if self.log.format == "json":
            return json.dumps(self._log_doc(), separators=(",", ":"))
        v = quote
        parts = [f"request_id={v(self.request_id)} upstream_id={v(self.upstream_id)} "
                 f"route={v(self.route)} status={v(self.status)}"]
        if self.trace is not None:
            parts.append(f"trace_id={self.trace.trace_id}")
        if self.model is not None:
            parts.append(f"model={v(self.model)}")
        if self.tenant is not None:
            parts.append(f"tenant={v(self.tenant)}")
        for role, url in self.instances.items():
            parts.append(f"{role}={v(url)}")
        if self.routing:
            parts.append(f"routing={v(','.join(compact(self.routing)))}")
        for stage, ms in self.timings.items():
            parts.append(f"{stage}_ms={v(ms)}")
        parts.append(f"retries={v(self.retries)} chunks={v(self.chunks)} "
                     f"bytes={v(self.bytes_out)}")
        rate = self.chunks_per_second()
        if rate is not None:
            parts.append(f"chunks_per_s={v(rate)}")
        if self.error:
            parts.append(f"error={v(self.error)}")
        return " ".join(parts)

    def _log_doc(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "pid": os.getpid(),  # which worker: a bare JSON line has no log prefix
            "request_id": self.request_id, "upstream_id": self.upstream_id,
            "route": self.route, "status": self.status,
            "instances": dict(self.instances), "routing": compact(self.routing),
            "timings_ms": dict(self.timings),
            "retries": self.retries, "chunks": self.chunks, "bytes": self.bytes_out,
        }
        if self.model is not None:
            doc["model"] = self.model
        if self.trace is not None:
            doc["trace_id"] = self.trace.trace_id
        if self.tenant is not None:
            doc["tenant"] = self.tenant
        rate = self.chunks_per_second()
        if rate is not None:
            doc["chunks_per_s"] = rate
        if self.error:
            doc["error"] = self.error
        return doc

    def chunks_per_second(self) -> float | None:
        """Streamed events per second after the first one: the decode's token rate as the
        client saw it (vLLM writes one event per token)."""
        first, total = self.timings.get(FIRST_BYTE), self.timings.get(TOTAL)
        if self.chunks < 2 or first is None or total is None or total <= first:
            return None
        return round((self.chunks - 1) / ((total - first) / 1000.0), 1)


def compact(decisions: list[str]) -> list[str]:
    """Repeats in a row as one entry with a count (``encode:round_robin(rotation)x8``): a
    request with many media items makes as many encoder decisions."""
    out: list[str] = []
    count = 0
    for n, entry in enumerate(decisions):
        count += 1
        if n + 1 == len(decisions) or decisions[n + 1] != entry:
            out.append(entry if count == 1 else f"{entry}x{count}")
            count = 0
    return out
