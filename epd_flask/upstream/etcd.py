"""A small client of etcd v3's JSON gateway (``/v3/...``): ranges, puts, deletes, leases and
watch streams, over urllib3 (docs/behaviour.md#discovery).

Why not a library: etcd3gw (the gateway client) runs its watch in a thread pool and ends it
silently when the connection drops (measured: after etcd restarts the watcher never fires
again and its caller is not told), and brings pbr, futurist and requests at run time; the
grpc clients need grpcio (~20 MB) made cooperative under gevent, and ``etcd3`` no longer
imports with a current protobuf. Here a watch is an iterator whose end or error *is* the
news, so the caller re-reads and re-watches. Works the same with or without gevent (the
``epd-flask register`` process runs without).

Keys and values travel base64-encoded and 64-bit numbers as JSON strings, as the gateway
speaks them. Several endpoints: the one that last answered is tried first.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import gevent.queue
import urllib3
from urllib3.exceptions import HTTPError

logger = logging.getLogger(__name__)

#: Seconds to connect to an endpoint and for a unary call's answer.
TIMEOUT = 2.0
#: Keys read per page of a range: a large fleet is read in pages at one revision.
PAGE = 500
API = "/v3"
#: The longest line a watch may send (one revision's events): more is not an answer we read.
MAX_WATCH_LINE = 16 * 1024 * 1024


class EtcdError(Exception):
    """etcd did not answer, or answered something other than what was asked."""


class Compacted(EtcdError):
    """A watch's start revision was compacted away: read the whole prefix again."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted (oldest kept: {revision})")
        self.revision = revision


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Event:
    kind: str  # "put" or "delete"
    key: str
    value: bytes
    revision: int


def prefix_end(prefix: str) -> bytes:
    """The end of the range of keys that start with ``prefix`` (etcd's ``range_end``)."""
    raw = prefix.encode()
    while raw and raw[-1] == 0xff:
        raw = raw[:-1]
    return raw[:-1] + bytes([raw[-1] + 1]) if raw else b"\0"


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


class _Pool(urllib3.HTTPConnectionPool):
    # gevent's queue: urllib3's stdlib one can deadlock a gevent worker (see upstream/pools.py).
    QueueCls = gevent.queue.LifoQueue


class _TLSPool(urllib3.HTTPSConnectionPool):
    QueueCls = gevent.queue.LifoQueue


