"""The life of one upstream connection (docs/behaviour.md#transport): reused while fresh,
retired before the instance closes it, replayed once on a fresh socket when a reused one turns
out to be dead (``http1.py`` does the replay and reads past interim answers).

urllib3 pool and connection subclasses, used only as socket containers by ``transport.py`` and
``http1.py``: urllib3 connects (TLS included) and pools; it never writes a request nor reads an
answer (``http1.py`` does, ~4x cheaper per call). vLLM (uvicorn) closes
a keep-alive connection 5 s after its last response (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); a
request written into such a connection just as the server closes it dies with nothing
received. We never hand out a connection idle longer than ``idle_timeout`` (set below the
server's), and if one still dies before answering, the same request is sent once more on a new
connection: the server never read it, so it never ran.
"""

from __future__ import annotations

import _socket
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

logger = logging.getLogger(__name__)

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
    ``HTTPException``: the connection is closed and the error goes through unwrapped."""


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


class _Counted:
    """Mixin for urllib3 connections: count sockets opened and requests per socket (a request
    on a socket that already carried one may meet a server that closed it: ``http1.py``)."""

    _uses = 0
    lifecycle: Lifecycle | None = None

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._uses = 0
        if self.lifecycle is not None:
            self.lifecycle.opened += 1


class ReplayingHTTPConnection(_Counted, HTTPConnection):
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


class ReplayingHTTPSConnection(_Counted, HTTPSConnection):
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
