"""Admission control: which completion goes out now, which waits for capacity, and which is
refused (docs/behaviour.md#admission).

A request is its tenant's: the roster's ``tenant_header`` when the request carries it, else the
tenant its API key belongs to, else ``default``. Over the tenant's rate limit it is refused at
once (429, ``ratelimit.py``). Otherwise it goes out when, for every role it needs, some live
instance is not full (``fleet/saturation.py``), and no request waits before it for the same
capacity; else it waits in this worker's queue (``fairqueue.py``: strict priority between
classes, weighted fair sharing within one) for at most ``queue_timeout``. A request let through
holds a reservation on each role until it is routed there, then a place on the chosen
instance (the host's count, ``fleet/loadboard.py``) until it ends; every release lets the
next waiting requests through. A waiting client that hangs up leaves the queue and nothing is
sent upstream.

The request context reports routing, retries and the end to the request's ``Ticket``; the
view reports the answer (its usage corrects the token estimate, its headers carry the
tenant's limits).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import gevent
from gevent.event import Event

from epd_flask.control.roster import ADMITTED_ROLES, DEFAULT_TENANT, Tenant, admits, tenant_of
from epd_flask.control.roster import Admission as AdmissionSettings
from epd_flask.core.errors import ClientDisconnected, Overloaded, ProxyError, RateLimited
from epd_flask.core.events import Events
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.loadboard import UNANSWERED, UNANSWERED_CALLS, UNANSWERED_SINCE, routed_ms
from epd_flask.fleet.saturation import Capacity
from epd_flask.serving import fields, ratelimit, usage
from epd_flask.serving.context import RequestContext
from epd_flask.serving.fairqueue import RANK, FairQueue, Waiter
from epd_flask.serving.pipeline import Plan
from epd_flask.serving.ratelimit import REQUESTS, TOKENS, Take, Verdict
from epd_flask.serving.redisstore import Limiter

logger = logging.getLogger(__name__)

#: How often a worker with requests waiting looks again for room its own releases did not
#: announce: other workers' and hosts' requests ending, engine queues read, instances back.
POLL_SECONDS = 0.05
#: vLLM's ``priority`` for each class when ``forward_priority`` is on: lower runs first
#: (``--scheduling-policy priority``), 0 is what a request without one gets.
VLLM_PRIORITY = {"high": -1, "normal": 0, "low": 1}
DEFAULTS = AdmissionSettings()
#: The reasons a request is refused, as the metrics and the status page name them.
REASONS = ("queue_full", "queue_timeout", "client_gone", "rate_limit_requests",
           "rate_limit_tokens", "too_large")
#: How long a stopping worker waits for the charge corrections under way.
STOP_SECONDS = 2.0
#: A class is active this long after its latest request arrived at the worker: meanwhile the
#: classes after it leave ``admission.reserve`` places of each bounded instance free.
ACTIVE_SECONDS = 5.0

#: (model, the roles the request needs): one pool of capacity, one queue.
Key = tuple[str | None, tuple[str, ...]]


@dataclass
class TenantStats:
    """What one tenant did on this worker (the status page's table)."""

    waiting: int = 0
    admitted: int = 0
    waited: int = 0
    tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


def requested_tokens(path_is_chat: bool, body: dict[str, Any], prompt: int) -> int:
    """What a request may use: its prompt (estimated) plus the most it may generate, for
    every choice (``n``). A chat without ``max_tokens`` reserves its prompt; its usage is
    charged when it ends."""
    most = _count(body.get("max_completion_tokens")) if path_is_chat else None
    if most is None:
        most = _count(body.get("max_tokens"))
    if most is None and not path_is_chat:
        most = 16  # vLLM's (and OpenAI's) default for /v1/completions
    choices = _count(body.get("n")) or 1
    return prompt + max(0, most or 0) * max(1, choices)


def _count(value: Any) -> int | None:
    """An integer field as vLLM reads it; a plain integer (the usual case) without pydantic."""
    if value is None or value.__class__ is int:
        return value
    return fields.count(value)


def with_priority(body: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
    """The body with vLLM's ``priority`` set from the tenant's class (the client's own
    value, if any, is replaced: the class is the operator's to give)."""
    return {**body, "priority": VLLM_PRIORITY[tenant.priority]}


def usage_total(data: bytes) -> int | None:
    """Prompt plus completion tokens of the last usage object in ``data`` (a JSON body, or
    SSE events), None when there is none."""
    found = usage.last_usage(data)
    if found is None or found[0] is None or found[1] is None:
        return None
    return found[0] + found[1]


class Ticket:
    """One admitted request's claims: its tenant's rate-limit charge, its reservation on
    each role, its places on instances. Told of the request's life by its context."""

    __slots__ = ("apart", "event", "gate", "gone", "holds", "keep", "key", "prompt", "pushed_out",
                 "ran", "record", "reserved", "settled", "stream", "takes", "tenant", "tokens",
                 "unanswered", "used", "verdict", "waiter")

    def __init__(self, gate: AdmissionGate, tenant: str, record: Tenant, key: Key,
                 prompt: int, tokens: int, stream: bool) -> None:
        self.gate = gate
        self.tenant = tenant
        self.record = record
        self.key = key
        self.prompt = prompt
        self.tokens = tokens
        self.stream = stream
        self.takes: list[Take] = []
        self.verdict: Verdict | None = None
        self.reserved: set[str] = set()
        self.holds: set[str] = set()
        self.waiter: Waiter | None = None
        self.event: Event | None = None
        #: A full queue refused it for a request that goes before it.
        self.pushed_out = False
        #: Its client hung up while it waited.
        self.gone = False
        self.ran = False
        #: The places of each bounded instance it leaves free (its class's when let through).
        self.keep = 0
        #: Its class when routing keeps it apart from better-or-equal classes' unanswered
        #: prompts (and counts its own where it goes until its answer begins), else None.
        self.apart: int | None = None
        #: Where it counts as unanswered, and the time it was routed there (ms).
        self.unanswered: dict[str, int] = {}
        self.settled = False
        self.used: int | None = None

    # -- what the request context reports ---------------------------------------------------

    def routed(self, role: str, url: str) -> None:
        """A routing decision: the reservation of that role becomes a place on ``url``. A
        role the request was not let through for (decode's cache picture showed more of a
        short prompt to compute, so prefill runs) still holds its place while it runs."""
        if role in self.reserved:
            self.reserved.discard(role)
            self.gate.unreserve(role, self.key[0])
        if role not in ADMITTED_ROLES:
            return
        if url not in self.holds:
            self.holds.add(url)
            self.ran = True
            self.gate.capacity.board.add(url, 1)
        if self.apart is not None and url not in self.unanswered:
            board, rank, at = self.gate.capacity.board, self.apart, routed_ms()
            self.unanswered[url] = at
            board.add(url, max(1, self.prompt), UNANSWERED[rank])
            board.add(url, 1, UNANSWERED_CALLS[rank])
            board.add(url, at, UNANSWERED_SINCE[rank])

    def answering(self) -> None:
        """Decode's answer began: the prompt is computed, nothing of this request is ahead
        of another's prefill any more."""
        if self.unanswered:
            self._release_unanswered()

    def retried(self) -> None:
        """The attempt failed: its instances' places are free (the next attempt routes
        again)."""
        self._release_holds()
        self.gate.kick()

    def finished(self, ctx: RequestContext) -> None:
        """The request ended, however: everything it held is free."""
        if self.waiter is not None:
            if not self.waiter.done:
                self.gate.leave(self)
            self.waiter = None  # it holds the ticket: the two would wait for a full collection
        for role in self.reserved:
            self.gate.unreserve(role, self.key[0])
        self.reserved.clear()
        self._release_holds()
        status = ctx.status
        if status is None or status >= 400 or not self.ran:
            self.settle(None, ran=self.ran)
        elif self.stream:
            self.settle(self.used if self.used is not None else self.prompt + ctx.chunks)
        self.gate.kick()

    def usage_seen(self, events: bytes) -> bytes:
        """A piece of the answer with a usage object (the relay's hook)."""
        total = usage_total(events)
        if total is not None:
            self.used = total
        return events

    # -- what the view reports --------------------------------------------------------------

    def answered(self, body: Any) -> list[tuple[str, str]]:
        """The headers a successful answer carries; a whole (non-stream) body's usage settles
        the token charge first, so they tell what remains after it."""
        if isinstance(body, bytes) and not self.settled:
            total = usage_total(body)
            self.settle(total if total is not None else self.tokens)
        return self.headers()

    def headers(self) -> list[tuple[str, str]]:
        return ratelimit.headers(self.verdict.levels) if self.verdict is not None else []

    # -- the rate-limit charge ----------------------------------------------------------------

    def settle(self, used: int | None, ran: bool = True) -> None:
        """Correct the charge: the tokens used instead of the estimate (None: none used); a
        request that never ran gives its request back too."""
        if self.settled:
            return
        self.settled = True
        if used is not None:
            self.gate.counted(self.tenant, used)
        if not self.takes:
            return
        gives = []
        for take in self.takes:
            if take.kind == REQUESTS and not ran:
                gives.append(Take(REQUESTS, take.capacity, -1))
            elif take.kind == TOKENS:
                delta = (used or 0) - take.amount
                if delta:
                    gives.append(Take(TOKENS, take.capacity, delta))
        if gives:
            # The store is corrected off the request's path (a Redis round trip); the headers
            # tell the buckets as this request left them, corrected here.
            self.gate.correct(self.tenant, gives)
            if self.verdict is not None:
                self.verdict = ratelimit.corrected(self.verdict, gives)

    def _release_holds(self) -> None:
        board = self.gate.capacity.board
        for url in self.holds:
            board.add(url, -1)
        self.holds.clear()
        if self.unanswered:
            self._release_unanswered()

    def _release_unanswered(self) -> None:
        assert self.apart is not None
        board, rank, weight = self.gate.capacity.board, self.apart, max(1, self.prompt)
        for url, at in self.unanswered.items():
            board.add(url, -weight, UNANSWERED[rank])
            board.add(url, -1, UNANSWERED_CALLS[rank])
            board.add(url, -at, UNANSWERED_SINCE[rank])
        self.unanswered.clear()


class AdmissionGate:
    """One worker's admission: its queue, its reservations, the tenants' limits."""

    def __init__(self, live: LiveFleet, capacity: Capacity, limiter: Limiter,
                 events: Events | None = None) -> None:
        self.live = live
        self.capacity = capacity
        self.limiter = limiter
        self._queues: dict[Key, FairQueue] = {}
        self._reserved: Counter[tuple[str, str | None]] = Counter()
        #: When each class's latest request arrived (by rank).
        self._arrived = [-math.inf] * len(RANK)
        self.waiting = 0
        self._poller: gevent.Greenlet | None = None
        self.stats: dict[str, TenantStats] = {}
        #: The app's hooks: the metrics hear every count below (docs/behaviour.md#admission).
        self.events = events if events is not None else Events()
        self._corrections: list[tuple[str, list[Take]]] = []
        self._corrector: gevent.Greenlet | None = None
        #: The classes kept apart (rule 14): those better than the roster's worst, while
        #: ``forward_priority`` has the engines compute them first; none otherwise.
        self._apart_below = 0
        live.subscribe(self._reconfigure)
        self._reconfigure(None, live.view)

    @property
    def enabled(self) -> bool:
        return self.capacity.active

    def _reconfigure(self, old: Any, new: Any) -> None:
        settings = new.settings.admission or DEFAULTS
        classes = [(name, tenant_of(new.tenants, name).priority)
                   for name in sorted({*new.tenants, DEFAULT_TENANT})]
        self._apart_below = max(RANK[priority] for _, priority in classes) \
            if settings.forward_priority else 0
        if admits(new.settings, new.tenants, new.instances):
            self.events.admission_tenants.fire(classes)
        try:
            self.limiter.configure(settings.store)
        except Exception as exc:  # a store the client library refuses: count per host
            logger.error("admission: cannot use the rate-limit store (%s); each host counts "
                         "its own", exc)
            self.limiter.configure("")

    def settings(self) -> AdmissionSettings:
        return self.live.settings.admission or DEFAULTS

    def stats_of(self, tenant: str) -> TenantStats:
        stats = self.stats.get(tenant)
        if stats is None:
            stats = self.stats[tenant] = TenantStats()
        return stats

    def tenant_of(self, header: Callable[[str], str | None], key_tenant: str | None) -> str:
        """The request's tenant: the trusted header's, the API key's, else ``default``; a
        name the roster does not list is ``default`` (docs/behaviour.md#admission)."""
        settings = self.settings()
        named = header(settings.tenant_header) if settings.tenant_header else None
        name = named or key_tenant
        return name if name is not None and name in self.live.view.tenants else DEFAULT_TENANT

    def admit(self, ctx: RequestContext, path_is_chat: bool, body: dict[str, Any],
              tenant: str, plan: Plan) -> tuple[dict[str, Any], Ticket, Plan]:
        """Let the request through (perhaps after a wait), or raise why not; the body to send
        (with vLLM's ``priority`` when the roster forwards it), the request's ticket and its
        plan (``plan``, the pipeline's for the request: its model, estimate and roles; its
        routing told the places its class leaves free)."""
        view = self.live.view
        settings = view.settings.admission or DEFAULTS
        record = tenant_of(view.tenants, tenant)
        prompt = plan.request.prompt_tokens
        tokens = requested_tokens(path_is_chat, body, prompt)
        ticket = Ticket(self, tenant, record, (plan.request.model, plan.roles), prompt, tokens,
                        fields.streams(body))
        ctx.tenant = tenant
        if record.limited:
            self._charge(ticket)
        ctx.admitted = ticket
        started = time.monotonic()
        rank = RANK[record.priority]
        self._arrived[rank] = started
        if rank < self._apart_below:
            ticket.apart = rank
        if ticket.key not in self._queues and self._room(ticket.key, rank):
            ticket.keep = self._kept_for(rank)
            self._reserve(ticket)
        else:
            self._wait(ctx, ticket, settings)
        ctx.queued(started)
        self.stats_of(tenant).admitted += 1
        self.events.admission_admitted.fire(
            tenant, record.priority,
            time.monotonic() - started if ticket.waiter is not None else None)
        if ticket.keep or ticket.apart is not None:
            plan = replace(plan, request=replace(plan.request, keep=ticket.keep,
                                                 rank=ticket.apart))
        return (with_priority(body, record) if settings.forward_priority else body), ticket, plan

    # -- rate limits ----------------------------------------------------------------------

    def _charge(self, ticket: Ticket) -> None:
        takes = ratelimit.takes_for(ticket.record, ticket.tokens)
        too_big = next((t for t in takes if t.amount > t.capacity), None)
        if too_big is not None:
            self.refused(ticket.tenant, "too_large")
            err = RateLimited(
                f"Request too large for tenant `{ticket.tenant}` on tokens per min (TPM): "
                f"Limit {too_big.capacity}, Requested {too_big.amount}. Lower max_tokens or "
                "the prompt.", kind=TOKENS)
            err.headers = (("x-should-retry", "false"),)
            raise err
        verdict = self.limiter.apply(ticket.tenant, takes)
        ticket.verdict = verdict
        if verdict.allowed:
            ticket.takes = takes
            return
        kind = verdict.short or REQUESTS
        self.refused(ticket.tenant, f"rate_limit_{kind}")
        level = next(lv for lv in verdict.levels if lv.kind == kind)
        wanted = next(t.amount for t in takes if t.kind == kind)
        label = "requests per min (RPM)" if kind == REQUESTS else "tokens per min (TPM)"
        err = RateLimited(
            f"Rate limit reached for tenant `{ticket.tenant}` on {label}: Limit "
            f"{level.limit}, Remaining {max(0, math.floor(level.remaining))}, Requested "
            f"{wanted:g}. Please try again in {ratelimit.duration(verdict.retry_after)}.",
            kind=kind)
        err.retry_after = max(1, math.ceil(verdict.retry_after))
        err.headers = (("retry-after-ms", str(max(1, math.ceil(verdict.retry_after * 1000)))),
                       *ratelimit.headers(verdict.levels))
        raise err

    def correct(self, tenant: str, gives: list[Take]) -> None:
        """Give ``tenant``'s buckets ``gives`` (what its answer used instead of the
        estimate) from a greenlet of their own: the request does not wait for the store."""
        self._corrections.append((tenant, gives))
        if self._corrector is None:
            self._corrector = gevent.spawn(self._apply_corrections)

    def _apply_corrections(self) -> None:
        """Every correction waiting, one store operation per tenant (those that arrive
        meanwhile in the next round)."""
        try:
            while self._corrections:
                batch, self._corrections = self._corrections, []
                for tenant, gives in ratelimit.merged(batch).items():
                    try:
                        self.limiter.apply(tenant, gives, give=True)
                    except Exception:
                        logger.exception("admission: correcting tenant %s's rate-limit "
                                         "charge failed", tenant)
        finally:
            self._corrector = None

    # -- capacity ------------------------------------------------------------------------

    def _room(self, key: Key, rank: int) -> bool:
        """Whether a request of class ``rank`` needing ``key`` could go out now."""
        model, roles = key
        room = self.capacity.room
        keep = self._kept_for(rank)
        return all(room(role, model, self._reserved[role, model], keep) for role in roles)

    def _kept_for(self, rank: int) -> int:
        """The places of each bounded instance a request of class ``rank`` leaves free: the
        roster's ``reserve`` while a better class is active, else none."""
        reserve = self.settings().reserve
        if not reserve or not rank:
            return 0
        now = time.monotonic()
        return reserve if any(now - self._arrived[r] < ACTIVE_SECONDS
                              for r in range(rank)) else 0

    def _reserve(self, ticket: Ticket) -> None:
        model, roles = ticket.key
        for role in roles:
            self._reserved[role, model] += 1
        ticket.reserved.update(roles)

    def unreserve(self, role: str, model: str | None) -> None:
        left = self._reserved[role, model] - 1
        if left > 0:
            self._reserved[role, model] = left
        else:
            del self._reserved[role, model]

    # -- the queue -----------------------------------------------------------------------

    def _wait(self, ctx: RequestContext, ticket: Ticket, settings: AdmissionSettings) -> None:
        stats = self.stats_of(ticket.tenant)
        cost = 1.0 if settings.share_by == REQUESTS else float(max(1, ticket.tokens))
        rank = RANK[ticket.record.priority]
        if self.waiting >= settings.max_queue and not self._push_out(ticket, rank, cost):
            self.refused(ticket.tenant, "queue_full")
            raise _queue_full(self.waiting)
        waiter = Waiter(ticket.tenant, rank, cost, payload=ticket)
        ticket.waiter, ticket.event = waiter, Event()
        self._queues.setdefault(ticket.key, FairQueue()).push(waiter, ticket.record.weight)
        self._queued(ticket, 1)
        self._dispatch()
        if not waiter.done and self._poller is None:
            self._poller = gevent.spawn(self._poll)
        deadline = time.monotonic() + settings.queue_timeout

        def gone() -> None:
            if not waiter.done:
                self.leave(ticket)
                ticket.gone = True
                event.set()
        event = ticket.event
        with ctx.client.watched(gone) if ctx.client is not None else nullcontext():
            while not event.wait(max(0.0, deadline - time.monotonic())) \
                    and time.monotonic() < deadline:
                pass  # woken early by nothing: gevent's timer may fire a hair before time
        if ticket.pushed_out:
            self.refused(ticket.tenant, "queue_full")
            raise _queue_full(self.waiting)
        if ticket.gone:
            self.refused(ticket.tenant, "client_gone")
            raise ClientDisconnected("client closed the connection while its request "
                                     "waited for capacity; nothing was sent upstream")
        if not event.is_set():
            self.leave(ticket)
            self.refused(ticket.tenant, "queue_timeout")
            raise Overloaded(f"no capacity for this request within {settings.queue_timeout:g}"
                             " s (admission.queue_timeout); retry shortly")
        stats.waited += 1

    def _push_out(self, ticket: Ticket, rank: int, cost: float) -> bool:
        """The queue is full: make room for ``ticket`` by refusing the waiting request that
        would be served last, if ``ticket`` would be served before it (a better class, or a
        smaller finish tag in the same pool); False when it would not."""
        queue = self._queues.get(ticket.key)
        worst = queue.last_served() if queue is not None else None
        if worst is None:
            # Its pool has nobody waiting: the last request of the fullest pool makes room.
            pools = sorted(self._queues.values(), key=len, reverse=True)
            worst = pools[0].last_served() if pools else None
            if worst is None or worst.rank < rank:
                return False
        elif not queue.goes_before(rank, ticket.tenant, cost, ticket.record.weight, worst):
            return False
        pushed: Ticket = worst.payload
        self.leave(pushed)
        pushed.pushed_out = True
        assert pushed.event is not None
        pushed.event.set()
        return True

    def leave(self, ticket: Ticket) -> None:
        """A waiting request gave up (its client left, its time ran out)."""
        waiter = ticket.waiter
        if waiter is None or waiter.done:
            return
        queue = self._queues.get(ticket.key)
        if queue is not None:
            queue.remove(waiter)
            if not len(queue):
                del self._queues[ticket.key]
        self._queued(ticket, -1)

    def kick(self) -> None:
        """Something was released: let waiting requests through while there is room."""
        if self._queues:
            self._dispatch()

    def _dispatch(self) -> None:
        for key, queue in sorted(self._queues.items(), key=lambda kv: kv[1].best_rank()):
            while len(queue) and self._room(key, queue.best_rank()):
                waiter = queue.pop()
                if waiter is not None:
                    self._grant(waiter)
            if not len(queue):
                self._queues.pop(key, None)

    def _grant(self, waiter: Waiter) -> None:
        ticket: Ticket = waiter.payload
        self._queued(ticket, -1)
        ticket.keep = self._kept_for(waiter.rank)
        self._reserve(ticket)
        assert ticket.event is not None
        ticket.event.set()

    # -- what is counted (TenantStats, the metrics) ------------------------------------------

    def _queued(self, ticket: Ticket, change: int) -> None:
        self.waiting += change
        self.stats_of(ticket.tenant).waiting += change
        self.events.admission_queue.fire(ticket.tenant, ticket.record.priority, change)

    def refused(self, tenant: str, reason: str) -> None:
        self.stats_of(tenant).rejected[reason] += 1
        self.events.admission_rejected.fire(tenant, reason)

    def counted(self, tenant: str, tokens: int) -> None:
        self.stats_of(tenant).tokens += tokens
        self.events.admission_tokens.fire(tenant, tokens)

    def _poll(self) -> None:
        try:
            while self.waiting:
                gevent.sleep(POLL_SECONDS)
                self._dispatch()
        finally:
            self._poller = None

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.kill(block=False)
        corrector = self._corrector
        if corrector is not None:
            corrector.join(STOP_SECONDS)
        if self._corrections:
            self._apply_corrections()  # still owed: given before the store closes
        self.limiter.close()

    def snapshot(self) -> dict[str, Any]:
        """Per tenant: its record, what it did on this worker and, for a limited tenant, its
        buckets now (``/status``, ``/debug/worker``)."""
        view = self.live.view
        names = sorted(set(view.tenants) | set(self.stats) | {DEFAULT_TENANT})
        out = {}
        for name in names:
            record = tenant_of(view.tenants, name)
            stats = self.stats_of(name)
            out[name] = {"priority": record.priority, "weight": record.weight,
                         "requests_per_minute": record.requests_per_minute,
                         "tokens_per_minute": record.tokens_per_minute,
                         "waiting": stats.waiting, "admitted": stats.admitted,
                         "waited": stats.waited, "tokens": stats.tokens,
                         "rejected": dict(stats.rejected), "limits": self._levels(name, record)}
        return {"enabled": self.enabled, "waiting": self.waiting,
                "store_up": self.limiter.up, "tenants": out}


    def _levels(self, name: str, record: Tenant) -> dict[str, dict[str, float]]:
        """``record``'s buckets as they are now: nothing taken (a give of 0 refills them to
        now and stores what it read)."""
        takes = [Take(t.kind, t.capacity, 0) for t in ratelimit.takes_for(record, 0)]
        if not takes:
            return {}
        levels = self.limiter.apply(name, takes, give=True).levels
        return {lv.kind: {"limit": lv.limit, "remaining": lv.remaining, "reset": lv.reset}
                for lv in levels}


def _queue_full(waiting: int) -> Overloaded:
    return Overloaded(f"this server already has {waiting} requests waiting for capacity, "
                      "none of which this one would go before; retry shortly")


def admission_error(err: ProxyError, ticket: Any) -> ProxyError:
    """``err`` carrying the tenant's rate-limit headers, as every answer of a limited tenant
    does (``ticket``: the request context's ``admitted``)."""
    if isinstance(ticket, Ticket) and ticket.verdict is not None \
            and not isinstance(err, RateLimited):
        err.headers = (*err.headers, *ticket.headers())
    return err
