"""gunicorn's gevent worker with a bound on the time a client takes to send a request's head
(``EPD_HEADER_TIMEOUT``).

The stock worker reads every head under one ``gevent.Timeout(keepalive)``: a client that
sends its head a byte at a time holds a connection for the whole keep-alive time (75 s), and
a thousand of them fill ``worker_connections`` so that the worker stops accepting, its
``/health`` included. Here the first head on a connection must be complete within the
header timeout of the accept; on a kept-alive connection the wait for the next request may
last ``keepalive`` as before, and its head then has the header timeout from its first byte.
A head that misses its deadline closes the connection. The body is bounded by the app
(``web/slowbody.py``). Imported by the gunicorn master (``worker_class``), so it imports
nothing of the app; gunicorn's own gevent worker, which it extends, is imported there too.

Each client socket also writes through ``LeanSendSocket``: a stream's every event is one
``sendall``, and gevent's asks the kernel for the send buffer's size before every one. The
same ``sendall`` resets a client that accepts no byte for ``EPD_CLIENT_WRITE_TIMEOUT``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import weakref
from typing import Any

import gevent
import gevent.socket
from gevent.socket import wait_write
from gunicorn.workers.ggevent import GeventWorker as _StockGeventWorker

from epd_flask.control.settings import default, read

logger = logging.getLogger(__name__)


class _HeadTimeout(BaseException):
    """Thrown into the greenlet reading a head that took too long; caught by the deadline
    that threw it (a BaseException, like gevent's Timeout, so no ``except Exception`` on the
    way swallows it)."""


class HeadDeadline:
    """The context gunicorn reads one request's head in (its ``timeout_ctx``).

    Armed with ``head`` seconds at once for a connection's first request; for a later one,
    ``idle`` seconds until the socket turns readable, then ``head`` seconds from there.
    """

    def __init__(self, sock: Any, idle: float, head: float, first: bool) -> None:
        self._sock = sock
        self._idle = idle
        self._head = head
        self._first = first
        self._exc = _HeadTimeout()
        self._greenlet: Any = None
        self._timer: Any = None
        self._watch: Any = None

    def __enter__(self) -> HeadDeadline:
        self._greenlet = gevent.getcurrent()
        loop = gevent.get_hub().loop
        if self._first or self._sock is None:
            self._arm(self._head)
        else:
            self._arm(self._idle)
            self._watch = loop.io(self._sock.fileno(), 1)
            self._watch.start(self._readable)
        return self

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.close()
        self._timer = gevent.get_hub().loop.timer(seconds)
        self._timer.start(self._greenlet.throw, self._exc)

    def _readable(self) -> None:
        """The next request's first bytes (or the client's EOF) arrived."""
        self._stop_watch()
        self._arm(self._head)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch.close()
            self._watch = None

    def __exit__(self, typ: Any, value: Any, tb: Any) -> bool:
        self._stop_watch()
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        if value is self._exc:
            logger.info("a client took more than %g s to send a request's head; its "
                        "connection was closed", self._head)
            return True
        return False


class ClientWriteTimeout(ConnectionResetError):
    """A client accepted no byte of its answer for ``EPD_CLIENT_WRITE_TIMEOUT`` seconds.

    A ``ConnectionResetError`` because that is what the connection becomes: it is reset
    (closed with linger 0), so the kernel drops the unsent bytes instead of retrying them
    for minutes, and gunicorn handles it as a client gone: the response iterable is closed
    (the relay closes decode, vLLM aborts the request) and nothing is logged as an error.
    """


class LeanSendSocket(gevent.socket.socket):
    """A gevent socket whose ``sendall`` is plain non-blocking ``send`` calls, and gives up on
    a client that accepts no byte for ``write_timeout`` seconds.

    gevent's ``sendall`` reads ``SO_SNDBUF`` (a ``getsockopt`` syscall) to size its slices,
    then goes through three Python frames to the same ``send``: 2.5 us against 0.8 us for a
    300-byte event on loopback. What that first ``send`` leaves (a full buffer: a slow client)
    waits for the socket to turn writable, at most ``write_timeout`` at a time: the clock
    restarts with every byte the client takes, so a slow reader is served and one that stopped
    reading is not (a client that never reads would otherwise hold its stream, its in-flight
    slot and the decode sequence behind it for as long as its connection stays open).
    """

    __slots__ = ()

    #: Set by the worker from ``EPD_CLIENT_WRITE_TIMEOUT`` (one value per process).
    write_timeout: float = default("EPD_CLIENT_WRITE_TIMEOUT")

    def sendall(self, data: Any, flags: int = 0) -> None:
        if type(data) is bytes and data:
            try:
                sent = self._sock.send(data, flags)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        if self.timeout is not None:  # a timeout of its own (gunicorn's are blocking): gevent's
            super().sendall(data, flags)
            return
        data = memoryview(data).cast("B")
        while data:
            try:
                wait_write(self.fileno(), timeout=self.write_timeout)
            except TimeoutError:
                raise self._stalled() from None
            try:
                sent = self._sock.send(data, flags)
            except BlockingIOError:
                continue
            data = data[sent:]

    def _stalled(self) -> ClientWriteTimeout:
        logger.info("a client accepted no byte of its answer for %g s "
                    "(EPD_CLIENT_WRITE_TIMEOUT); its connection was reset", self.write_timeout)
        with contextlib.suppress(OSError):
            self.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return ClientWriteTimeout(errno.ECONNRESET, "the client stopped reading its answer")


def lean_client_socket(sock: Any) -> None:
    """Make an accepted plain gevent socket a ``LeanSendSocket`` in place (the class only
    adds a method, so the object's layout is the same); TLS sockets are left as they are."""
    if type(sock) is gevent.socket.socket:
        sock.__class__ = LeanSendSocket


class GeventWorker(_StockGeventWorker):
    """``worker_class`` of the packaged gunicorn configuration. ``-k gevent`` on the command
    line (``gunicorn -k gevent wsgi:app``) makes gunicorn fork its stock worker instead; the
    configuration's ``post_fork`` hook then upgrades it with ``adopt``."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._bound_heads()

    @classmethod
    def adopt(cls, worker: _StockGeventWorker) -> None:
        """Make a freshly forked stock gevent worker this class: same state, plus the header
        deadline. Only before ``init_process`` (gunicorn's ``post_fork``), when nothing has
        been read from a client yet."""
        worker.__class__ = cls
        worker._bound_heads()  # type: ignore[attr-defined]

    def _bound_heads(self) -> None:
        self.header_timeout: float = read("EPD_HEADER_TIMEOUT")
        LeanSendSocket.write_timeout = read("EPD_CLIENT_WRITE_TIMEOUT")
        # The connection each handler greenlet serves, and whether its next head is its
        # first: gunicorn's timeout_ctx() is called without either.
        self._connections: weakref.WeakKeyDictionary[Any, list[Any]] = \
            weakref.WeakKeyDictionary()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        lean_client_socket(client)
        self._connections[gevent.getcurrent()] = [client, True]
        try:
            super().handle(listener, client, addr)
        finally:
            self._connections.pop(gevent.getcurrent(), None)

    def timeout_ctx(self) -> HeadDeadline:
        state = self._connections.get(gevent.getcurrent())
        sock, first = state if state is not None else (None, True)
        if state is not None:
            state[1] = False
        return HeadDeadline(sock, self.cfg.keepalive, self.header_timeout, first)
