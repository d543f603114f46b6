"""The requests one worker carries right now: the cap on how many (overload), the refusal past
it, and the handles a shutdown needs to end the ones still running and close idle
connections.

A request counts against the cap from the moment its body has arrived (at once when it has
none) until its answer is closed, so a stream holds its slot for as long as it streams.
Refusals are answered before the body is read: a worker past its cap spends microseconds per
extra request, not the price of a JSON parse; the cap is checked again when a body completes.
A request still sending its body holds no slot: clients that trickle bodies would otherwise
take every slot that requests whose bodies are in need (docs/behaviour.md#edge). Bodies in
progress have their own bound, the same number as the cap: past it, a new request's body must
arrive within ``BUSY_BODY_SECONDS`` instead of ``EPD_BODY_TIMEOUT`` (a body sent with its head
always does), else 503 ``overloaded``. Health, readiness and metrics routes are never
refused, so probes keep telling the truth about a busy worker.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import gevent
from werkzeug.wsgi import ClosingIterator

from epd_flask.core import errors
from epd_flask.core.errors import Overloaded, ProxyError
from epd_flask.core.events import Events
from epd_flask.core.headers import REQUEST_ID_HEADER, request_id
from epd_flask.core.logfmt import quote
from epd_flask.serving.clientwatch import SOCKET_KEYS

logger = logging.getLogger(__name__)

#: How long a body may take when ``limit`` bodies are already in progress: a body sent with
#: its head is there at once, one a client trickles is refused before it holds a connection
#: for ``EPD_BODY_TIMEOUT``.
BUSY_BODY_SECONDS = 1.0
#: Where a request with a body finds its ``BodyArrival`` (web/slowbody.py reads it).
BODY_ARRIVAL = "epd_flask.body_arrival"

#: Routes that answer about the worker itself: cheap, and needed most when it is busy.
EXEMPT_PATHS = frozenset({"/health", "/healthz", "/ready", "/readyz", "/metrics", "/status",
                          "/debug/worker"})

StartResponse = Callable[..., Any]


class InFlight:
    """Per-worker counters and the greenlets serving admitted requests.

    All callers run on one gevent hub and nothing here yields, so no lock is needed.
    """

    def __init__(self, limit: int, events: Events | None = None) -> None:
        if limit < 1:
            raise ValueError("the in-flight limit must be at least 1")
        self.limit = limit
        self.events = events if events is not None else Events()
        self.peak = 0
        self.admitted = 0
        self.rejected = 0
        self.draining = False
        self._active: dict[object, tuple[gevent.Greenlet, Any]] = {}
        # The admitted requests whose body is still arriving: not counted against the cap.
        self._receiving: set[object] = set()
        # Client connections seen and when each last finished a request, so a drain can end
        # the ones left idle (see end_idle).
        self._idle_since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._ended: weakref.WeakSet[Any] = weakref.WeakSet()
        self.events.load.fire(0, limit)

    @property
    def count(self) -> int:
        """Every admitted request still running, its body arrived or not (what a drain
        waits for)."""
        return len(self._active)

    @property
    def load(self) -> int:
        """The requests counted against the cap: admitted, their body arrived."""
        return len(self._active) - len(self._receiving)

    @property
    def receiving(self) -> int:
        return len(self._receiving)

    def refusal(self) -> ProxyError | None:
        """Why a new request must be refused now (and count it), or None to admit it.

        A draining worker still serves what arrives on connections it already has: gunicorn
        stopped accepting new ones and closes each after its answer, and a refusal here would
        reach clients behind a proxy (nginx) that reuses its kept-alive connections, where
        serving it costs nothing but the same bounded wait as the requests already running.
        """
        if self.load >= self.limit:
            return self._refused()
        return None

    def _refused(self) -> Overloaded:
        self.rejected += 1
        self.events.refused.fire("overloaded")
        return Overloaded(f"this server is at its limit of {self.limit} concurrent "
                          "requests; retry shortly")

    def seen(self, connection: Any) -> None:
        """A request arrived on ``connection``; exempt routes count as done at once."""
        if connection is not None:
            self._idle_since[connection] = time.monotonic()

    def enter(self, connection: Any = None, receiving: bool = False) -> object:
        """Admit a request; ``receiving``: its body is still to come, and it counts against
        the cap only from ``arrived``."""
        token = object()
        self._active[token] = (gevent.getcurrent(), connection)
        self.seen(connection)
        self.admitted += 1
        if receiving:
            self._receiving.add(token)
        else:
            self._counted()
        return token

    def arrived(self, token: object, check: bool = True) -> None:
        """The request's body has arrived: it counts against the cap from now on, unless
        ``check`` finds the cap reached meanwhile (raises ``Overloaded``; the request is
        answered without ever counting)."""
        if token not in self._receiving:
            return
        if check and self.load >= self.limit:
            raise self._refused()
        self._receiving.discard(token)
        self._counted()

    def _counted(self) -> None:
        load = self.load
        self.peak = max(self.peak, load)
        self.events.load.fire(load, self.limit)

    def leave(self, token: object) -> None:
        _, connection = self._active.pop(token, (None, None))
        self._receiving.discard(token)
        self.events.load.fire(self.load, self.limit)
        if connection is not None:
            self._idle_since[connection] = time.monotonic()

    def begin_drain(self) -> None:
        self.draining = True

    def end_idle(self, grace: float) -> int:
        """End kept-alive connections idle for ``grace`` seconds; returns how many idle ones
        are still open (ended or not), so the drain knows when only its own wait is left.

        gunicorn decides whether a connection stays open when a request *starts*, so
        connections of requests admitted before the stop wait for a next request (up to
        ``keepalive`` seconds) and the worker could not exit before the master's SIGKILL.
        Shutting the read side ends that wait with EOF. Only connections idle for a while are
        ended: a client reusing a connection that was busy a moment ago gets its request
        served (gunicorn marks that answer ``Connection: close``) instead of lost.
        """
        now = time.monotonic()
        busy = {id(c) for _, c in self._active.values() if c is not None}
        still_open = 0
        for connection, since in list(self._idle_since.items()):
            if id(connection) in busy or _closed(connection):
                continue
            still_open += 1
            if connection not in self._ended and now - since >= grace:
                self._ended.add(connection)
                end_reads(connection)
        return still_open

    def greenlets(self) -> list[gevent.Greenlet]:
        return [g for g, _ in self._active.values()]

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": self.load, "receiving_body": len(self._receiving),
                "limit": self.limit, "peak": self.peak, "admitted": self.admitted,
                "rejected_overload": self.rejected, "draining": self.draining}


class BodyArrival:
    """What the body reader (web/slowbody.py) reports to the cap about one request's body."""

    __slots__ = ("busy", "done", "inflight", "token")

    def __init__(self, inflight: InFlight, token: object, busy: bool) -> None:
        self.inflight = inflight
        self.token = token
        #: Admitted with ``limit`` bodies already in progress: a short time to send it.
        self.busy = busy
        self.done = False

    def arrived(self) -> None:
        """The whole body is read; ``Overloaded`` if the cap was reached meanwhile."""
        if not self.done:
            self.done = True
            self.inflight.arrived(self.token)

    def too_slow(self, seconds: float) -> ProxyError:
        """A busy worker's refusal of a body that took more than ``seconds``."""
        self.done = True
        self.inflight.rejected += 1
        self.inflight.events.refused.fire("overloaded")
        return Overloaded(f"this server is receiving {self.inflight.limit} request bodies "
                          f"already, and this one did not arrive within {seconds:g} s; "
                          "send the body with the request, or retry shortly")


