"""The only place that talks HTTP to upstream instances.

One connection pool per instance and per worker (built after fork, in the worker): urllib3
keeps the sockets, ``http1.py`` writes each request and reads its answer with a C parser
(urllib3's ``urlopen`` and http.client cost ~4x more CPU per call; ``requests`` before them
cost two thirds of every call for features a proxy does not use). Explicit timeouts on every
call, TLS trust from ``tls.py``, connection lifecycle from ``pools.py``, and one mapping from
transport failures to the error taxonomy. Bodies are left unread so the relay can forward
bytes as they arrive.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util import parse_url

from epd_flask import __version__
from epd_flask.control import settings
from epd_flask.core import cooperate, jsoncodec
from epd_flask.core.errors import (
    AnswerTooLarge,
    BackendError,
    BackendStatus,
    BackendTimeout,
    BackendUnavailable,
    StreamInterrupted,
    instance_label,
)
from epd_flask.core.periodic import Periodic
from epd_flask.upstream import http1
from epd_flask.upstream.pools import (
    InterimError,
    Lifecycle,
    RetiringHTTPConnectionPool,
    RetiringHTTPSConnectionPool,
)
from epd_flask.upstream.tls import TLSConfigError, TLSFiles, TrustStore

logger = logging.getLogger(__name__)

DEFAULT_POOL_MAXSIZE: int = settings.default("EPD_POOL_MAXSIZE")
#: Distinct instances (pools) kept; beyond this the least recently used pool is closed.
POOL_COUNT = 256
DEFAULT_IDLE_TIMEOUT: float = settings.default("EPD_UPSTREAM_IDLE_TIMEOUT")
MAX_ERROR_BODY = 1 << 20
#: How often idle connections past their time are closed; never slower than a second.
MAX_SWEEP_INTERVAL = 1.0


class Upstream:
    """One upstream answer: status and headers now, the body read as it arrives.

    ``close()`` gives the connection back for reuse when the body was read to its end, and
    closes it otherwise (the instance may still be writing: an abandoned stream must stop).
    """

    __slots__ = ("content", "deadline", "headers", "raw", "status_code", "timeouts", "url")

    def __init__(self, raw: http1.Response, url: str,
                 timeouts: tuple[float | None, float | None],
                 deadline: Deadline | None = None) -> None:
        self.raw = raw
        self.status_code = raw.status
        self.headers = raw.headers
        self.url = url
        self.timeouts = timeouts
        self.deadline = deadline
        self.content: bytes | None = None

    @property
    def complete(self) -> bool:
        return self.raw.complete

    def close(self) -> None:
        self.raw.release()

    def abort(self) -> None:
        """Close the connection at once, whatever is left unread, so the instance stops the
        work. Nothing else, and nothing that may block: it runs in an event-loop callback.
        ``close`` still hands the pool back its slot."""
        self.raw.conn.close()

    def total_timeout(self, stage: str) -> BackendTimeout:
        """The error for this call's ``total_timeout`` having passed."""
        assert self.deadline is not None
        return _total_timeout(stage, self.url, self.deadline)


