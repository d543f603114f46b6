"""One request's journey: route, prefill, open decode, hand the answer to the relay.

Everything that can fail before the client sees a status line happens here, so it can still be
retried (docs/behaviour.md#failover) or turned into a proper error response. Nothing here
knows about Flask. The connector shapes the legs and says how they run: prefill drained before
decode opens (``_sequential_legs``), or both at once (``_concurrent_legs``, Mooncake).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote

from epd_flask.control.roster import Instance, Roster
from epd_flask.control.settings import default
from epd_flask.core import events, jsoncodec
from epd_flask.core.errors import (
    BackendError,
    BackendStatus,
    BackendUnavailable,
    ClientDisconnected,
    ProxyError,
    StreamInterrupted,
    instance_label,
)
from epd_flask.core.headers import REQUEST_ID_HEADER, client_headers
from epd_flask.fleet import routing
from epd_flask.fleet.affinity import request_affinity
from epd_flask.fleet.models import Catalog
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.routing import Router
from epd_flask.serving import fields, legs, relay, usage
from epd_flask.serving.connectors import Connector, LegRequest, Placement, Route
from epd_flask.serving.context import RequestContext
from epd_flask.serving.encode_stage import EncodeStage
from epd_flask.serving.fanout import Fanout
from epd_flask.serving.legs import Call
from epd_flask.upstream.transport import Transport, Upstream, encode_json

logger = logging.getLogger(__name__)

#: Characters a path segment may carry unencoded (RFC 3986 pchar and "/").
PATH_SAFE = "/:@!$&'()*+,;="


def upstream_path(path: str) -> str:
    """The client's path as it was decoded for routing, encoded again for the request line:
    a ``%3F`` the client sent stays a character of the path, not the start of a query, and
    a ``%0D%0A`` stays out of the request line."""
    return quote(path, safe=PATH_SAFE)


#: Connectors whose decode computes a prompt it got no KV for: short prompts may skip prefill.
DIRECT_DECODE_CONNECTORS = ("nixl", "none")
STREAM_HEADERS = (("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"))
#: How often a request waiting on concurrent legs asks whether its client is still there.
CLIENT_CHECK_INTERVAL = 0.1


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: Iterable[bytes] | bytes


class Pipeline:
    def __init__(self, roster: Roster, registry: Registry, router: Router,
                 transport: Transport, connector: Connector,
                 max_event_bytes: int = default("EPD_MAX_EVENT_BYTES")) -> None:
        self.roster = roster
        self.max_event_bytes = max_event_bytes
        self.registry = registry
        self.router = router
        self.transport = transport
        self.connector = connector
        # Per-worker tallies of what went wrong beside the client's view (shown on /health).
        self.counters: Counter[str] = Counter()
        self.encode = EncodeStage(router, registry, Fanout(transport, registry, self.counters))
        self.catalog = Catalog(registry, lambda: self.decode_role)

    @property
    def decode_role(self) -> str:
        return "prefill_decode" if self.roster.combined else "decode"

    def ready(self) -> tuple[bool, str]:
        """Can a completion be served right now? (readiness, not liveness: it counts only
        instances that answered a probe, so a fresh worker is ready after its first round)"""
        if self.roster.combined:
            if self.registry.confirmed("prefill_decode"):
                return True, "ok"
            return False, "no live prefill_decode instance"
        if not self.registry.confirmed("decode"):
            return False, "no live decode instance"
        if not self.registry.confirmed("prefill"):
            return False, "no live prefill instance"
        return self.connector.ready()

    def completion(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Reply:
        """Serve /v1/completions or /v1/chat/completions, retrying before the first byte."""
        # Every stage is picked among instances serving the model (docs/behaviour.md#models);
        # the body goes upstream as the client wrote it, model absent or not.
        ctx.model = self.catalog.resolve(body.get("model"))
        attempts = self.roster.settings.decode_retries + 1
        ctx.on_leg = self.registry.track
        affinity = request_affinity(body)
        affinity.decisions = ctx.routing
        with routing.serving(affinity):
            return self._attempts(path, body, ctx, attempts)

    def _attempts(self, path: str, body: dict[str, Any], ctx: RequestContext,
                  attempts: int) -> Reply:
        for attempt in range(attempts):
            try:
                return self._attempt(path, body, ctx)
            except ProxyError as err:
                if not err.retryable or attempt + 1 >= attempts:
                    raise
                # Failover (docs/behaviour.md#failover): nothing reached the client yet, and
                # the failed instance is in ctx.failed, so routing prefers another live one of
                # its role next time.
                ctx.retry(err)
                self.counters[f"retried_{err.stage or 'unknown'}"] += 1
                logger.warning("request %s: attempt %d of %d failed at %s on %s (%s); retrying "
                               "on another instance", ctx.request_id, attempt + 1, attempts,
                               err.stage, err.instance, err)
        raise AssertionError("unreachable")

    def passthrough(self, method: str, path: str, query: str, body: bytes | None,
                    content_type: str | None, ctx: RequestContext,
                    model: str | None = None) -> Reply:
        """Any other route goes to a decode-side instance unchanged (docs/behaviour.md#edge),
        one serving the body's ``model`` when a live one does (docs/behaviour.md#models)."""
        if model is not None and not self.registry.live(self.decode_role, model):
            model = None  # nobody live serves it: the instance answers as vLLM would
        ctx.on_leg = self.registry.track
        target = self.router.pick(self.decode_role, model=model)
        ctx.instances["decode"] = target.url
        headers = dict(ctx.upstream_headers)
        if content_type:
            headers["Content-Type"] = content_type
        url = target.url + upstream_path(path) + (f"?{query}" if query else "")
        resp = self._send(target, "decode", method, url, ctx, headers=headers, body=body,
                          **self._decode_timeouts(stream=True))
        if 300 <= resp.status_code < 400:
            self._check(resp, target, "decode", ctx)
        return self._reply(resp, ctx, stream=True)

    def _attempt(self, path: str, body: dict[str, Any], ctx: RequestContext) -> Reply:
        # Every attempt encodes again from the client's body (docs/behaviour.md#failover): the
        # consumer is chosen first because the encoders may have to push to it
        # (docs/behaviour.md#routing).
        if self.roster.combined:
            target = self.router.pick("prefill_decode", frozenset(ctx.failed), ctx.model)
            staged = self.encode.run(body, ctx, target, self.roster.settings)
            return self._open_decode(target, path, LegRequest(staged.body, staged.consumer_headers),
                                     ctx)
        # Decode is chosen first: with no decode alive, prefill work would be wasted.
        decode = self.router.pick("decode", frozenset(ctx.failed), ctx.model)
        if self._skips_prefill():
            return self._decode_only(decode, path, body, ctx)
        route = self.connector.route(decode, ctx.attempt_id, ctx.retries, frozenset(ctx.failed),
                                     ctx.model, self.registry.base_of(decode.url, ctx.model))
        body = self.encode.run(body, ctx, route.prefill.instance, self.roster.settings).body
        if self.connector.concurrent:
            return self._concurrent_legs(route, path, body, ctx)
        return self._sequential_legs(route, path, body, ctx)

    def _skips_prefill(self) -> bool:
        """Selective disaggregation (docs/behaviour.md#routing-policies): a prompt estimated
        shorter than ``disaggregate_min_prompt_tokens`` costs decode less to compute than a
        prefill hop and a KV transfer; only connectors whose decode can compute alone."""
        floor = self.roster.settings.disaggregate_min_prompt_tokens
        affinity = routing.current()
        return (floor > 0 and affinity is not None and affinity.prompt_tokens < floor
                and self.connector.name in DIRECT_DECODE_CONNECTORS)

    def _decode_only(self, decode: Instance, path: str, body: dict[str, Any],
                     ctx: RequestContext) -> Reply:
        body = self.encode.run(body, ctx, decode, self.roster.settings).body
        route = Route(Placement(decode), decode, ctx.attempt_id, ctx.retries)
        ctx.routing.append("prefill:skipped(short)")
        events.routed.fire("prefill", "disaggregate", "skipped", decode.url)
        return self._open_decode(decode, path, self.connector.decode_leg(body, route, None), ctx)

    # -- prefill, then decode (nixl, none, p2p_nccl) ----------------------------------------

    def _sequential_legs(self, route: Route, path: str, body: dict[str, Any],
                         ctx: RequestContext) -> Reply:
        try:
            answer = self._prefill(route, path, self.connector.prefill_leg(body, route), ctx)
        except BackendError as err:
            if not self._recompute_instead(err, route, ctx):
                raise
            answer = None
        try:
            leg = self.connector.decode_leg(body, route, answer)
            cached_tokens = usage.prefill_cached_tokens(answer)
        except ValueError as exc:  # the connector's and usage's checks of prefill's answer
            url = route.prefill.instance.url
            self.counters["prefill_failures"] += 1
            raise BackendError(f"prefill instance {instance_label(url)} answered an unusable "
                               f"reply: {exc}", code="bad_prefill_answer", stage="prefill",
                               instance=url) from None
        return self._open_decode(route.decode, path, leg, ctx, cached_tokens=cached_tokens)

    def _recompute_instead(self, err: BackendError, route: Route, ctx: RequestContext) -> bool:
        """Whether a failed prefill leg may be replaced by decode recomputing the prompt.

        Never for a 4xx (the request itself is wrong; decode would refuse it too), and never
        for connectors whose decode waits for KV instead of recomputing.
        """
        if (self.roster.settings.prefill_failure != "recompute" or not self.connector.recomputes
                or (isinstance(err, BackendStatus) and err.status < 500)):
            return False
        self.counters["prefill_recomputed"] += 1
        logger.warning("request %s: prefill %s failed (%s); decode recomputes the prompt",
                       ctx.request_id, route.prefill.instance.url, err)
        return True

    def _prefill(self, route: Route, path: str, leg: LegRequest,
                 ctx: RequestContext) -> dict[str, Any] | None:
        target = route.prefill.instance
        ctx.instances["prefill"] = target.url
        started = time.monotonic()
        try:
            resp = self._post(target, "prefill", path, leg, ctx,
                              self.roster.settings.prefill_timeout)
            self._check(resp, target, "prefill", ctx)
            try:
                raw = self.transport.read_body(resp, "prefill",
                                               max_bytes=self.transport.max_answer_bytes)
            except ProxyError as err:
                ctx.leg_close("prefill", target.url, error=err)
                raise
        except ProxyError:
            self.counters["prefill_failures"] += 1
            raise
        ctx.leg_close("prefill", target.url, status=resp.status_code)
        ctx.mark("prefill", started)
        try:
            answer = jsoncodec.loads(raw)
        except ValueError:
            raise BackendError(f"prefill instance {instance_label(target.url)} answered "
                               "non-JSON", stage="prefill", instance=target.url) from None
        return answer if isinstance(answer, dict) else None

    # -- prefill and decode at once (mooncake) ----------------------------------------------

    def _concurrent_legs(self, route: Route, path: str, body: dict[str, Any],
                         ctx: RequestContext) -> Reply:
        """Both legs start now; the request waits for decode's first byte.

        Until that byte, a failed prefill closes decode (it would wait for KV that never
        comes), a failed decode closes prefill, and a client that hangs up closes both. After
        it, decode evidently has its KV: prefill is drained beside the relay, its failure only
        logged and counted, and the relay ends it with the stream.
        """
        prefill: Call[Any] = Call("prefill", self._drain_prefill, route, path,
                                  self.connector.prefill_leg(body, route), ctx)
        opening: Call[Any] | None = None
        try:
            leg = self.connector.decode_leg(body, route, None)
            opening = Call("decode", self._open_first_byte, route.decode, path, leg, ctx)
            while not opening.done:
                legs.wait_any([opening] if prefill.done else [opening, prefill],
                              CLIENT_CHECK_INTERVAL)
                if prefill.failed and not opening.done:
                    assert prefill.error is not None
                    raise prefill.error
                if not opening.done and ctx.client_gone():
                    raise ClientDisconnected("the client went away before decode answered")
            if opening.error is not None:
                raise opening.error
        except BaseException:
            if opening is not None:
                opening.stop()
            prefill.stop()
            raise
        resp, chunks = opening.value
        return self._reply(resp, ctx, stream=fields.streams(leg.body), chunks=chunks,
                           side=prefill)

    def _drain_prefill(self, route: Route, path: str, leg: LegRequest, ctx: RequestContext) -> None:
        try:
            self._prefill(route, path, leg, ctx)
        except ProxyError as err:
            logger.warning("request %s: prefill %s (rank %s) failed: %s", ctx.request_id,
                           route.prefill.instance.url, route.prefill.dp_rank, err)
            raise

    def _open_first_byte(self, target: Instance, path: str, leg: LegRequest,
                         ctx: RequestContext) -> tuple[Upstream, Iterator[bytes]]:
        """Open decode and read its first body bytes: in Mooncake they prove the KV arrived."""
        ctx.instances["decode"] = target.url
        started = time.monotonic()
        resp = self._post(target, "decode", path, leg, ctx,
                          **self._decode_timeouts(fields.streams(leg.body)))
        try:
            self._check(resp, target, "decode", ctx)
            self._check_kind(resp, target, ctx, fields.streams(leg.body))
            chunks = self.transport.iter_raw(resp, "decode")
            first = next(chunks, b"")
        except StreamInterrupted as err:
            resp.close()
            ctx.leg_close("decode", target.url, error=err)
            err.retryable = True  # cut before its first byte: nothing reached the client yet
            raise
        except BaseException:
            resp.close()
            ctx.leg_close("decode", target.url)  # already closed if its status failed
            raise
        ctx.mark("decode_first_byte", started)
        return resp, itertools.chain((first,), chunks) if first else chunks

    # -- decode's answer to the client ------------------------------------------------------

    def _open_decode(self, target: Instance, path: str, leg: LegRequest, ctx: RequestContext,
                     cached_tokens: int = 0) -> Reply:
        ctx.instances["decode"] = target.url
        started = time.monotonic()
        stream = fields.streams(leg.body)
        resp = self._post(target, "decode", path, leg, ctx, **self._decode_timeouts(stream))
        self._check(resp, target, "decode", ctx)
        self._check_kind(resp, target, ctx, stream)
        ctx.mark("decode_first_byte", started)
        return self._reply(resp, ctx, stream=stream, cached_tokens=cached_tokens)

    def _reply(self, resp: Upstream, ctx: RequestContext, stream: bool, *,
               cached_tokens: int = 0, chunks: Iterator[bytes] | None = None,
               side: Call[Any] | None = None) -> Reply:
        """The client's reply from decode's response; ``chunks`` continues a body already
        started, ``side`` is a leg that must end with it, ``cached_tokens`` goes into usage."""
        ctx.status = resp.status_code
        headers = client_headers(resp.headers.items())
        headers.append((REQUEST_ID_HEADER, ctx.request_id))
        content_type = resp.headers.get("Content-Type", "")
        if content_type.startswith("text/event-stream"):
            headers.extend(STREAM_HEADERS)
            rewrite = partial(usage.rewrite_events, cached=cached_tokens) \
                if cached_tokens and resp.status_code == 200 else None
            return Reply(resp.status_code, headers, relay.sse(
                self.transport, resp, ctx, chunks=chunks, rewrite=rewrite, side=side,
                max_event=self.max_event_bytes))
        if stream:
            return Reply(resp.status_code, headers,
                         relay.raw(self.transport, resp, ctx, chunks=chunks, side=side))
        try:
            if chunks is None:
                data = self.transport.read_body(resp, "decode")
            else:
                try:
                    data = b"".join(chunks)
                finally:
                    resp.close()
        except BackendError as err:
            ctx.leg_close("decode", ctx.instances.get("decode", ""), error=err)
            err.retryable = True  # nothing reached the client yet, so another try is safe
            relay.end_side_leg(side, completed=False)
            raise
        relay.end_side_leg(side, completed=True)
        if cached_tokens and resp.status_code == 200:
            data = usage.rewrite_body(data, cached_tokens)
        ctx.bytes_out = len(data)
        ctx.finish(status=resp.status_code)
        return Reply(resp.status_code, headers, data)

    def _decode_timeouts(self, stream: bool) -> dict[str, float | None]:
        """A stream's status line and first token come early, so ``decode_timeout`` bounds
        them; a non-stream answer arrives whole at the end, so only the total does."""
        settings = self.roster.settings
        return {"read_timeout": settings.decode_timeout if stream else None,
                "chunk_timeout": settings.decode_chunk_timeout,
                "total_timeout": settings.decode_total_timeout or None}

    def _post(self, target: Instance, stage: str, path: str, leg: LegRequest,
              ctx: RequestContext, read_timeout: float | None,
              chunk_timeout: float | None = None,
              total_timeout: float | None = None) -> Upstream:
        headers = dict(ctx.upstream_headers)
        headers[REQUEST_ID_HEADER] = ctx.attempt_id
        headers.update(leg.headers)
        headers["Content-Type"] = "application/json"
        return self._send(target, stage, "POST", target.url + path, ctx, headers=headers,
                          body=encode_json(leg.body), read_timeout=read_timeout,
                          chunk_timeout=chunk_timeout, total_timeout=total_timeout)

    def _send(self, target: Instance, stage: str, method: str, url: str,
              ctx: RequestContext, *, headers: dict[str, str], body: bytes | None,
              read_timeout: float | None, chunk_timeout: float | None = None,
              total_timeout: float | None = None) -> Upstream:
        ctx.leg_open(stage, target.role, target.url)
        try:
            return self.transport.send(method, url, stage=stage, headers=headers, body=body,
                                       read_timeout=read_timeout, chunk_timeout=chunk_timeout,
                                       total_timeout=total_timeout)
        except ProxyError as err:
            ctx.leg_close(stage, target.url, error=err)
            if isinstance(err, BackendUnavailable):
                # Passive signal: a refused connection counts like a failed probe.
                self.registry.record_failure(target.url, str(err))
                ctx.failed.add(target.url)
            raise

    def _check_kind(self, resp: Upstream, target: Instance, ctx: RequestContext,
                    stream: bool) -> None:
        """A completion's answer is an event stream when one was asked for and JSON
        otherwise; anything else (an HTML page from something in front of decode, a wrong
        route) would reach the client as if it were the completion."""
        content_type = resp.headers.get("Content-Type", "")
        expected = "text/event-stream" if stream else "application/json"
        if content_type.split(";", 1)[0].strip().lower() == expected:
            return
        resp.close()
        err = BackendError(
            f"decode instance {instance_label(target.url)} answered {resp.status_code} with "
            f"Content-Type {content_type[:80] or '(none)'!r}, not {expected}",
            code="upstream_bad_answer", stage="decode", instance=target.url)
        ctx.leg_close("decode", target.url, error=err)
        raise err

    def _check(self, resp: Upstream, target: Instance, stage: str,
               ctx: RequestContext) -> None:
        try:
            self.transport.raise_for_status(resp, stage)
        except ProxyError as err:
            ctx.leg_close(stage, target.url, error=err)
            if err.retryable:
                ctx.failed.add(target.url)
            raise
