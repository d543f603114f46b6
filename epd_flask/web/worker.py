"""gunicorn's gevent worker with a bound on the time a client takes to send a request's head
(``EPD_HEADER_TIMEOUT``), on the time it may take nothing of its answer
(``EPD_CLIENT_WRITE_TIMEOUT``), room for new clients among idle connections, and a lazy
``100 Continue``.

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

At its ``worker_connections`` the worker closes its longest-idle kept-alive connection, so
idle connections cannot lock new clients out (``Connections``); and ``Expect: 100-continue``
is answered when the application first reads the body, after its checks (``ContinueOnRead``).
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
from epd_flask.web import collector

logger = logging.getLogger(__name__)


class _HeadTimeout(BaseException):
    """Thrown into the greenlet reading a head that took too long; caught by the deadline
    that threw it (a BaseException, like gevent's Timeout, so no ``except Exception`` on the
    way swallows it)."""


class _Evicted(BaseException):
    """Thrown into the greenlet of an idle kept-alive connection to close it (see
    ``Connections``)."""


class Connections:
    """The connections of one listener, and those of them idle between two requests (oldest
    first), against gevent's pool of ``limit``: a full pool stops accepting, so at the limit
    the longest-idle kept-alive connection is closed and a new client gets its place.

    Idle connections would otherwise fill the pool until ``keepalive`` (75 s) closes them,
    and a client sending one small request per connection just under that keeps a worker
    closed to everyone else. A client whose connection is closed this way opens a new one
    for its next request (HTTP/1.1 allows the server to close an idle connection at any time).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._idle: dict[HeadDeadline, None] = {}
        self.evicted = 0

    def opened(self) -> None:
        self.open += 1
        self._make_room()

    def closed(self) -> None:
        self.open -= 1

    def idle(self, deadline: HeadDeadline) -> None:
        self._idle[deadline] = None
        self._make_room()

    def busy(self, deadline: HeadDeadline) -> None:
        self._idle.pop(deadline, None)

    def _make_room(self) -> None:
        if self.open >= self.limit and self._idle:
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            self.evicted += 1
            oldest.evict()


class HeadDeadline:
    """The context gunicorn reads one request's head in (its ``timeout_ctx``).

    Armed with ``head`` seconds at once for a connection's first request; for a later one,
    ``idle`` seconds until the socket turns readable, then ``head`` seconds from there. While
    it waits idle, its listener's ``Connections`` may close it to make room.
    """

    def __init__(self, sock: Any, idle: float, head: float, first: bool,
                 connections: Connections | None = None) -> None:
        self._sock = sock
        self._idle = idle
        self._head = head
        self._first = first
        self._connections = connections
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
            if self._connections is not None:
                self._connections.idle(self)
        return self

    def evict(self) -> None:
        """Close this connection if it is still idle when the loop next runs (the greenlet
        that asks may be this connection's own, entering its idle wait)."""
        gevent.get_hub().loop.run_callback(self._evict_now)

    def _evict_now(self) -> None:
        if self._watch is not None:
            self._greenlet.throw(_Evicted())

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
            if self._connections is not None:
                self._connections.busy(self)

    def __exit__(self, typ: Any, value: Any, tb: Any) -> bool:
        self._stop_watch()
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        if value is self._exc:
            logger.info("a client took more than %g s to send a request's head; its "
                        "connection was closed", self._head)
            return True
        if isinstance(value, _Evicted):
            logger.debug("closed an idle kept-alive connection: the worker is at its "
                         "connection limit")
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


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ContinueOnRead:
    """``wsgi.input`` of a request that sent ``Expect: 100-continue``: the ``100 Continue``
    goes out when the application first reads the body, not before it runs.

    gunicorn sends it as soon as the head is parsed, so a client was told to send a body the
    proxy then refused without reading (401, 413, 415, 503 ``overloaded``), and sent it
    (RFC 9110 10.1.1: a server "MAY omit" the 100 when it answers with a final status first).
    """

    def __init__(self, stream: Any, sock: Any) -> None:
        self._stream = stream
        self._sock = sock
        self.sent = False

    def _go_ahead(self) -> None:
        if not self.sent:
            self.sent = True
            self._sock.sendall(CONTINUE)

    def read(self, *args: Any) -> bytes:
        self._go_ahead()
        return self._stream.read(*args)

    def readline(self, *args: Any) -> bytes:
        self._go_ahead()
        return self._stream.readline(*args)

    def readlines(self, *args: Any) -> list[bytes]:
        self._go_ahead()
        return self._stream.readlines(*args)

    def __iter__(self) -> Any:
        self._go_ahead()
        return iter(self._stream)


class ExpectingApp:
    """The worker's application, with ``100 Continue`` sent on its first body read for
    requests that asked for one (``expecting``: handler greenlet -> its request and socket).
    One that answers without reading the body closes the connection after its answer: the
    body may be on its way, or may never come. Every other attribute is the application's,
    so the configuration's hooks find its services on ``worker.wsgi`` as before."""

    def __init__(self, app: Any, expecting: weakref.WeakKeyDictionary[Any, Any]) -> None:
        self.app = app
        self._expecting = expecting

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        pending = self._expecting.pop(gevent.getcurrent(), None) if self._expecting else None
        if pending is None:
            return self.app(environ, start_response)
        req, sock = pending
        body = environ["wsgi.input"] = ContinueOnRead(environ["wsgi.input"], sock)

        def start(status: str, headers: Any, exc_info: Any = None) -> Any:
            if not body.sent:
                req.force_close()
            return start_response(status, headers, exc_info)

        return self.app(environ, start)


def take_expectation(req: Any) -> bool:
    """Take ``Expect: 100-continue`` off a parsed request before gunicorn answers it; True if
    it was there (gunicorn marks it on the request: ``_expected_100_continue``, the one
    private attribute this relies on)."""
    if not req._expected_100_continue:
        return False
    req._expected_100_continue = False
    return True


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
        # Per listening socket, as gunicorn gives each its own pool of worker_connections.
        self._listeners: dict[Any, Connections] = {}
        # The request (and its socket) each handler greenlet owes a "100 Continue".
        self._expecting: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = \
            weakref.WeakKeyDictionary()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        lean_client_socket(client)
        connections = self._listeners.get(listener)
        if connections is None:
            connections = self._listeners[listener] = Connections(self.worker_connections)
        self._connections[gevent.getcurrent()] = [client, True, connections]
        connections.opened()
        try:
            super().handle(listener, client, addr)
        finally:
            connections.closed()
            self._connections.pop(gevent.getcurrent(), None)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> Any:
        if not take_expectation(req):
            return super().handle_request(listener_name, req, sock, addr)
        current = gevent.getcurrent()
        self._expecting[current] = (req, sock)
        try:
            return super().handle_request(listener_name, req, sock, addr)
        finally:
            self._expecting.pop(current, None)

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = ExpectingApp(self.wsgi, self._expecting)

    def run(self) -> None:
        """Serve, with the collector set for a flood of requests (``web/collector.py``) once
        the app and ``post_worker_init``'s greenlets are loaded, so they are frozen with it."""
        collector.settle()
        super().run()

    def timeout_ctx(self) -> HeadDeadline:
        state = self._connections.get(gevent.getcurrent())
        sock, first, connections = state if state is not None else (None, True, None)
        if state is not None:
            state[1] = False
        return HeadDeadline(sock, self.cfg.keepalive, self.header_timeout, first, connections)
