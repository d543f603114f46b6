"""How long a client may take to send its request body (``EPD_BODY_TIMEOUT``).

A client that trickles its body a byte every few seconds holds an in-flight slot for as long
as it likes: enough of them and every completion gets 503 ``overloaded``. The WSGI input is
wrapped so that all reads of one body together end by a deadline counted from the moment the
request's head was parsed; past it the read fails with 408 (OpenAI's shape) and the
connection is closed (its rest is never read). The head itself is bounded in the gunicorn
worker (``web/worker.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent

from epd_flask.core.errors import RequestTimeout
from epd_flask.web.inflight import connection_of, end_reads


class TimedInput:
    """``wsgi.input`` whose reads must all end by one deadline."""

    def __init__(self, stream: Any, seconds: float,
                 expired: Callable[[], None] = lambda: None) -> None:
        self._stream = stream
        self._seconds = seconds
        self._deadline = time.monotonic() + seconds
        self._expired = expired

    def _timed(self, read: Callable[..., Any], *args: Any) -> Any:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._timeout()
        timer = gevent.Timeout(left)
        timer.start()
        try:
            return read(*args)
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            raise self._timeout() from None
        finally:
            timer.close()

    def _timeout(self) -> RequestTimeout:
        self._expired()
        return RequestTimeout(f"the request body did not arrive within {self._seconds:g} s "
                              "(EPD_BODY_TIMEOUT)")

    def read(self, *args: Any) -> bytes:
        return self._timed(self._stream.read, *args)

    def readline(self, *args: Any) -> bytes:
        return self._timed(self._stream.readline, *args)

    def readlines(self, *args: Any) -> list[bytes]:
        return self._timed(self._stream.readlines, *args)

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line


def bound_body(environ: dict[str, Any], seconds: float) -> None:
    """Give this request's body ``seconds`` to arrive."""
    stream = environ.get("wsgi.input")
    if stream is None:
        return
    sock = connection_of(environ)
    # Past the deadline the server's next read sees EOF, so it closes the connection
    # instead of reading the rest of a body that is not coming (gunicorn ignores a
    # ``Connection: close`` from the application); the 408 is still written.
    environ["wsgi.input"] = TimedInput(stream, seconds,
                                       (lambda: end_reads(sock)) if sock is not None
                                       else lambda: None)


class BodyDeadline:
    """WSGI middleware: every request's body gets ``seconds`` to arrive."""

    def __init__(self, app: Callable[..., Any], seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        bound_body(environ, self.seconds)
        return self.app(environ, start_response)