class InFlightMiddleware:
    """Wraps the Flask app: admit (and track until the body closes) or refuse at once."""

    def __init__(self, app: Callable[..., Iterable[bytes]], inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Any:
        if environ.get("PATH_INFO") in EXEMPT_PATHS:
            self.inflight.seen(connection_of(environ))
            return self.app(environ, start_response)
        inflight = self.inflight
        refusal = inflight.refusal()
        if refusal is not None:
            return self._refuse(refusal, environ, start_response)
        arrival = None
        if has_body(environ):
            busy = inflight.receiving >= inflight.limit
            token = inflight.enter(connection_of(environ), receiving=True)
            arrival = environ[BODY_ARRIVAL] = BodyArrival(inflight, token, busy)
        else:
            token = inflight.enter(connection_of(environ))
        try:
            result = self.app(environ, start_response)
        except BaseException:
            inflight.leave(token)
            raise
        if arrival is not None and not arrival.done:
            # Answered without reading its whole body (a refusal, or a route that reads none):
            # what it sends from now on is served work.
            inflight.arrived(token, check=False)
        return ClosingIterator(result, lambda: inflight.leave(token))

    def _refuse(self, err: ProxyError, environ: dict[str, Any],
                start_response: StartResponse) -> list[bytes]:
        status, body, content_type = errors.render(err)
        rid = request_id(environ.get("HTTP_X_REQUEST_ID"))
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))),
                   (REQUEST_ID_HEADER, rid), *errors.extra_headers(err)]
        logger.info("request_id=%s route=%s status=%d refused: %s", rid,
                    quote(environ.get("PATH_INFO")), status, err.code)
        start_response(f"{status} {_REASONS.get(status, 'Error')}", headers)
        return [body]


_REASONS = {503: "Service Unavailable"}


def has_body(environ: dict[str, Any]) -> bool:
    """Does this request come with a body still to read (a length above 0, or chunked)?"""
    length = environ.get("CONTENT_LENGTH")
    if length and length != "0":
        return True
    return "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()


def connection_of(environ: dict[str, Any]) -> Any:
    for key in SOCKET_KEYS:
        if key in environ:
            return environ[key]
    return None


def _closed(connection: Any) -> bool:
    try:
        return connection.fileno() < 0
    except (OSError, AttributeError, ValueError):
        return True


def end_reads(connection: Any) -> None:
    """The server's next read on ``connection`` sees EOF; writes still go out.

    Done on a duplicate descriptor: gevent's own ``shutdown`` would wake the greenlet waiting
    on the socket with EBADF ("closed in another greenlet"), which gunicorn logs as an error,
    whereas the shared socket's EOF is a clean end of the connection.
    """
    try:
        dup = socket.fromfd(connection.fileno(), connection.family, connection.type)
    except (OSError, AttributeError, ValueError):
        return  # already closed, or not a socket
    with dup, contextlib.suppress(OSError):  # OSError: the peer already went away
        dup.shutdown(socket.SHUT_RD)
