"""A hand-written upstream for tests that need an instance to misbehave in one exact way
(a body framed oddly, an answer too big, a redirect, one enormous event, a hint before the
answer, a connection closed under a reused request): what the simulator will not do on
purpose. One listener class and one request reader serve every such test."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import gevent
from gevent.server import StreamServer

#: ``handler(conn, request)``: answer one request on ``conn`` (the request's head and body).
Handler = Callable[[socket.socket, bytes], None]
#: ``handler(conn)``: the whole of one connection, for a peer that misbehaves before, between
#: or instead of requests (it reads them with ``read_request``).
ConnectionHandler = Callable[[socket.socket], None]


def read_request(conn: socket.socket) -> bytes:
    """One request's head and its Content-Length body; b"" if the peer closed before the head
    ended, and what arrived of the body if it closed during it."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(65536)
        if not part:
            return b""
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        part = conn.recv(65536)
        if not part:
            break
        body += part
    return head + b"\r\n\r\n" + body


def response(status: str = "200 OK", body: bytes = b"", *,
             content_type: str = "application/json", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
LAST_CHUNK = b"0\r\n\r\n"


class FakeUpstream:
    """A listener on 127.0.0.1 answering every request with ``handler`` (requests recorded in
    ``requests``), or with ``raw=``, handing each connection whole to a ``ConnectionHandler``.
    Every accepted connection is in ``connections``; each is closed when its handler is done."""

    def __init__(self, handler: Handler | None = None, *,
                 raw: ConnectionHandler | None = None) -> None:
        assert (handler is None) != (raw is None), "a request handler or a raw one"
        self.handler = handler
        self.raw = raw
        self.requests: list[bytes] = []
        self.connections: list[socket.socket] = []
        self._server = StreamServer(("127.0.0.1", 0), self._serve)
        self._server.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def _serve(self, conn: socket.socket, _addr: Any) -> None:
        self.connections.append(conn)
        try:
            if self.raw is not None:
                self.raw(conn)
                return
            while request := read_request(conn):
                self.requests.append(request)
                self.handler(conn, request)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._server.stop(timeout=1)


@contextlib.contextmanager
def upstreams() -> Iterator[Callable[..., FakeUpstream]]:
    """``start(handler)`` or ``start(raw=handler)``: FakeUpstreams, all stopped on exit."""
    started: list[FakeUpstream] = []

    def start(handler: Handler | None = None, *,
              raw: ConnectionHandler | None = None) -> FakeUpstream:
        server = FakeUpstream(handler, raw=raw)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def hints_then(interim: bytes, answer: Callable[[bytes], bytes], pause: float) -> Handler:
    """A server that hints early and answers when done: ``interim`` at once, then ``pause``
    later ``answer(request)``."""
    def handle(conn: socket.socket, request: bytes) -> None:
        conn.sendall(interim)
        gevent.sleep(pause)
        conn.sendall(answer(request))
    return handle


def serve_and_wait(raw: bytes, wait: float = 30.0) -> Handler:
    """Send ``raw`` and then hold the connection silently for ``wait`` seconds."""
    def handle(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(raw)
        gevent.sleep(wait)
    return handle
