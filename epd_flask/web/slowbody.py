"""How long a client may take to send its request body (``EPD_BODY_TIMEOUT``), and the moment
the body has arrived (from then on the request counts against the in-flight cap,
web/inflight.py).

A client that trickles its body a byte every few seconds holds its connection for as long as
it likes. The WSGI input is wrapped so that all reads of one body together end by a deadline
counted from the moment the request's head was parsed; past it the read fails with 408
(OpenAI's shape) and the connection is closed (its rest is never read). A worker already
receiving as many bodies as its cap gives a new one ``BUSY_BODY_SECONDS`` and answers 503
``overloaded`` past that. The head itself is bounded in the gunicorn worker
(``web/worker.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent

from epd_flask.core.errors import ProxyError, RequestTimeout
from epd_flask.web.inflight import (
    BODY_ARRIVAL,
    BUSY_BODY_SECONDS,
    BodyArrival,
    connection_of,
    end_reads,
)


class TimedInput:
    """``wsgi.input`` whose reads must all end by one deadline, and which tells ``arrival``
    when the body's last byte (``length`` of them, or the end of a chunked one) is read."""

    def __init__(self, stream: Any, seconds: float,
                 expired: Callable[[], None] = lambda: None, length: int | None = None,
                 arrival: BodyArrival | None = None) -> None:
        self._stream = stream
        self._deadline = time.monotonic() + seconds
        self._expired = expired
        self._left = length
        self._arrival = arrival
        self._seconds = seconds

    def _timed(self, read: Callable[..., Any], *args: Any) -> Any:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._timeout()
        timer = gevent.Timeout(left)
        timer.start()
        try:
            data = read(*args)
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            raise self._timeout() from None
        finally:
            timer.close()
        if self._arrival is not None:
            self._count(data)
        return data

    def _count(self, data: Any) -> None:
        got = sum(map(len, data)) if isinstance(data, list) else len(data)
        if self._left is not None:
            self._left -= got
        if got == 0 or (self._left is not None and self._left <= 0):
            arrival, self._arrival = self._arrival, None
            assert arrival is not None
            arrival.arrived()

    def _timeout(self) -> ProxyError:
        self._expired()
        arrival, self._arrival = self._arrival, None
        if arrival is not None and arrival.busy:
            return arrival.too_slow(self._seconds)
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
    """Give this request's body ``seconds`` to arrive (less on a worker receiving many)."""
    stream = environ.get("wsgi.input")
    if stream is None:
        return
    arrival: BodyArrival | None = environ.get(BODY_ARRIVAL)
    if arrival is not None and arrival.busy:
        seconds = min(seconds, BUSY_BODY_SECONDS)
    sock = connection_of(environ)
    # Past the deadline the server's next read sees EOF, so it closes the connection
    # instead of reading the rest of a body that is not coming (gunicorn ignores a
    # ``Connection: close`` from the application); the 408 is still written.
    environ["wsgi.input"] = TimedInput(stream, seconds,
                                       (lambda: end_reads(sock)) if sock is not None
                                       else lambda: None,
                                       _length(environ), arrival)


def _length(environ: dict[str, Any]) -> int | None:
    try:
        return int(environ.get("CONTENT_LENGTH") or "")
    except ValueError:
        return None


class BodyDeadline:
    """WSGI middleware: every request's body gets ``seconds`` to arrive."""

    def __init__(self, app: Callable[..., Any], seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        bound_body(environ, self.seconds)
        return self.app(environ, start_response)
