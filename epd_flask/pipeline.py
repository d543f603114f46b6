"""One request's journey: route, prefill, open decode, hand the answer to the relay.

Everything that can fail before the client sees a status line happens here, so it can still be
retried (P4) or turned into a proper error response. Nothing here knows about Flask.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import requests

from epd_flask import relay
from epd_flask.connectors import Connector
from epd_flask.context import RequestContext
from epd_flask.encode_stage import EncodeStage
from epd_flask.errors import BackendError, BackendUnavailable, ProxyError
from epd_flask.fanout import Fanout
from epd_flask.headers import REQUEST_ID_HEADER, client_headers
from epd_flask.registry import Registry
from epd_flask.roster import Instance, Roster
from epd_flask.routing import Router
from epd_flask.transport import Transport, encode_json

logger = logging.getLogger(__name__)

STREAM_HEADERS = (("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"))


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: Iterable[bytes] | bytes


class Pipeline:
    def __init__(self, roster: Roster, registry: Registry, router: Router,
                 transport: Transport, connector: Connector) -> None:
        self.roster = roster
        self.registry = registry
        self.router = router
        self.transport = transport
        self.connector = connector
        self.encode = EncodeStage(router, registry, Fanout(transport, registry))

    @property
    def decode_role(self) -> str:
        return "prefill_decode" if self.roster.combined else "decode"

    def ready(self) -> tuple[bool, str]:
        """Can a completion be served right now? (readiness, not liveness)"""
        if self.roster.combined:
            if self.registry.live("prefill_decode"):
                return True, "ok"
            return False, "no live prefill_decode instance"
        if not self.registry.live("decode"):
            return False, "no live decode instance"
        if not self.registry.live("prefill"):
            return False, "no live prefill instance"
        return True, "ok"

    def completion(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Reply:
        """Serve /v1/completions or /v1/chat/completions, retrying before the first byte."""
        attempts = self.roster.settings.decode_retries + 1
        for attempt in range(attempts):
            try:
                return self._attempt(path, body, ctx)
            except ProxyError as err:
                if not err.retryable or attempt + 1 >= attempts:
                    raise
                ctx.retries += 1
                logger.warning("request %s: attempt %d failed (%s); retrying",
                               ctx.request_id, attempt + 1, err)
        raise AssertionError("unreachable")

    def passthrough(self, method: str, path: str, query: str, body: bytes | None,
                    content_type: str | None, ctx: RequestContext) -> Reply:
        """Any other route goes to a decode-side instance unchanged (T2)."""
        target = self.router.pick(self.decode_role)
        ctx.instances["decode"] = target.url
        headers = dict(ctx.upstream_headers)
        if content_type:
            headers["Content-Type"] = content_type
        url = target.url + path + (f"?{query}" if query else "")
        resp = self._send(target, "decode", method, url, ctx, headers=headers, body=body,
                          read_timeout=self.roster.settings.decode_timeout)
        return self._reply(resp, ctx, stream=True)

    def _attempt(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Reply:
        # Every attempt encodes again from the client's body (P4): the consumer is chosen
        # first because the encoders may have to push to it (R4).
        if self.roster.combined:
            target = self.router.pick("prefill_decode", exclude=frozenset(ctx.failed))
            staged = self.encode.run(body, ctx, target, self.roster.settings)
            return self._open_decode(target, path, staged.body, ctx, staged.consumer_headers)
        # Decode is chosen first: with no decode alive, prefill work would be wasted.
        decode = self.router.pick("decode", exclude=frozenset(ctx.failed))
        prefill = self.router.pick("prefill", exclude=frozenset(ctx.failed))
        body = self.encode.run(body, ctx, prefill, self.roster.settings).body
        answer = self._prefill(prefill, path, body, ctx)
        decode_body = self.connector.decode_body(body, answer, ctx.request_id)
        return self._open_decode(decode, path, decode_body, ctx)

    def _prefill(self, target: Instance, path: str, body: dict[str, Any],
                 ctx: RequestContext) -> dict[str, Any] | None:
        ctx.instances["prefill"] = target.url
        started = time.monotonic()
        resp = self._post(target, "prefill", path,
                          self.connector.prefill_body(body, ctx.request_id), ctx,
                          self.roster.settings.prefill_timeout)
        self._check(resp, target, "prefill", ctx)
        raw = self.transport.read_body(resp, "prefill")
        ctx.mark("prefill", started)
        try:
            answer = json.loads(raw)
        except ValueError:
            raise BackendError(f"prefill instance {target.url} answered non-JSON",
                               stage="prefill", instance=target.url) from None
        return answer if isinstance(answer, dict) else None

    def _open_decode(self, target: Instance, path: str, body: dict[str, Any],
                     ctx: RequestContext, extra_headers: dict[str, str] | None = None) -> Reply:
        ctx.instances["decode"] = target.url
        started = time.monotonic()
        resp = self._post(target, "decode", path, body, ctx,
                          self.roster.settings.decode_timeout, extra_headers)
        self._check(resp, target, "decode", ctx)
        ctx.mark("decode_first_byte", started)
        return self._reply(resp, ctx, stream=bool(body.get("stream")))

    def _reply(self, resp: requests.Response, ctx: RequestContext, stream: bool) -> Reply:
        ctx.status = resp.status_code
        headers = client_headers(resp.headers.items())
        headers.append((REQUEST_ID_HEADER, ctx.request_id))
        content_type = resp.headers.get("Content-Type", "")
        if content_type.startswith("text/event-stream"):
            headers.extend(STREAM_HEADERS)
            return Reply(resp.status_code, headers, relay.sse(self.transport, resp, ctx))
        if stream:
            return Reply(resp.status_code, headers, relay.raw(self.transport, resp, ctx))
        try:
            data = self.transport.read_body(resp, "decode")
        except BackendError as err:
            err.retryable = True  # nothing reached the client yet, so another try is safe
            raise
        ctx.bytes_out = len(data)
        ctx.finish(status=resp.status_code)
        return Reply(resp.status_code, headers, data)

    def _post(self, target: Instance, stage: str, path: str, body: dict[str, Any],
              ctx: RequestContext, read_timeout: float,
              extra_headers: dict[str, str] | None = None) -> requests.Response:
        headers = dict(ctx.upstream_headers)
        headers.update(extra_headers or {})
        headers["Content-Type"] = "application/json"
        return self._send(target, stage, "POST", target.url + path, ctx, headers=headers,
                          body=encode_json(body), read_timeout=read_timeout)

    def _send(self, target: Instance, stage: str, method: str, url: str,
              ctx: RequestContext, *, headers: dict[str, str], body: bytes | None,
              read_timeout: float) -> requests.Response:
        try:
            return self.transport.send(method, url, stage=stage, headers=headers, body=body,
                                       read_timeout=read_timeout)
        except BackendUnavailable as err:
            # Passive signal: a refused connection counts like a failed probe.
            self.registry.record_failure(target.url, str(err))
            ctx.failed.add(target.url)
            raise

    def _check(self, resp: requests.Response, target: Instance, stage: str,
               ctx: RequestContext) -> None:
        try:
            self.transport.raise_for_status(resp, stage)
        except ProxyError as err:
            if err.retryable:
                ctx.failed.add(target.url)
            raise
