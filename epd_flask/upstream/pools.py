"""The life of one upstream connection (docs/behaviour.md#transport): reused while fresh,
retired before the instance closes it, replayed once on a fresh socket when a reused one turns
out to be dead, and read past interim (1xx) answers to the final one.

urllib3 pool and connection subclasses, used only by ``transport.py``. vLLM (uvicorn) closes
a keep-alive connection 5 s after its last response (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); a
request written into such a connection just as the server closes it dies with nothing
received. We never hand out a connection idle longer than ``idle_timeout`` (set below the
server's), and if one still dies before answering, the same request is sent once more on a new
connection: the server never read it, so it never ran.
"""

from __future__ import annotations

import _socket
import http.client
import logging
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import gevent.queue
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from epd_flask.control import settings
from epd_flask.core import cooperate
from epd_flask.upstream.responsehead import LeanHTTPResponse

logger = logging.getLogger(__name__)

#: Pieces of a request smaller than this are held and sent together.
COALESCE_BYTES = 64 * 1024

#: What a socket the server already closed raises when we read the answer to a reused
#: connection: EOF before a status line (RemoteDisconnected is a ConnectionResetError), an RST,
#: or a TLS session cut without close_notify.
STALE_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionResetError, BrokenPipeError, ssl.SSLEOFError,
)


#: Interim answers read past before the final one; more is an upstream that never answers.
MAX_INTERIM_RESPONSES = 16


class InterimError(Exception):
    """The upstream's answer cannot end this exchange: a ``101`` (we never ask for an upgrade,
    so the connection now speaks something else) or interim answers without end. Not an
    ``HTTPException``, so urllib3 closes the connection and lets it through unwrapped."""


class FinalResponse(LeanHTTPResponse):
    """http.client's response, reading past every interim answer (RFC 9110 section 15.2), its
    plain header lines read by ``responsehead``.

    http.client skips only ``100 Continue``: a ``103 Early Hints`` would become the answer, with
    an empty body, and the connection would go back to the pool with the real answer still
    coming; the next request on it would read that one as its own.
    """

    def _read_status(self) -> tuple[str, int, str]:
        for _ in range(MAX_INTERIM_RESPONSES + 1):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if status == http.client.SWITCHING_PROTOCOLS:
                raise InterimError("answered 101 Switching Protocols to a request that asked "
                                   "for no upgrade")
            if not 100 <= status < 200:
                return version, status, reason
            http.client._read_headers(self.fp)  # type: ignore[attr-defined]
        raise InterimError(f"sent more than {MAX_INTERIM_RESPONSES} interim answers and no "
                           "final one")


@dataclass
class Lifecycle:
    """Shared by every pool of one transport; counters are for tests and logs."""

    idle_timeout: float = settings.default("EPD_UPSTREAM_IDLE_TIMEOUT")
    keepalive: bool = True
    retired: int = 0
    replayed: int = 0
    opened: int = 0
    _clock: Any = field(default=time.monotonic, repr=False)

    def stale(self, conn: Any, now: float | None = None) -> bool:
        idle_since = getattr(conn, "idle_since", None)
        if conn.sock is None or idle_since is None:
            return False
        return (self._clock() if now is None else now) - idle_since >= self.idle_timeout


