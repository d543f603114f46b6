"""One HTTP/1.1 exchange on a pooled upstream connection: the request written as one block of
bytes, the answer read with httptools (llhttp, the C parser uvicorn uses).

urllib3 still keeps the sockets (a pool per instance, connecting, TLS, the liveness check,
retiring: ``pools.py``); what it and http.client did per call on top of that (urlopen's
bookkeeping, one validated ``putheader`` per header, a buffered reader, the status line and
header block parsed line by line in Python, urllib3's response object) was ~70 us of CPU per
call against ~10 us for the same bytes on a raw socket
(docs/benchmarks.md#one-upstream-call-upstream_callpy).

Failures are raised as the urllib3 and http.client exceptions those libraries raised for the
same event, so ``transport.py`` maps each to the same error, message and detail as before.
"""

from __future__ import annotations

import errno
import http.client
import logging
import re
import ssl
from collections.abc import Iterator, Mapping
from typing import Any

import gevent.socket
import httptools
from urllib3.exceptions import ProtocolError, ReadTimeoutError, SSLError
from urllib3.util.url import _encode_target

from epd_flask.core import cooperate
from epd_flask.upstream.pools import (
    MAX_INTERIM_RESPONSES,
    STALE_ERRORS,
    InterimError,
    Lifecycle,
)

logger = logging.getLogger(__name__)

#: The most one socket read takes; a relayed chunk is whatever one read brought.
READ_SIZE = 65536
#: Requests smaller than this go out in one ``send``; larger bodies in slices, with the loop
#: handed back between them so other streams on the worker keep flowing.
COALESCE_BYTES = 64 * 1024
#: A status line and header block larger than this, or with more header lines, is refused
#: (http.client's bounds: 100 lines; ours on bytes, since llhttp has none).
MAX_HEAD_BYTES = 1 << 20
MAX_HEADERS = 100
#: Methods for which a request without a body carries no ``Content-Length`` (as urllib3).
NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "TRACE", "OPTIONS", "CONNECT"})
_UNSAFE_TARGET = re.compile(r"[^\x21-\x7e]")
_GeventSocket = gevent.socket.socket


class Headers(Mapping[str, str]):
    """An answer's header fields as urllib3's ``HTTPHeaderDict`` gave them: ``get`` by any
    spelling (a repeated field's values joined with ", "), ``items`` in the order sent, a
    repeated field under the spelling of its first occurrence."""

    __slots__ = ("_fields", "_index")

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        index: dict[str, str] = {}
        for name, value in fields:
            key = name.lower()
            index[key] = f"{index[key]}, {value}" if key in index else value
        if len(index) != len(fields):
            spelling: dict[str, str] = {}
            fields = [(spelling.setdefault(name.lower(), name), value) for name, value in fields]
        self._fields = fields
        self._index = index

    def get(self, name: str, default: Any = None) -> Any:
        return self._index.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._index[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._index

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        return list(self._fields)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for name, _ in self._fields))

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"Headers({self._fields!r})"


def request_head(method: str, target: str, host: str, headers: dict[str, str],
                 body: bytes | None) -> bytes:
    """The request line and header block, in the order urllib3 wrote them (Host, then
    Content-Length, then the caller's headers). A name or value holding CR or LF is refused
    (``ValueError``, as http.client's ``putheader``): it would split the request."""
    if _UNSAFE_TARGET.search(target):
        target = _encode_target(target)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    elif method not in NO_BODY_METHODS:
        lines.append("Content-Length: 0")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    text = "\r\n".join(lines)
    breaks = len(lines) - 1
    if text.count("\n") != breaks or text.count("\r") != breaks:
        raise ValueError("Invalid header name or value (CR or LF)")
    return (text + "\r\n\r\n").encode("latin-1")


