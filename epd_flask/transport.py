"""The only place that talks HTTP to upstream instances.

One pooled ``requests.Session`` per worker (built after fork, in the worker), explicit
timeouts on every call, TLS trust from ``tls.py``, connection lifecycle from ``pools.py``,
and one mapping from transport failures to the error taxonomy. Responses are left unread
(``stream=True``) so the relay can forward bytes as they arrive.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import gevent
import requests
import urllib3
from requests.adapters import HTTPAdapter

from epd_flask import __version__, cooperate, jsoncodec
from epd_flask.errors import (
    BackendError,
    BackendStatus,
    BackendTimeout,
    BackendUnavailable,
    StreamInterrupted,
)
from epd_flask.pools import Lifecycle, RetiringHTTPConnectionPool, RetiringHTTPSConnectionPool
from epd_flask.tls import TLSConfigError, TLSFiles, TrustStore

logger = logging.getLogger(__name__)

DEFAULT_POOL_MAXSIZE = 1024
#: Distinct instances (pools) kept; beyond this the least recently used pool is closed.
POOL_COUNT = 256
DEFAULT_IDLE_TIMEOUT = 4.0
RELAY_READ_SIZE = 65536
MAX_ERROR_BODY = 1 << 20
#: How often idle connections past their time are closed; never slower than a second.
MAX_SWEEP_INTERVAL = 1.0


class _Adapter(HTTPAdapter):
    """requests' adapter with our pools, and TLS trust taken from the ``TrustStore``.

    requests would otherwise point urllib3 at certifi's bundle (``cert_verify``), which
    urllib3 *adds* to any context it is given: "trust exactly the configured bundle" means
    the pool key carries our context and nothing else.
    """

    def __init__(self, lifecycle: Lifecycle, trust: TrustStore, pool_maxsize: int) -> None:
        self.lifecycle = lifecycle
        self.trust = trust
        self._tls_generation = trust.generation
        # pool_block=False: a burst beyond the pool opens extra connections instead of
        # queueing greenlets behind the pool's queue.
        super().__init__(pool_connections=POOL_COUNT, pool_maxsize=pool_maxsize,
                         pool_block=False, max_retries=0)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False,
                         **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": functools.partial(RetiringHTTPConnectionPool, lifecycle=self.lifecycle),
            "https": functools.partial(RetiringHTTPSConnectionPool, lifecycle=self.lifecycle),
        }

    def build_connection_pool_key_attributes(self, request: Any, verify: Any,
                                             cert: Any = None) -> tuple[dict, dict]:
        host_params, _ = super().build_connection_pool_key_attributes(request, verify, cert)
        if host_params["scheme"] != "https":
            return host_params, {}
        try:
            context = self.trust.current()
        except TLSConfigError as exc:
            raise requests.exceptions.SSLError(f"upstream TLS is not usable: {exc}") from exc
        if self.trust.generation != self._tls_generation:
            # Connections verified under the old trust must not be reused after a rotation.
            self._tls_generation = self.trust.generation
            self.poolmanager.clear()
        return host_params, {"ssl_context": context, "cert_reqs": "CERT_REQUIRED"}

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        if url.lower().startswith("https"):
            conn.cert_reqs = "CERT_REQUIRED"
        conn.ca_certs = None
        conn.ca_cert_dir = None


class Transport:
    def __init__(self, connect_timeout: float = 3.0, pool_maxsize: int = DEFAULT_POOL_MAXSIZE,
                 *, idle_timeout: float = DEFAULT_IDLE_TIMEOUT, keepalive: bool = True,
                 tls: TLSFiles | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.lifecycle = Lifecycle(idle_timeout=idle_timeout, keepalive=keepalive)
        # Loading the trust here makes a missing or broken bundle stop the worker's start.
        self.trust = TrustStore(tls or TLSFiles())
        self.adapter = _Adapter(self.lifecycle, self.trust, pool_maxsize)
        self.session = requests.Session()
        self.session.mount("http://", self.adapter)
        self.session.mount("https://", self.adapter)
        self.session.headers.clear()
        self.session.headers.update({
            "User-Agent": f"epd-flask/{__version__}",
            "Accept-Encoding": "identity",
        })
        if not keepalive:
            # One connection per request, so a Kubernetes Service (which balances
            # connections, not requests) spreads requests over its pods.
            self.session.headers["Connection"] = "close"
        self.session.trust_env = False
        self._sweeper: gevent.Greenlet | None = None

    def start(self) -> None:
        """Close idle connections past their time in the background (frees their sockets;
        correctness does not depend on it: a stale connection is never handed out)."""
        if self._sweeper is None or self._sweeper.dead:
            self._sweeper = gevent.spawn(self._sweep_forever)

    def sweep(self) -> int:
        pools = self.adapter.poolmanager.pools
        closed = 0
        for key in list(pools.keys()):
            pool = pools.get(key)
            if pool is not None and hasattr(pool, "sweep"):
                closed += pool.sweep()
        return closed

    def _sweep_forever(self) -> None:
        interval = min(MAX_SWEEP_INTERVAL, max(self.lifecycle.idle_timeout / 2, 0.05))
        while True:
            gevent.sleep(interval)
            try:
                self.sweep()
            except Exception:  # the loop must outlive any one bad round
                logger.exception("idle connection sweep failed")

    def send(
        self,
        method: str,
        url: str,
        *,
        stage: str,
        headers: dict[str, str],
        body: bytes | None = None,
        read_timeout: float,
        chunk_timeout: float | None = None,
        stream: bool = True,
    ) -> requests.Response:
        """Open one upstream call; failures come back as taxonomy errors naming the stage.

        ``read_timeout`` bounds the wait for the answer's first byte; ``chunk_timeout`` (if
        given) then bounds each gap between body chunks while ``iter_raw`` relays it.
        """
        origin = _origin(url)
        try:
            resp = self.session.request(
                method, url, data=body, headers=headers, stream=stream, allow_redirects=False,
                timeout=(self.connect_timeout, read_timeout),
            )
        except requests.ConnectTimeout as exc:
            raise BackendUnavailable(
                f"{stage} instance {origin} did not accept a connection within "
                f"{self.connect_timeout:g} s", stage=stage, instance=origin) from exc
        except requests.ReadTimeout as exc:
            raise BackendTimeout(
                f"{stage} instance {origin} did not answer within {read_timeout:g} s "
                f"({stage} timeout)", stage=stage, instance=origin) from exc
        except requests.exceptions.SSLError as exc:
            raise BackendUnavailable(
                f"{stage} instance {origin} failed TLS verification: {_reason(exc)}",
                stage=stage, instance=origin) from exc
        except requests.ConnectionError as exc:
            raise BackendUnavailable(
                f"{stage} instance {origin} is unreachable: {_reason(exc)}",
                stage=stage, instance=origin) from exc
        except requests.RequestException as exc:
            raise BackendError(f"{stage} instance {origin} failed: {_reason(exc)}",
                               stage=stage, instance=origin) from exc
        resp.epd_timeouts = (read_timeout, chunk_timeout)  # type: ignore[attr-defined]
        return resp

    def post_json(self, url: str, doc: dict[str, Any], **kw: Any) -> requests.Response:
        headers = dict(kw.pop("headers"))
        headers["Content-Type"] = "application/json"
        return self.send("POST", url, headers=headers, body=encode_json(doc), **kw)

    def read_body(self, resp: requests.Response, stage: str, limit: int | None = None) -> bytes:
        """The whole body of a response, closing it; mid-body failures map like any other."""
        try:
            data = b"".join(self.iter_raw(resp, stage))
        finally:
            resp.close()
        return data[:limit] if limit is not None else data

    def raise_for_status(self, resp: requests.Response, stage: str) -> None:
        """Turn an error status into ``BackendStatus`` carrying the upstream's own body."""
        if resp.status_code < 400:
            return
        try:
            body = self.read_body(resp, stage, MAX_ERROR_BODY)
        except BackendError:
            body = b""
        raise BackendStatus(
            f"{stage} instance {_origin(resp.url)} answered {resp.status_code}",
            upstream_status=resp.status_code, body=body,
            content_type=resp.headers.get("Content-Type"), stage=stage,
            instance=_origin(resp.url),
        )

    def iter_raw(self, resp: requests.Response, stage: str) -> Iterator[bytes]:
        """Body bytes exactly as the upstream sent them, each as soon as it arrives."""
        raw = resp.raw
        read_timeout, chunk_timeout = getattr(resp, "epd_timeouts", (None, None))
        first = True
        try:
            for chunk in _chunks(raw):
                if first and chunk_timeout is not None:
                    _set_read_timeout(raw, chunk_timeout)
                first = False
                yield chunk
        except (urllib3.exceptions.ReadTimeoutError, TimeoutError) as exc:
            origin = _origin(resp.url)
            if first:
                message = (f"{stage} instance {origin} sent no data within "
                           f"{read_timeout:g} s ({stage} timeout)"
                           if read_timeout is not None else
                           f"{stage} instance {origin} stopped sending data")
            else:
                message = (f"{stage} instance {origin} sent nothing for {chunk_timeout:g} s "
                           f"between chunks ({stage} chunk timeout)"
                           if chunk_timeout is not None else
                           f"{stage} instance {origin} stopped sending data")
            raise BackendTimeout(message, stage=stage, instance=origin) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StreamInterrupted(
                f"{stage} instance {_origin(resp.url)} closed the connection mid-response",
                stage=stage, instance=_origin(resp.url)) from exc

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.kill(block=False)
            self._sweeper = None
        self.session.close()


def _chunks(raw: Any) -> Iterator[bytes]:
    if raw.chunked and raw.supports_chunked_reads():
        for chunk in raw.read_chunked(None, decode_content=False):
            if chunk:
                yield chunk
    else:
        while True:
            chunk = raw.read1(RELAY_READ_SIZE, decode_content=False)
            if not chunk:
                break
            yield chunk


def _set_read_timeout(raw: Any, seconds: float) -> None:
    """From now on each socket read of this response may wait ``seconds``."""
    conn = getattr(raw, "connection", None)
    sock = getattr(conn, "sock", None)
    if sock is not None:
        sock.settimeout(seconds)


def encode_json(doc: Any) -> bytes:
    data = jsoncodec.dumps(doc)
    cooperate.after_step(len(data))
    return data


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _reason(exc: BaseException) -> str:
    return str(exc)[:300]