class Watch:
    """One watch stream: iterate for batches of events (one per revision etcd sends);
    ``close()`` from anywhere ends the iteration. ``endpoint`` is the one it streams from."""

    def __init__(self, response: Any, endpoint: str) -> None:
        self._response = response
        self.endpoint = endpoint
        self.closed = False
        self._reading = False

    def __iter__(self) -> Iterator[list[Event]]:
        buffer = b""
        self._reading = True
        try:
            for chunk in self._response.stream(None):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        events = self._parse(line)
                        if events:
                            yield events
                if len(buffer) > MAX_WATCH_LINE:
                    raise EtcdError(f"watch sent a line longer than {MAX_WATCH_LINE} bytes")
        except (HTTPError, OSError) as exc:
            if not self.closed:
                self.close()
                raise EtcdError(f"watch stream broke: {exc}") from None
        except BaseException:
            # A refusal in the stream (compacted, canceled, garbage) or the consumer leaving:
            # the connection, and etcd's watcher behind it, go now, not when collected.
            self.close()
            raise
        finally:
            self._reading = False
            if self.closed:  # closed from elsewhere while this read: release it here
                self._release()
        if not self.closed:
            self.close()
            raise EtcdError("watch stream ended")

    @staticmethod
    def _parse(line: bytes) -> list[Event]:
        try:
            doc = json.loads(line)
        except ValueError:
            raise EtcdError(f"watch sent something other than JSON: {line[:80]!r}") from None
        if "error" in doc:
            raise EtcdError(f"watch failed: {doc['error'].get('message', doc['error'])}")
        result = doc.get("result") or {}
        if int(result.get("compact_revision") or 0):
            raise Compacted(int(result["compact_revision"]))
        if result.get("created"):
            return []
        if result.get("canceled"):
            raise EtcdError(f"watch canceled: {result.get('cancel_reason') or 'no reason'}")
        return [Event("delete" if e.get("type") == "DELETE" else "put",
                      _unb64(e["kv"]["key"]).decode("utf-8", "replace"),
                      _unb64(e["kv"].get("value")), int(e["kv"].get("mod_revision") or 0))
                for e in result.get("events") or ()]

    def close(self) -> None:
        """Cut the stream; a greenlet or thread reading it sees the iteration end."""
        if self.closed:
            return
        self.closed = True
        # shutdown() wakes a reader blocked on the socket; urllib3 refuses it once the
        # stream ended by itself (the connection went back to the pool).
        with contextlib.suppress(OSError, RuntimeError):
            self._response.shutdown()
        if not self._reading:  # a reader inside the stream closes it itself when it wakes
            self._release()

    def _release(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self._response.release_conn()
            self._response.close()


class EtcdClient:
    def __init__(self, endpoints: Sequence[str], timeout: float = TIMEOUT) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._pools: dict[str, urllib3.HTTPConnectionPool] = {}

    # -- unary calls ---------------------------------------------------------------------

    def range_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` at one revision: (that revision, the keys)."""
        start, end = prefix.encode(), prefix_end(prefix)
        revision = 0
        found: list[KeyValue] = []
        while True:
            body: dict[str, Any] = {"key": _b64(start), "range_end": _b64(end), "limit": PAGE}
            if revision:
                body["revision"] = revision
            doc = self.call("/kv/range", body)
            revision = revision or int(doc["header"]["revision"])
            kvs = doc.get("kvs") or []
            found += [KeyValue(_unb64(kv["key"]).decode("utf-8", "replace"),
                               _unb64(kv.get("value")), int(kv.get("mod_revision") or 0),
                               int(kv.get("lease") or 0)) for kv in kvs]
            if not doc.get("more") or not kvs:
                return revision, found
            start = _unb64(kvs[-1]["key"]) + b"\0"

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/kv/put", body)["header"]["revision"])

    def delete(self, key: str) -> tuple[int, int]:
        """How many keys went (0 or 1), and the revision after."""
        doc = self.call("/kv/deleterange", {"key": _b64(key)})
        return int(doc.get("deleted") or 0), int(doc["header"]["revision"])

    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("/kv/range", {"key": _b64(key)}).get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return KeyValue(key, _unb64(kv.get("value")), int(kv.get("mod_revision") or 0),
                        int(kv.get("lease") or 0))

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return int(self.call("/lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew the lease; its TTL, 0 when etcd no longer has it (expired or revoked)."""
        result = self.call("/lease/keepalive", {"ID": str(lease)}).get("result") or {}
        return int(result.get("TTL") or 0)

    def revoke(self, lease: int) -> None:
        """Drop the lease and every key put under it."""
        try:
            self.call("/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    def ping(self, endpoint: str | None = None) -> int:
        """A cheap read that proves an endpoint answers (``endpoint`` itself when given: a
        watch's, which another endpoint answering proves nothing about); its revision."""
        doc = self.call("/kv/range", {"key": _b64("\0"), "count_only": True}, only=endpoint)
        return int(doc["header"]["revision"])

    def watch(self, prefix: str, start_revision: int) -> Watch:
        """Every change under ``prefix`` from ``start_revision`` on."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        return Watch(*self._send("/watch", body, stream=True))

    def call(self, path: str, body: dict[str, Any], only: str | None = None) -> dict[str, Any]:
        response, _ = self._send(path, body, stream=False, only=only)
        try:
            doc = json.loads(response.data)
        except ValueError:
            raise EtcdError(f"{path}: answer is not JSON (HTTP {response.status})") from None
        if response.status != 200 or "error" in doc or "code" in doc:
            message = doc.get("message") or doc.get("error") or f"HTTP {response.status}"
            raise EtcdError(f"{path}: {message}")
        return doc  # type: ignore[no-any-return]

    def _send(self, path: str, body: dict[str, Any], stream: bool,
              only: str | None = None) -> tuple[Any, str]:
        """POST to the first endpoint that answers, starting with the last that did (or to
        ``only``); the answer and the endpoint that gave it."""
        payload = json.dumps(body).encode()
        failures = []
        for endpoint in [only] if only is not None else list(self.endpoints):
            pool = self._pool(endpoint)
            try:
                response = pool.urlopen(
                    "POST", API + path, body=payload,
                    headers={"Content-Type": "application/json"},
                    timeout=urllib3.Timeout(connect=self.timeout,
                                            read=None if stream else self.timeout),
                    retries=False, preload_content=not stream, release_conn=not stream)
            except (HTTPError, OSError) as exc:
                failures.append(f"{endpoint}: {exc}")
                continue
            if response.status >= 500 and len(self.endpoints) > 1 and only is None:
                failures.append(f"{endpoint}: HTTP {response.status}")
                if stream:
                    response.release_conn()
                continue
            if only is None and endpoint != self.endpoints[0]:
                self.endpoints.remove(endpoint)
                self.endpoints.insert(0, endpoint)
            return response, endpoint
        raise EtcdError("no etcd endpoint answered: " + "; ".join(failures))

    def demote(self, endpoint: str) -> None:
        """Try ``endpoint`` last from now on (it stopped answering)."""
        if endpoint in self.endpoints and len(self.endpoints) > 1:
            self.endpoints.remove(endpoint)
            self.endpoints.append(endpoint)

    def _pool(self, endpoint: str) -> urllib3.HTTPConnectionPool:
        pool = self._pools.get(endpoint)
        if pool is None:
            parts = urlsplit(endpoint)
            cls = _TLSPool if parts.scheme == "https" else _Pool
            pool = self._pools[endpoint] = cls(parts.hostname, parts.port, maxsize=4)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