class Response:
    """The answer to one request on one pooled connection, read as it arrives.

    ``read_head`` reads past interim (1xx) answers to the final one; ``read1`` then gives the
    body one socket read at a time (chunked framing removed). ``release`` gives the connection
    back to its pool when the body was read to its end and the server keeps it open
    (HTTP/1.1 without ``Connection: close``, a delimited body), and closes it otherwise.
    """

    __slots__ = ("_eof_body", "_error", "_fields", "_final", "_interim", "_left", "_parser",
                 "_pieces", "_pool", "_received", "_switching", "body_done", "conn", "headers",
                 "keep_alive", "released", "sock", "status")

    def __init__(self, pool: Any, conn: Any) -> None:
        self._pool = pool
        self.conn = conn
        self.sock = conn.sock
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._fields: list[tuple[str, str]] = []
        self._pieces: list[bytes] = []
        self._final = False
        self._interim = 0
        self._switching = False
        self._eof_body = False
        self._error: ProtocolError | None = None
        self._left: int | None = None
        self._received = 0
        self.body_done = False
        self.keep_alive = False
        self.released = False
        self.status = 0
        self.headers: Headers | None = None

    # httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._fields = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._final:
            self._fields.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._final:
            return
        status = self._parser.get_status_code()
        if status == http.client.SWITCHING_PROTOCOLS:
            self._switching = True
            return
        if 100 <= status < 200:
            self._interim += 1
            return
        self._final = True
        self.status = status
        headers = self.headers = Headers(self._fields)
        length = headers.get("content-length")
        if length is not None and length.isdigit():
            self._left = int(length)
        elif "transfer-encoding" not in headers and status not in (204, 304):
            self._eof_body = True

    def on_body(self, body: bytes) -> None:
        if not self.body_done:
            self._pieces.append(body)

    def on_message_complete(self) -> None:
        if self._final and not self.body_done:
            self.body_done = True
            self.keep_alive = self._parser.should_keep_alive()

    # reading ---------------------------------------------------------------------------------

    def read_head(self) -> None:
        """Up to the final answer's header block; raises what http.client raised for the same
        event (``RemoteDisconnected`` when the server closed without a byte, so ``exchange``
        can tell a stale connection), or ``InterimError``."""
        while not self._final:
            try:
                data = self._recv()
            except STALE_ERRORS as exc:
                if self._received:  # the server read the request: never send it again
                    raise ProtocolError("Connection aborted.", exc) from exc
                raise
            if not data:
                if not self._received:
                    raise http.client.RemoteDisconnected(
                        "Remote end closed connection without response")
                raise http.client.IncompleteRead(b"", None)
            self._received += len(data)
            self._feed(data)
            if self._switching:
                raise InterimError("answered 101 Switching Protocols to a request that asked "
                                   "for no upgrade")
            if self._interim > MAX_INTERIM_RESPONSES:
                raise InterimError(f"sent more than {MAX_INTERIM_RESPONSES} interim answers "
                                   "and no final one")
            if not self._final and (self._received > MAX_HEAD_BYTES
                                    or len(self._fields) > MAX_HEADERS):
                raise http.client.HTTPException(
                    f"got more than {MAX_HEADERS} headers or {MAX_HEAD_BYTES} bytes of head")

    def _feed(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            raise ProtocolError("read after the connection was released")
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._switching:
                return  # read_head refuses the 101 itself
            if not self._final:
                raise ProtocolError("Connection aborted.", exc) from exc
            if not self.body_done:  # raised when the body is read, after what came before it
                self._error = ProtocolError(f"malformed body: {exc}")
            self.keep_alive = False  # bytes after the answer: the connection is not reusable

    def read1(self) -> bytes:
        """What the next socket read brought of the body (b"" once it is complete)."""
        pieces = self._pieces
        while not pieces and not self.body_done:
            if self._error is not None:
                raise self._error
            data = self._recv()
            if not data:
                if self._eof_body:
                    self.body_done = True
                    self.keep_alive = False
                    break
                if self._left is not None:
                    raise ProtocolError(f"the connection closed {self._left} bytes before "
                                        "the end of the body")
                raise ProtocolError("the connection closed before the last chunk")
            self._feed(data)
        if not pieces:
            return b""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if self._left is not None:
            self._left -= len(data)
        return data

    def _recv(self) -> bytes:
        """One ``recv`` as gevent's socket does it (wait for readability under the socket's
        timeout, same errors), without its per-wait ``Timeout`` and exception objects and
        its Python frames: a stream waits once per relayed token. TLS and unpatched sockets
        read through their own ``recv``."""
        sock = self.sock
        if type(sock) is not _GeventSocket:
            return sock.recv(READ_SIZE)
        raw = sock._sock
        while True:
            try:
                return raw.recv(READ_SIZE)
            except BlockingIOError:
                if sock.timeout == 0.0:
                    raise
            _wait_readable(sock)

    @property
    def complete(self) -> bool:
        return self.body_done and not self._pieces

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def release(self) -> None:
        """Once: the connection back to its pool, closed unless it can carry another request."""
        if self.released:
            return
        self.released = True
        conn = self.conn
        if not (self.keep_alive and self.complete):
            conn.close()
        self._pool._put_conn(conn)
        # The parser calls this answer's methods, so each holds the other; a stream's answer
        # lives long enough to reach the collector's oldest generation, whose full collections
        # took 100-240 ms of a worker under a flood: let reference counting free the two.
        self._parser = None


def _wait_readable(sock: Any) -> None:
    """gevent's wait on a socket's read watcher, its timeout a plain loop timer that throws
    ``socket.timeout`` (``TimeoutError``) as gevent's ``Timeout`` would."""
    watcher = sock._read_event
    timeout = sock.timeout
    if timeout is None or watcher.callback is not None:
        sock._wait(watcher)  # unbounded, or gevent's own error for a second reader
        return
    hub = sock.hub
    # As gevent's Timeout: below the watcher's priority (data that arrives with the timeout
    # is read), timed from now rather than from the loop's last turn.
    timer = hub.loop.timer(timeout, priority=-1)
    timer.start(gevent.getcurrent().throw, TimeoutError, "timed out", update=True)
    try:
        hub.wait(watcher)
    finally:
        timer.close()


def exchange(pool: Any, url: str, head: bytes, body: bytes | None, *,
             connect_timeout: float, read_timeout: float | None,
             lifecycle: Lifecycle) -> Response:
    """Write one request on a connection from ``pool`` and read its answer's head.

    A connection reused from the pool that turns out to be dead before a byte of the answer
    (the server closed it while it sat idle) gets the same request once more on a new
    connection: the server never read it, so it never ran. On failure the connection is
    closed and given back; the exception is urllib3's or http.client's for that event.
    """
    conn = pool._get_conn()
    try:
        reused = _ensure_connected(pool, conn, url, connect_timeout)
        try:
            return _round_trip(pool, conn, head, body, read_timeout)
        except STALE_ERRORS as exc:
            if not reused:
                raise _aborted(exc) from exc
            logger.info("upstream %s:%s closed a reused connection before answering (%s); "
                        "sending the request again on a new connection",
                        conn.host, conn.port, type(exc).__name__)
            lifecycle.replayed += 1
            conn.close()
            _ensure_connected(pool, conn, url, connect_timeout)
            try:
                return _round_trip(pool, conn, head, body, read_timeout)
            except STALE_ERRORS as again:
                raise _aborted(again) from again
    except TimeoutError as exc:
        conn.close()
        pool._put_conn(conn)
        raise ReadTimeoutError(pool, url,
                               f"Read timed out. (read timeout={read_timeout})") from exc
    except BaseException as exc:
        conn.close()
        pool._put_conn(conn)
        if isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
            raise SSLError(exc) from exc
        if isinstance(exc, (OSError, http.client.HTTPException)):
            raise _aborted(exc) from exc
        raise


def _aborted(exc: BaseException) -> Exception:
    if isinstance(exc, ssl.SSLError):
        return SSLError(exc)
    return ProtocolError("Connection aborted.", exc)


def _ensure_connected(pool: Any, conn: Any, url: str, connect_timeout: float) -> bool:
    """Whether ``conn`` already carried a request on its socket (else it is connected now)."""
    conn.timeout = connect_timeout  # also the bound on writing the request
    if conn.sock is not None and conn._uses > 0:
        return True
    if conn.sock is None:
        try:
            conn.connect()
        except TimeoutError as exc:  # a TLS handshake that stalls, as urllib3 reported it
            raise ReadTimeoutError(
                pool, url, f"Read timed out. (read timeout={connect_timeout})") from exc
    return False


def _round_trip(pool: Any, conn: Any, head: bytes, body: bytes | None,
                read_timeout: float | None) -> Response:
    sock = conn.sock
    sock.settimeout(conn.timeout)
    try:
        if body is None or len(head) + len(body) < COALESCE_BYTES:
            sock.sendall(head + body if body else head)
        else:
            sock.sendall(head)
            view = memoryview(body)
            for start in range(0, len(view), cooperate.LARGE_BYTES):
                sock.sendall(view[start:start + cooperate.LARGE_BYTES])
                cooperate.after_step(cooperate.LARGE_BYTES)
    except BrokenPipeError:
        pass  # the server may have answered and closed: the answer is still readable
    except TimeoutError as exc:  # the server stopped reading: not a late answer
        raise ProtocolError("Connection aborted.", exc) from exc
    except OSError as exc:
        if exc.errno not in (errno.EPROTOTYPE, errno.ECONNRESET):
            raise
    finally:
        conn._uses += 1
    if read_timeout is not None and read_timeout <= 0:
        raise TimeoutError("no time left to wait for the answer")
    sock.settimeout(read_timeout)
    resp = Response(pool, conn)
    resp.read_head()
    return resp