class _ReplayOnStale:
    """Mixin for urllib3 connections: count requests per socket; replay a request once when
    a reused socket dies before the first byte of the answer."""

    response_class = FinalResponse
    _uses = 0
    _replay: tuple[Any, ...] | None = None
    _pending: list[bytes] | None = None
    lifecycle: Lifecycle | None = None

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._uses = 0
        if self.lifecycle is not None:
            self.lifecycle.opened += 1

    def request(self, method: str, url: str, body: Any = None, headers: Any = None,
                **kw: Any) -> None:
        reused = self.sock is not None and self._uses > 0  # type: ignore[attr-defined]
        replayable = body is None or isinstance(body, (bytes, bytearray))
        self._replay = ((method, url, body, headers, kw, self.timeout)  # type: ignore[attr-defined]
                        if reused and replayable else None)
        try:
            self._send_coalesced(method, url, body, headers, kw)
        finally:
            self._uses += 1

    def _send_coalesced(self, method: str, url: str, body: Any, headers: Any,
                        kw: dict[str, Any]) -> None:
        """One request in as few ``send()`` calls as its size allows.

        http.client writes the header block and urllib3 the body in separate sends; on
        loopback each first send wakes the receiver and costs as much as the rest of the call
        (profile of a32: sends were a third of the worker's CPU). Small pieces are held and
        written together at the end; a large body goes out in slices with the loop handed
        back between them, so other streams on the worker keep flowing while it is sent.
        """
        self._pending = []
        try:
            super().request(method, url, body=body, headers=headers, **kw)  # type: ignore[misc]
            pending, self._pending = self._pending, None
            if pending:
                super().send(b"".join(pending))  # type: ignore[misc]
        finally:
            self._pending = None

    def send(self, data: Any) -> None:
        pending = self._pending
        if pending is not None and isinstance(data, (bytes, bytearray)):
            if len(data) < COALESCE_BYTES:
                pending.append(bytes(data))
                return
            if pending:
                self._pending = []
                super().send(b"".join(pending))  # type: ignore[misc]
            view = memoryview(data)
            for start in range(0, len(view), cooperate.LARGE_BYTES):
                super().send(view[start:start + cooperate.LARGE_BYTES])  # type: ignore[misc]
                cooperate.after_step(cooperate.LARGE_BYTES)
            return
        super().send(data)  # type: ignore[misc]

    def getresponse(self) -> Any:
        try:
            return super().getresponse()  # type: ignore[misc]
        except STALE_ERRORS as exc:
            replay, self._replay = self._replay, None
            if replay is None:
                raise
            method, url, body, headers, kw, connect_timeout = replay
            logger.info("upstream %s:%s closed a reused connection before answering (%s); "
                        "sending the request again on a new connection",
                        self.host, self.port, type(exc).__name__)  # type: ignore[attr-defined]
            if self.lifecycle is not None:
                self.lifecycle.replayed += 1
            read_timeout = self.timeout  # type: ignore[has-type]
            self.close()  # type: ignore[attr-defined]
            self.timeout = connect_timeout
            self._send_coalesced(method, url, body, headers, kw)
            self._uses = 1
            self.timeout = read_timeout
            return super().getresponse()  # type: ignore[misc]


class ReplayingHTTPConnection(_ReplayOnStale, HTTPConnection):
    @property
    def is_connected(self) -> bool:
        """urllib3 asks this of every reused connection; its answer is a zero-timeout poll,
        which under gevent goes through the hub (~4% of a32's worker CPU). A non-blocking peek
        at gevent's underlying socket answers the same: nothing readable means alive; EOF, an
        error or unexpected bytes mean not reusable. Plain TCP only: under TLS unread records
        (session tickets) are normal. Anything else keeps urllib3's check."""
        raw = getattr(self.sock, "_sock", None)
        if not isinstance(raw, _socket.socket) or raw.gettimeout() != 0.0:
            return super().is_connected
        try:
            raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False


class ReplayingHTTPSConnection(_ReplayOnStale, HTTPSConnection):
    pass


class _Retiring:
    """Mixin for urllib3 pools: stamp connections when they come back, refuse stale ones.

    The queue is gevent's (urllib3's default stdlib queue takes a lock inside a GC
    finalizer, which can deadlock a gevent worker: gevent#1957, urllib3#3289, the fix
    Locust ships in locust#2813); it is set here explicitly so it does not depend on the
    urllib3 version or on whether ``queue`` was patched.
    """

    QueueCls = gevent.queue.LifoQueue
    lifecycle: Lifecycle

    def __init__(self, *args: Any, lifecycle: Lifecycle, **kw: Any) -> None:
        self.lifecycle = lifecycle
        super().__init__(*args, **kw)  # type: ignore[call-arg]

    def _new_conn(self) -> Any:
        conn = super()._new_conn()  # type: ignore[misc]
        conn.lifecycle = self.lifecycle
        return conn

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        if self.lifecycle.stale(conn):
            self.lifecycle.retired += 1
            conn.close()  # reconnects on its next request
        return conn

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            if not self.lifecycle.keepalive:
                conn.close()
            conn.idle_since = self.lifecycle._clock()
        super()._put_conn(conn)  # type: ignore[misc]

    def sweep(self) -> int:
        """Close idle connections past their time (they would only be retired when reached
        at the bottom of the LIFO queue; meanwhile they hold a file descriptor in CLOSE_WAIT).

        Reads the queue's list in place and never yields. urllib3 fills a pool's queue with
        ``maxsize`` placeholders (1024 by default), so taking every entry out and putting it
        back, cost ~73 us of CPU per pool per sweep (now ~4.5 us); a closed connection stays
        where it is and reconnects when next taken, as before."""
        pool = getattr(self, "pool", None)
        if pool is None:
            return 0
        now = self.lifecycle._clock()
        stale = [conn for conn in pool.queue
                 if conn is not None and self.lifecycle.stale(conn, now)]
        for conn in stale:
            conn.close()
        self.lifecycle.retired += len(stale)
        return len(stale)


class RetiringHTTPConnectionPool(_Retiring, HTTPConnectionPool):
    ConnectionCls = ReplayingHTTPConnection


class RetiringHTTPSConnectionPool(_Retiring, HTTPSConnectionPool):
    ConnectionCls = ReplayingHTTPSConnection
