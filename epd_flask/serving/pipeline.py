"""One request's journey: route, prefill, open decode, hand the answer to the relay.

Everything that can fail before the client sees a status line happens here, so it can still be
retried (docs/behaviour.md#failover) or turned into a proper error response; all of it runs
while the client is watched (``legs.unless_client_leaves``), so a client that leaves ends every
leg at once. Nothing here knows about Flask. The connector shapes the legs and says how they
run: prefill drained before decode opens (``_sequential_legs``), or both at once
(``_concurrent_legs``, Mooncake). Decode's answer is opened up to its first body bytes (a
non-stream one read whole) before the client gets a status line.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any
from urllib.parse import quote

from epd_flask.control.roles import DECODE, PREFILL, PREFILL_DECODE
from epd_flask.control.roster import Instance
from epd_flask.control.settings import default
from epd_flask.core import jsoncodec
from epd_flask.core.errors import (
    BackendError,
    BackendStatus,
    BackendUnavailable,
    NoBackend,
    ProxyError,
    instance_label,
)
from epd_flask.core.headers import REQUEST_ID_HEADER, client_headers
from epd_flask.fleet.affinity import route_request
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.models import Catalog
from epd_flask.fleet.policies import Decision, Placement, RouteRequest
from epd_flask.fleet.routing import Router
from epd_flask.serving import fields, legs, relay, usage
from epd_flask.serving.connectors import Connector, LegRequest, Route
from epd_flask.serving.context import OpenLeg, RequestContext
from epd_flask.serving.encode_stage import EncodeStage, Staged
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


STREAM_HEADERS = (("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"))
#: A decode with at most this many requests open counts as idle for Dynamo's rule
#: (``disaggregate_max_prefill_queue_tokens``): the rule as docs/benchmarks.md measured it.
IDLE_DECODE_CALLS = 1


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: Iterable[bytes] | bytes


@dataclass(frozen=True, slots=True)
class Plan:
    """What a completion needs known before it is admitted or routed, worked out once per
    request: its routing keys and prompt estimate (``request``, for the model ``ctx.model``
    resolves to) and the roles it runs on (``roles``: what admission reserves and routing
    picks, docs/behaviour.md#admission)."""

    request: RouteRequest
    roles: tuple[str, ...]


@dataclass
class Opened:
    """Decode's answer as far as it was read before replying: the rest of a stream to relay
    (``chunks``; None: not started), or a whole body (``data``)."""

    resp: Upstream
    stream: bool
    chunks: Iterator[bytes] | None = None
    data: bytes | None = None


class Pipeline:
    def __init__(self, live: LiveFleet, router: Router, transport: Transport,
                 connector: Connector,
                 max_event_bytes: int = default("EPD_MAX_EVENT_BYTES")) -> None:
        self.live = live
        self.max_event_bytes = max_event_bytes
        self.registry = live.registry
        self.router = router
        self.transport = transport
        self.connector = connector
        # Per-worker tallies of what went wrong beside the client's view (shown on /health).
        self.counters: Counter[str] = Counter()
        self.encode = EncodeStage(router, self.registry,
                                  Fanout(transport, self.registry, self.counters))
        self.catalog = Catalog(live)

    def ready(self) -> tuple[bool, str]:
        """Can a completion be served right now? (readiness, not liveness: it counts only
        instances that answered a probe, so a fresh worker is ready after its first round)"""
        if self.live.view.combined:
            if self.registry.confirmed(PREFILL_DECODE):
                return True, "ok"
            return False, "no live prefill_decode instance"
        if not self.registry.confirmed(DECODE):
            return False, "no live decode instance"
        if not self.registry.confirmed(PREFILL):
            return False, "no live prefill instance"
        return self.router.ready(PREFILL)

    def plan(self, body: dict[str, Any], ctx: RequestContext) -> Plan:
        """The request's model (set on ``ctx``), routing keys, estimate and roles."""
        # Every stage is picked among instances serving the model (docs/behaviour.md#models);
        # the body goes upstream as the client wrote it, model absent or not.
        ctx.model = self.catalog.resolve(body.get("model"))
        request = route_request(body, ctx.session, ctx.model)
        return Plan(request, self.roles(request.prompt_tokens))

    def roles(self, prompt_tokens: int) -> tuple[str, ...]:
        """The roles a completion of ``prompt_tokens`` (estimated) runs on: the one answer
        admission reserves capacity by and routing follows. A prompt under
        ``disaggregate_min_prompt_tokens`` goes to decode alone, unless decode's cache picture
        then shows more of it to compute (``_skips_prefill``)."""
        if self.live.view.combined:
            return (PREFILL_DECODE,)
        return (DECODE,) if prompt_tokens < self._disaggregation_floor() else (DECODE, PREFILL)

    def completion(self, path: str, body: dict[str, Any], ctx: RequestContext,
                   plan: Plan | None = None) -> Reply:
        """Serve /v1/completions or /v1/chat/completions, retrying before the first byte;
        ``plan``: the request's, when admission already worked it out."""
        if plan is None:
            plan = self.plan(body, ctx)
        return legs.unless_client_leaves(ctx.client, self._attempts, path, body, ctx,
                                         plan)

    def _attempts(self, path: str, body: dict[str, Any], ctx: RequestContext,
                  plan: Plan) -> Reply:
        """The request's attempts: what routing may know of it is computed once (its keys,
        and its tokens when a policy reads them), then each attempt excludes the instances
        earlier ones failed on."""
        roles = plan.roles
        request = self.router.with_tokens(plan.request, roles, body, ctx.upstream_headers,
                                          held_on=DECODE if self._disaggregation_floor()
                                          and PREFILL_DECODE not in roles else None,
                                          trace=ctx.trace)
        view = self.live.view
        ctx.on_leg = partial(self.registry.track, tokens=request.prompt_tokens)
        attempts = view.settings.decode_retries + 1
        for attempt in range(attempts):
            try:
                return self._attempt(path, body, ctx,
                                     replace(request, exclude=frozenset(ctx.failed)))
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
        return legs.unless_client_leaves(ctx.client, self._passthrough, method, path,
                                         query, body, content_type, ctx, model)

    def _passthrough(self, method: str, path: str, query: str, body: bytes | None,
                     content_type: str | None, ctx: RequestContext,
                     model: str | None) -> Reply:
        role = self.live.view.decode_role
        if model is not None and not self.registry.live(role, model):
            model = None  # nobody live serves it: the instance answers as vLLM would
        ctx.on_leg = self.registry.track
        target = self.router.pick(role, RouteRequest(model=model), ctx.decided).instance
        ctx.instances["decode"] = target.url
        headers = dict(ctx.upstream_headers)
        if content_type:
            headers["Content-Type"] = content_type
        url = target.url + upstream_path(path) + (f"?{query}" if query else "")
        with ctx.leg("decode", target.role, target.url) as call:
            resp = self._send(target, "decode", method, url, call, headers=headers, body=body,
                              **self._decode_timeouts(stream=True))
            call.status = resp.status_code
            if 300 <= resp.status_code < 400:
                self.transport.raise_for_status(resp, "decode")
            call.hold()  # relayed as it arrives: the relay's end closes it
        return self._reply(Opened(resp, stream=True), ctx)

    def _attempt(self, path: str, body: dict[str, Any], ctx: RequestContext,
                 request: RouteRequest) -> Reply:
        # Every attempt encodes again from the client's body (docs/behaviour.md#failover): the
        # consumer is chosen first because the encoders may have to push to it
        # (docs/behaviour.md#routing).
        view = self.live.view
        if view.combined:
            target = self.router.pick(PREFILL_DECODE, request, ctx.decided)
            staged = self.encode.run(body, ctx, target, view.settings, request)
            opened = self._open_decode(
                target.instance, path, LegRequest(staged.body, staged.consumer_headers), ctx)
            return self._reply(opened, ctx)
        # Decode is chosen first: with no decode alive, prefill work would be wasted.
        decode = self.router.pick(DECODE, request, ctx.decided).instance
        to_prefill = replace(request, base=self.registry.base_of(decode.url, ctx.model))
        skipped = self._skips_prefill(request, decode) or self._prefills_queued(to_prefill,
                                                                                decode)
        if skipped is not None:
            return self._decode_only(decode, path, body, ctx, request, skipped)
        prefill = self.router.pick(PREFILL, to_prefill, ctx.decided)
        route = self.connector.route(decode, prefill, ctx.attempt_id, ctx.retries)
        staged = self.encode.run(body, ctx, prefill, view.settings, request)
        if self.connector.concurrent:
            return self._concurrent_legs(route, path, staged, ctx)
        return self._sequential_legs(route, path, staged, ctx)

    def _prefill_leg(self, route: Route, staged: Staged) -> LegRequest:
        """The connector's prefill call, naming the replica encoders pushed to (its rank
        header) when the connector names none itself."""
        leg = self.connector.prefill_leg(staged.body, route)
        if staged.consumer_headers:
            leg.headers = {**staged.consumer_headers, **leg.headers}
        return leg

    def _disaggregation_floor(self) -> int:
        """``disaggregate_min_prompt_tokens`` when the connector's decode can compute a prompt
        alone, else 0 (never skip prefill)."""
        return self.live.settings.disaggregate_min_prompt_tokens \
            if self.connector.recomputes else 0

    def _skips_prefill(self, request: RouteRequest, decode: Instance) -> str | None:
        """Selective disaggregation (docs/behaviour.md#routing-policies): the prompt tokens
        ``decode`` would compute, when fewer than ``disaggregate_min_prompt_tokens``, cost it
        less than a prefill hop and a KV transfer. Where decode's cache picture is known,
        those are the prompt's tokens it does not hold (why: ``held=<held>/<prompt>``);
        otherwise the estimated prompt (``short``). None: prefill runs."""
        floor = self._disaggregation_floor()
        if floor <= 0:
            return None
        held = self.router.held(decode, request)
        if held is None or request.tokens is None:
            return "short" if PREFILL not in self.roles(request.prompt_tokens) else None
        return f"held={held}/{len(request.tokens)}" \
            if len(request.tokens) - held < floor else None

    def _prefills_queued(self, request: RouteRequest, decode: Instance) -> str | None:
        """Dynamo's rule (docs/behaviour.md#routing-policies, 8): while every prefill that
        would be offered ``request`` has ``disaggregate_max_prefill_queue_tokens`` prompt
        tokens queued (routing's load) and ``decode`` is idle (at most ``IDLE_DECODE_CALLS``
        requests), decode computing the prompt now beats any prefill's queue (why:
        ``queued=<least queue>``). None: prefill runs, or no prefill is live and picking one
        says so."""
        bound = self.live.settings.disaggregate_max_prefill_queue_tokens
        if bound <= 0 or not self.connector.recomputes \
                or self.router.load(DECODE).calls(decode) > IDLE_DECODE_CALLS:
            return None
        try:
            least = self.router.lightest(PREFILL, request)
        except NoBackend:
            return None
        return f"queued={least}" if least >= bound else None

    def _decode_only(self, decode: Instance, path: str, body: dict[str, Any],
                     ctx: RequestContext, request: RouteRequest, why: str) -> Reply:
        body = self.encode.run(body, ctx, Placement(decode), self.live.settings, request).body
        route = Route(Placement(decode), decode, ctx.attempt_id, ctx.retries)
        ctx.decided(PREFILL, Decision(Placement(decode), "disaggregate", "skipped", why))
        opened = self._open_decode(decode, path, self.connector.decode_leg(body, route, None),
                                   ctx)
        return self._reply(opened, ctx)

    # -- prefill, then decode (nixl, none, p2p_nccl) ----------------------------------------

    def _sequential_legs(self, route: Route, path: str, staged: Staged,
                         ctx: RequestContext) -> Reply:
        body = staged.body
        try:
            answer = self._prefill(route, path, self._prefill_leg(route, staged), ctx)
        except BackendError as err:
            if not self._recompute_instead(err, route, ctx):
                raise
            answer = None
        try:
            leg = self.connector.decode_leg(body, route, answer)
            cached_tokens = usage.prefill_cached_tokens(answer)
        except ValueError as exc:  # the connector's and usage's checks of prefill's answer
            url = route.prefill.instance.url
            code = getattr(exc, "code", "bad_prefill_answer")
            self.counters["prefill_failures"] += 1
            ctx.events.upstream_error.fire("prefill", url, code)
            raise BackendError(f"prefill instance {instance_label(url)} answered an unusable "
                               f"reply: {exc}", code=code, stage="prefill",
                               instance=url) from None
        opened = self._open_decode(route.decode, path, leg, ctx)
        return self._reply(opened, ctx, cached_tokens=cached_tokens)

    def _recompute_instead(self, err: BackendError, route: Route, ctx: RequestContext) -> bool:
        """Whether a failed prefill leg may be replaced by decode recomputing the prompt.

        Never for a 4xx (the request itself is wrong; decode would refuse it too), and never
        for connectors whose decode waits for KV instead of recomputing.
        """
        if (self.live.settings.prefill_failure != "recompute" or not self.connector.recomputes
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
            with ctx.leg("prefill", target.role, target.url) as call:
                resp = self._post(target, "prefill", path, leg, ctx, call,
                                  self.live.settings.prefill_timeout)
                call.status = resp.status_code
                self.transport.raise_for_status(resp, "prefill")
                raw = self.transport.read_body(resp, "prefill",
                                               max_bytes=self.transport.max_answer_bytes)
        except ProxyError:
            self.counters["prefill_failures"] += 1
            raise
        ctx.mark("prefill", started)
        try:
            answer = jsoncodec.loads(raw)
        except ValueError:
            raise BackendError(f"prefill instance {instance_label(target.url)} answered "
                               "non-JSON", stage="prefill", instance=target.url) from None
        if not isinstance(answer, dict):
            return None
        counted = usage.prefill_tokens(answer)
        if counted is not None:
            ctx.events.prefill_tokens.fire(target.url, *counted)
            if ctx.trace is not None:
                ctx.trace.prefill_usage(*counted)
        return answer

    # -- prefill and decode at once (mooncake) ----------------------------------------------

    def _concurrent_legs(self, route: Route, path: str, staged: Staged,
                         ctx: RequestContext) -> Reply:
        """Both legs start now; the request waits for decode's first byte.

        Until that byte, a failed prefill closes decode (it would wait for KV that never
        comes) and a failed decode closes prefill. After it, decode evidently has its KV:
        prefill is drained beside the relay, its failure only logged and counted, and the
        relay ends it with the stream.
        """
        prefill: Call[Any] = Call("prefill", self._drain_prefill, route, path,
                                  self._prefill_leg(route, staged), ctx)
        opening: Call[Opened] | None = None
        try:
            leg = self.connector.decode_leg(staged.body, route, None)
            opening = Call("decode", self._open_decode, route.decode, path, leg, ctx)
            while not opening.done:
                legs.wait_any([opening] if prefill.done else [opening, prefill])
                if prefill.failed and not opening.done:
                    assert prefill.error is not None
                    raise prefill.error
            if opening.error is not None:
                raise opening.error
        except BaseException:
            if opening is not None:
                opening.stop()
            prefill.stop()
            raise
        assert opening.value is not None
        return self._reply(opening.value, ctx, side=prefill)

    def _drain_prefill(self, route: Route, path: str, leg: LegRequest, ctx: RequestContext) -> None:
        try:
            self._prefill(route, path, leg, ctx)
        except ProxyError as err:
            logger.warning("request %s: prefill %s (rank %s) failed: %s", ctx.request_id,
                           route.prefill.instance.url, route.prefill.dp_rank, err)
            raise

    # -- decode's answer to the client ------------------------------------------------------

    def _open_decode(self, target: Instance, path: str, leg: LegRequest,
                     ctx: RequestContext) -> Opened:
        """Open decode and read its first body bytes (in Mooncake they prove the KV arrived);
        a non-stream answer is read whole. Until then the request may still be retried, and
        the client watch covers the wait."""
        ctx.instances["decode"] = target.url
        started = time.monotonic()
        stream = fields.streams(leg.body)
        with ctx.leg("decode", target.role, target.url) as call:
            resp = self._post(target, "decode", path, leg, ctx, call,
                              **self._decode_timeouts(stream))
            call.status = resp.status_code
            try:
                self.transport.raise_for_status(resp, "decode")
                self._check_kind(resp, target, stream)
                chunks = self.transport.iter_raw(resp, "decode")
                first = next(chunks, b"")
                ctx.mark("decode_first_byte", started)
                ctx.answer_began()
                if stream:
                    call.first_byte()  # a whole answer's first byte is its end: the span's
                else:
                    data = first + b"".join(chunks)
            except BaseException:
                resp.close()
                raise
            if not stream:
                resp.close()
                return Opened(resp, stream, data=data)
            call.hold()  # relayed as it arrives: the relay's end closes it
        return Opened(resp, stream, chunks=itertools.chain((first,), chunks) if first
                      else chunks)

    def _reply(self, opened: Opened, ctx: RequestContext, *, cached_tokens: int = 0,
               side: Call[Any] | None = None) -> Reply:
        """The client's reply from decode's answer; ``side`` is a leg that must end with it,
        ``cached_tokens`` goes into usage."""
        resp = opened.resp
        ctx.status = resp.status_code
        headers = client_headers(resp.headers.items())
        headers.append((REQUEST_ID_HEADER, ctx.request_id))
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            headers.extend(STREAM_HEADERS)
            rewrite = partial(usage.rewrite_events, cached=cached_tokens) \
                if cached_tokens and resp.status_code == 200 else None
            return Reply(resp.status_code, headers, relay.sse(
                self.transport, resp, ctx, chunks=opened.chunks, rewrite=rewrite, side=side,
                max_event=self.max_event_bytes))
        if opened.stream:
            return Reply(resp.status_code, headers, relay.raw(
                self.transport, resp, ctx, chunks=opened.chunks, side=side))
        data = opened.data or b""
        relay.end_side_leg(side, completed=True)
        if ctx.trace is not None:
            ctx.trace.answer_usage(data)
        if cached_tokens and resp.status_code == 200:
            data = usage.rewrite_body(data, cached_tokens)
        ctx.bytes_out = len(data)
        ctx.finish(status=resp.status_code)
        return Reply(resp.status_code, headers, data)

    def _decode_timeouts(self, stream: bool) -> dict[str, float | None]:
        """A stream's status line and first token come early, so ``decode_timeout`` bounds
        them; a non-stream answer arrives whole at the end, so only the total does."""
        settings = self.live.settings
        return {"read_timeout": settings.decode_timeout if stream else None,
                "chunk_timeout": settings.decode_chunk_timeout,
                "total_timeout": settings.decode_total_timeout or None}

    def _post(self, target: Instance, stage: str, path: str, leg: LegRequest,
              ctx: RequestContext, call: OpenLeg, read_timeout: float | None,
              chunk_timeout: float | None = None,
              total_timeout: float | None = None) -> Upstream:
        headers = dict(ctx.upstream_headers)
        headers[REQUEST_ID_HEADER] = ctx.attempt_id
        headers.update(leg.headers)
        headers["Content-Type"] = "application/json"
        return self._send(target, stage, "POST", target.url + path, call, headers=headers,
                          body=encode_json(leg.body), read_timeout=read_timeout,
                          chunk_timeout=chunk_timeout, total_timeout=total_timeout)

    def _send(self, target: Instance, stage: str, method: str, url: str, call: OpenLeg, *,
              headers: dict[str, str], body: bytes | None, read_timeout: float | None,
              chunk_timeout: float | None = None,
              total_timeout: float | None = None) -> Upstream:
        """One upstream call; the caller's ``ctx.leg`` block books it (``call``), and while
        the request is traced the call names its span (docs/behaviour.md#tracing)."""
        if call.span is not None:
            headers.update(call.span.headers)
        try:
            return self.transport.send(method, url, stage=stage, headers=headers, body=body,
                                       read_timeout=read_timeout, chunk_timeout=chunk_timeout,
                                       total_timeout=total_timeout)
        except BackendUnavailable as err:
            # Passive signal: a refused connection counts like a failed probe.
            self.registry.record_failure(target.url, str(err))
            raise

    @staticmethod
    def _check_kind(resp: Upstream, target: Instance, stream: bool) -> None:
        """A completion's answer is an event stream when one was asked for and JSON
        otherwise; anything else (an HTML page from something in front of decode, a wrong
        route) would reach the client as if it were the completion."""
        content_type = resp.headers.get("Content-Type", "")
        expected = "text/event-stream" if stream else "application/json"
        if content_type.split(";", 1)[0].strip().lower() == expected:
            return
        raise BackendError(
            f"decode instance {instance_label(target.url)} answered {resp.status_code} with "
            f"Content-Type {content_type[:80] or '(none)'!r}, not {expected}",
            code="upstream_bad_answer", stage="decode", instance=target.url)
