"""The requests one worker carries right now: the cap on how many (overload), the refusal past
it, and the handles a shutdown needs to end the ones still running and close idle
connections.

A request counts from the moment the WSGI server hands it over until its body is closed, so a
stream holds its slot for as long as it streams. Refusals are answered before the body is
read: a worker past its cap spends microseconds per extra request, not the price of a JSON
parse. Health, readiness and metrics routes are never refused, so probes keep telling the
truth about a busy worker.
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

from epd_flask.core import errors, events
from epd_flask.core.errors import Overloaded, ProxyError
from epd_flask.core.headers import REQUEST_ID_HEADER, request_id
from epd_flask.serving.legs import SOCKET_KEYS

logger = logging.getLogger(__name__)

#: Routes that answer about the worker itself: cheap, and needed most when it is busy.
EXEMPT_PATHS = frozenset({"/health", "/healthz", "/ready", "/readyz", "/metrics", "/status",
                          "/debug/worker"})

StartResponse = Callable[..., Any]


class InFlight:
    """Per-worker counters and the greenlets serving admitted requests.

    All callers run on one gevent hub and nothing here yields, so no lock is needed.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the in-flight limit must be at least 1")
        self.limit = limit
        self.peak = 0
        self.admitted = 0
        self.rejected = 0
        self.draining = False
        self._active: dict[object, tuple[gevent.Greenlet, Any]] = {}
        # Client connections seen and when each last finished a request, so a drain can end
        # the ones left idle (see end_idle).
        self._idle_since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._ended: weakref.WeakSet[Any] = weakref.WeakSet()
        events.load.fire(0, limit)

    @property
    def count(self) -> int:
        return len(self._active)

    def refusal(self) -> ProxyError | None:
        """Why a new request must be refused now (and count it), or None to admit it.

        A draining worker still serves what arrives on connections it already has: gunicorn
        stopped accepting new ones and closes each after its answer, and a refusal here would
        reach clients behind a proxy (nginx) that reuses its kept-alive connections, where
        serving it costs nothing but the same bounded wait as the requests already running.
        """
        if len(self._active) >= self.limit:
            self.rejected += 1
            events.refused.fire("overloaded")
            return Overloaded(f"this server is at its limit of {self.limit} concurrent "
                              "requests; retry shortly")
        return None

    def seen(self, connection: Any) -> None:
        """A request arrived on ``connection``; exempt routes count as done at once."""
        if connection is not None:
            self._idle_since[connection] = time.monotonic()

    def enter(self, connection: Any = None) -> object:
        token = object()
        self._active[token] = (gevent.getcurrent(), connection)
        self.seen(connection)
        self.admitted += 1
        self.peak = max(self.peak, len(self._active))
        events.load.fire(len(self._active), self.limit)
        return token

    def leave(self, token: object) -> None:
        _, connection = self._active.pop(token, (None, None))
        events.load.fire(len(self._active), self.limit)
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
        return {"in_flight": len(self._active), "limit": self.limit, "peak": self.peak,
                "admitted": self.admitted, "rejected_overload": self.rejected,
                "draining": self.draining}


class InFlightMiddleware:
    """Wraps the Flask app: admit (and track until the body closes) or refuse at once."""

    def __init__(self, app: Callable[..., Iterable[bytes]], inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Any:
        if environ.get("PATH_INFO") in EXEMPT_PATHS:
            self.inflight.seen(connection_of(environ))
            return self.app(environ, start_response)
        refusal = self.inflight.refusal()
        if refusal is not None:
            return self._refuse(refusal, environ, start_response)
        token = self.inflight.enter(connection_of(environ))
        try:
            result = self.app(environ, start_response)
        except BaseException:
            self.inflight.leave(token)
            raise
        return ClosingIterator(result, lambda: self.inflight.leave(token))

    def _refuse(self, err: ProxyError, environ: dict[str, Any],
                start_response: StartResponse) -> list[bytes]:
        status, body, content_type = errors.render(err)
        rid = request_id(environ.get("HTTP_X_REQUEST_ID"))
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))),
                   (REQUEST_ID_HEADER, rid), *errors.extra_headers(err)]
        logger.info("request_id=%s route=%s status=%d refused: %s", rid,
                    environ.get("PATH_INFO"), status, err.code)
        start_response(f"{status} {_REASONS.get(status, 'Error')}", headers)
        return [body]


_REASONS = {503: "Service Unavailable"}


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