class Deadline:
    """A limit on a whole upstream call, status line and body together (``total_timeout``):
    each socket read may wait only what is left of it."""

    __slots__ = ("at", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def bound(self, timeout: float | None) -> tuple[float, bool]:
        """The wait one read may take given its own ``timeout`` (None: unbounded), and
        whether it is this deadline, not that timeout, which limits it."""
        left = self.left()
        if timeout is None or left <= timeout:
            return left, True
        return timeout, False


class Transport:
    def __init__(self, connect_timeout: float = settings.default("connect_timeout"),
                 pool_maxsize: int = DEFAULT_POOL_MAXSIZE,
                 *, idle_timeout: float = DEFAULT_IDLE_TIMEOUT, keepalive: bool = True,
                 tls: TLSFiles | None = None,
                 max_answer_bytes: int = settings.default("EPD_MAX_UPSTREAM_BODY_BYTES")) -> None:
        self.connect_timeout = connect_timeout
        # The most read from an answer the proxy consumes itself (prefill, encoders, probes)
        # rather than relays: each is held whole in memory and parsed.
        self.max_answer_bytes = max_answer_bytes
        self.pool_maxsize = pool_maxsize
        self.lifecycle = Lifecycle(idle_timeout=idle_timeout, keepalive=keepalive)
        # Loading the trust here makes a missing or broken bundle stop the worker's start.
        self.trust = TrustStore(tls or TLSFiles())
        self._tls_generation = self.trust.generation
        self._pools: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.headers = {"User-Agent": f"epd-flask/{__version__}",
                        "Accept-Encoding": "identity"}
        if not keepalive:
            # One connection per request, so a Kubernetes Service (which balances
            # connections, not requests) spreads requests over its pods.
            self.headers["Connection"] = "close"
        interval = min(MAX_SWEEP_INTERVAL, max(idle_timeout / 2, 0.05))
        self._sweeper = Periodic("idle connection sweep", self.sweep, lambda: interval)

    def start(self) -> None:
        """Close idle connections past their time in the background (frees their sockets;
        correctness does not depend on it: a stale connection is never handed out)."""
        self._sweeper.start()

    def sweep(self) -> int:
        return sum(pool.sweep() for pool in list(self._pools.values()))

    def _pool(self, url: str) -> tuple[Any, str]:
        """The pool for ``url``'s instance and the request target (path and query); the
        pool's ``host_header`` is what the requests to it say in ``Host``."""
        scheme, _, rest = url.partition("://")
        hostport, slash, path = rest.partition("/")
        context = None
        if scheme == "https":
            # One stat per request: a rotated bundle is used from the next request on, and
            # connections verified under the old trust are never reused.
            context = self.trust.current()
            if self.trust.generation != self._tls_generation:
                self._tls_generation = self.trust.generation
                self._close_pools()
        key = (scheme, hostport)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._new_pool(url, scheme, context)
            self._pools[key] = pool
            if len(self._pools) > POOL_COUNT:
                self._pools.popitem(last=False)[1].close()
        else:
            self._pools.move_to_end(key)
        return pool, "/" + path if slash else "/"

    def _new_pool(self, url: str, scheme: str, context: Any) -> Any:
        parts = parse_url(url)
        kw: dict[str, Any] = {"maxsize": self.pool_maxsize, "block": False,
                              "lifecycle": self.lifecycle}
        if scheme == "https":
            kw.update(ssl_context=context, cert_reqs="CERT_REQUIRED")
            pool = RetiringHTTPSConnectionPool(parts.host, parts.port, **kw)
        elif scheme == "http":
            pool = RetiringHTTPConnectionPool(parts.host, parts.port, **kw)
        else:
            raise urllib3.exceptions.LocationValueError(f"unsupported scheme {scheme!r}")
        # As http.client wrote it: brackets around an IPv6 address, no default port.
        host = (parts.host or "").rstrip(".")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        default = pool.ConnectionCls.default_port
        port = pool.port or default
        pool.host_header = host if port == default else f"{host}:{port}"
        return pool

    def send(
        self,
        method: str,
        url: str,
        *,
        stage: str,
        headers: dict[str, str],
        body: bytes | None = None,
        read_timeout: float | None,
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
        stream: bool = True,
    ) -> Upstream:
        """Open one upstream call; failures come back as taxonomy errors naming the stage.

        ``read_timeout`` bounds the wait for the answer's first byte (None: no bound);
        ``chunk_timeout`` (if given) then bounds each gap between body chunks while
        ``iter_raw`` relays it; ``total_timeout`` (if given) bounds the whole call, body
        included. With ``stream=False`` the body is read at once into ``content``.
        """
        deadline = Deadline(total_timeout) if total_timeout else None
        wait, by_deadline = (deadline.bound(read_timeout) if deadline is not None
                             else (read_timeout, False))
        try:
            pool, target = self._pool(url)
            head = http1.request_head(method, target, pool.host_header,
                                      {**self.headers, **headers}, body)
            raw = http1.exchange(pool, url, head, body,
                                 connect_timeout=self.connect_timeout, read_timeout=wait,
                                 lifecycle=self.lifecycle)
        except Exception as exc:
            if by_deadline and deadline is not None and isinstance(exc, ReadTimeoutError):
                raise _total_timeout(stage, url, deadline) from exc
            raise self._failure(exc, stage, url, read_timeout) from exc
        resp = Upstream(raw, url, (read_timeout, chunk_timeout), deadline)
        if not stream:
            resp.content = self.read_body(resp, stage, max_bytes=self.max_answer_bytes)
        return resp

    def _failure(self, exc: Exception, stage: str, url: str,
                 read_timeout: float | None) -> BackendError:
        origin = _origin(url)
        name = _name(stage, url)
        kw: dict[str, Any] = {"stage": stage, "instance": origin, "detail": _detail(exc)}
        if isinstance(exc, NewConnectionError):
            return BackendUnavailable(f"{name} is unreachable: {_reason(exc)}", **kw)
        if isinstance(exc, ConnectTimeoutError):
            return BackendUnavailable(
                f"{name} did not accept a connection within {self.connect_timeout:g} s", **kw)
        if isinstance(exc, ReadTimeoutError):
            return BackendTimeout(
                f"{name} did not answer within {read_timeout:g} s ({stage} timeout)", **kw)
        if isinstance(exc, TLSConfigError):
            return BackendUnavailable(
                f"{name} failed TLS verification: upstream TLS is not usable", **kw)
        if isinstance(exc, SSLError):
            return BackendUnavailable(
                f"{name} failed TLS verification: {_reason(exc)}", **kw)
        if isinstance(exc, InterimError):  # our own words: no address in them
            return BackendError(f"{name} {exc}", **kw)
        if isinstance(exc, (ProtocolError, OSError)):
            return BackendUnavailable(f"{name} is unreachable: {_reason(exc)}", **kw)
        if isinstance(exc, (HTTPError, http.client.HTTPException, ValueError)):
            return BackendError(f"{name} failed: {_reason(exc)}", **kw)
        raise exc

    def post_json(self, url: str, doc: dict[str, Any], **kw: Any) -> Upstream:
        headers = dict(kw.pop("headers"))
        headers["Content-Type"] = "application/json"
        return self.send("POST", url, headers=headers, body=encode_json(doc), **kw)

    def read_body(self, resp: Upstream, stage: str, limit: int | None = None, *,
                  max_bytes: int | None = None) -> bytes:
        """The whole body of a response, closing it; mid-body failures map like any other.

        ``limit``: keep at most this much and stop reading there (an error body shown to the
        client). ``max_bytes``: an answer longer than this fails the stage with
        ``AnswerTooLarge``; either way no more than that is ever held in memory.
        """
        if resp.content is not None:
            data = resp.content
            if max_bytes is not None and len(data) > max_bytes:
                raise self._too_large(resp, stage, max_bytes)
            return data[:limit] if limit is not None else data
        bound = limit if max_bytes is None else max_bytes
        pieces: list[bytes] = []
        held = 0
        try:
            for piece in self.iter_raw(resp, stage):
                pieces.append(piece)
                held += len(piece)
                if bound is not None and held > bound:
                    if max_bytes is not None:
                        raise self._too_large(resp, stage, max_bytes)
                    break
        finally:
            resp.close()
        data = b"".join(pieces)
        return data[:limit] if limit is not None else data

    @staticmethod
    def _too_large(resp: Upstream, stage: str, max_bytes: int) -> BackendError:
        return AnswerTooLarge(
            f"{_name(stage, resp.url)} answered more than {max_bytes} bytes "
            "(EPD_MAX_UPSTREAM_BODY_BYTES)", stage=stage, instance=_origin(resp.url))

    def raise_for_status(self, resp: Upstream, stage: str) -> None:
        """Turn an error status into ``BackendStatus`` carrying the upstream's own body, and
        a redirect into a failure of the stage: a client could not follow one to an
        instance's internal address, and its ``Location`` would reveal that address."""
        status = resp.status_code
        if status < 300:
            return
        if status < 400:
            resp.close()
            raise BackendError(f"{_name(stage, resp.url)} answered a redirect ({status})",
                               code="upstream_redirect", stage=stage,
                               instance=_origin(resp.url),
                               detail=f"Location: {resp.headers.get('Location', '')}"[:300])
        try:
            body = self.read_body(resp, stage, MAX_ERROR_BODY)
        except BackendError:
            body = b""
        raise BackendStatus(
            f"{_name(stage, resp.url)} answered {status}",
            upstream_status=status, body=body,
            content_type=resp.headers.get("Content-Type"), stage=stage,
            instance=_origin(resp.url),
        )

    def iter_raw(self, resp: Upstream, stage: str) -> Iterator[bytes]:
        """Body bytes as the upstream sent them (chunked framing removed): each piece is
        whatever one socket read brought, forwarded at once; several SSE events that arrived
        together travel on as one piece."""
        read_timeout, chunk_timeout = resp.timeouts
        deadline = resp.deadline
        by_deadline = False
        first = True
        try:
            if deadline is not None:
                wait, by_deadline = deadline.bound(read_timeout)
                resp.raw.settimeout(wait)
            # read1 returns what is already parsed, or what one recv brings; it never waits
            # for more than is there. Called here, not through a generator of its own: a
            # layer between the socket and the client costs a resumption per relayed piece.
            read1 = resp.raw.read1
            while piece := read1():
                if deadline is not None:
                    wait, by_deadline = deadline.bound(chunk_timeout)
                    resp.raw.settimeout(wait)
                elif first and chunk_timeout is not None:
                    resp.raw.settimeout(chunk_timeout)
                first = False
                yield piece
        except (ReadTimeoutError, TimeoutError) as exc:
            origin = _origin(resp.url)
            if by_deadline and deadline is not None:
                raise _total_timeout(stage, resp.url, deadline) from exc
            name = _name(stage, resp.url)
            if first:
                message = (f"{name} sent no data within {read_timeout:g} s ({stage} timeout)"
                           if read_timeout is not None else f"{name} stopped sending data")
            else:
                message = (f"{name} sent nothing for {chunk_timeout:g} s between chunks "
                           f"({stage} chunk timeout)"
                           if chunk_timeout is not None else f"{name} stopped sending data")
            raise BackendTimeout(message, stage=stage, instance=origin) from exc
        except (HTTPError, http.client.HTTPException, OSError) as exc:
            raise StreamInterrupted(
                f"{_name(stage, resp.url)} closed the connection mid-response",
                stage=stage, instance=_origin(resp.url), detail=_detail(exc)) from exc

    def _close_pools(self) -> None:
        while self._pools:
            self._pools.popitem()[1].close()

    def close(self) -> None:
        self._sweeper.stop()
        self._close_pools()


def _total_timeout(stage: str, url: str, deadline: Deadline) -> BackendTimeout:
    return BackendTimeout(f"{_name(stage, url)} did not finish within "
                          f"{deadline.seconds:g} s ({stage} total timeout)",
                          stage=stage, instance=_origin(url))


def encode_json(doc: Any) -> bytes:
    data = jsoncodec.dumps(doc)
    cooperate.after_step(len(data))
    return data


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _name(stage: str, url: str) -> str:
    """An instance as a client's error message names it: its stage and label, no address."""
    return f"{stage} instance {instance_label(_origin(url))}"


def _reason(exc: BaseException) -> str:
    """A failure's cause fit for a client: the operating system's or TLS's own words, never
    urllib3's rendering, which names the host and port."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return str(getattr(seen, "reason", None) or "TLS error")
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def _detail(exc: BaseException) -> str:
    """The whole story, for logs and /status."""
    return str(exc)[:300]
