"""The only place that talks HTTP to upstream instances.

One pooled ``requests.Session`` per worker (built after fork, in the worker), explicit
timeouts on every call, and one mapping from transport failures to the error taxonomy.
Responses are left unread (``stream=True``) so the relay can forward bytes as they arrive.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

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

logger = logging.getLogger(__name__)

DEFAULT_POOL_MAXSIZE = 1024
RELAY_READ_SIZE = 65536
MAX_ERROR_BODY = 1 << 20


class Transport:
    def __init__(self, connect_timeout: float = 3.0, pool_maxsize: int = DEFAULT_POOL_MAXSIZE):
        self.connect_timeout = connect_timeout
        self.session = requests.Session()
        # pool_block=False: a burst beyond the pool opens extra connections instead of queueing
        # greenlets on urllib3's pool queue (see urllib3#3289 / gevent#1957 for what blocks).
        adapter = HTTPAdapter(
            pool_connections=64, pool_maxsize=pool_maxsize, pool_block=False, max_retries=0
        )
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers.clear()
        self.session.headers.update({
            "User-Agent": f"epd-flask/{__version__}",
            "Accept-Encoding": "identity",
        })
        self.session.trust_env = False

    def send(
        self,
        method: str,
        url: str,
        *,
        stage: str,
        headers: dict[str, str],
        body: bytes | None = None,
        read_timeout: float,
        stream: bool = True,
    ) -> requests.Response:
        """Open one upstream call; failures come back as taxonomy errors naming the stage."""
        try:
            return self.session.request(
                method, url, data=body, headers=headers, stream=stream, allow_redirects=False,
                timeout=(self.connect_timeout, read_timeout),
            )
        except requests.ConnectTimeout as exc:
            raise BackendUnavailable(
                f"{stage} instance {_origin(url)} did not accept a connection in time",
                stage=stage, instance=_origin(url)) from exc
        except requests.ReadTimeout as exc:
            raise BackendTimeout(
                f"{stage} instance {_origin(url)} did not answer within {read_timeout:g} s",
                stage=stage, instance=_origin(url)) from exc
        except requests.ConnectionError as exc:
            raise BackendUnavailable(
                f"{stage} instance {_origin(url)} is unreachable: {_reason(exc)}",
                stage=stage, instance=_origin(url)) from exc
        except requests.RequestException as exc:
            raise BackendError(f"{stage} instance {_origin(url)} failed: {_reason(exc)}",
                               stage=stage, instance=_origin(url)) from exc

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
        try:
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
        except (urllib3.exceptions.ReadTimeoutError, TimeoutError) as exc:
            raise BackendTimeout(f"{stage} instance {_origin(resp.url)} stopped sending data",
                                 stage=stage, instance=_origin(resp.url)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StreamInterrupted(
                f"{stage} instance {_origin(resp.url)} closed the connection mid-response",
                stage=stage, instance=_origin(resp.url)) from exc

    def close(self) -> None:
        self.session.close()


def encode_json(doc: Any) -> bytes:
    data = jsoncodec.dumps(doc)
    cooperate.after_step(len(data))
    return data


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _reason(exc: BaseException) -> str:
    return str(exc)[:300]
