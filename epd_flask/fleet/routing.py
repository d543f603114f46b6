"""Which instance takes the next request of a role.

Each role routes by the policy the roster's ``routing`` setting names for it
(docs/behaviour.md#routing-policies; the choices themselves are ``policies.py``). Round-robin
has one cursor per role that only ever advances (docs/behaviour.md#routing): a roster change or
an eviction shifts the list but never restarts the rotation at its head. The request being
routed is known through ``serving(affinity)``, a context variable: gevent gives every greenlet
its own, and the connectors that pick prefill need not carry the request through.
"""

from __future__ import annotations

import contextvars
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from epd_flask.control import settings as declared
from epd_flask.control.roster import Instance
from epd_flask.core import events
from epd_flask.core.errors import NoBackend
from epd_flask.fleet import policies
from epd_flask.fleet.kvaware import KVAware
from epd_flask.fleet.policies import Affinity, Decision
from epd_flask.fleet.registry import Registry

#: The request being routed in this greenlet, if any.
_CURRENT: contextvars.ContextVar[Affinity | None] = contextvars.ContextVar(
    "epd_routing_affinity", default=None)
AFFINITY_POLICIES = (policies.PREFIX, policies.KV_AWARE, policies.SESSION)
#: The share of a role's instances the conversations of one system prompt are kept on (see
#: ``policies.tiered_order``): half, so a few system prompts still cover the whole fleet.
SHARED_SPREAD = 0.5
#: The roles whose ``least_loaded`` load is prompt tokens in flight rather than calls: a
#: prefill's work is its prompt; a decode's or an encoder's is not.
TOKEN_ROLES = frozenset({"prefill"})


@contextmanager
def serving(affinity: Affinity) -> Iterator[Affinity]:
    """Route the picks made inside this block for the request ``affinity`` describes."""
    token = _CURRENT.set(affinity)
    try:
        yield affinity
    finally:
        _CURRENT.reset(token)


def current() -> Affinity | None:
    return _CURRENT.get()

CURSOR_SPREAD = 1 << 30
NO_BACKEND_MESSAGES = {
    "decode": "no live decode instance is available",
    "prefill": "no live prefill instance is available",
    "prefill_decode": "no live prefill_decode instance is available",
    "encode": "no live encode instance is available",
}


def no_backend(role: str, model: str | None = None) -> NoBackend:
    message = NO_BACKEND_MESSAGES.get(role, f"no live {role} instance is available")
    if model is not None:
        message = message.replace(" is available", f" serving model `{model}` is available")
    return NoBackend(message, stage=role)


class Router:
    """``start=None`` starts each role's cursor at a random position.

    gunicorn replaces every worker on a reload; cursors that all started at 0 would send the
    first request of each new worker to the same (first) instance after every change. Each
    worker starting somewhere random keeps the fleet's load even from the first request.
    """

    def __init__(self, registry: Registry, start: int | None = 0,
                 settings: Callable[[], Any] | None = None, kv: KVAware | None = None) -> None:
        self.registry = registry
        self.kv = kv
        self._start = start
        self._settings = settings
        self._cursors: dict[str, Iterator[int]] = {}
        self._replicas: dict[str, Iterator[int]] = {}
        # Power-of-two draws: seeded in a lone app (tests), system entropy under gunicorn.
        self._rng = random.Random(start) if start is not None else random.Random()

    def policy(self, role: str) -> str:
        routing = self._settings().routing if self._settings is not None else {}
        return str(routing.get(role, policies.ROUND_ROBIN))

    def load(self, instance: Instance) -> int:
        """This worker's upstream calls open on ``instance`` right now; on a prefill, the
        estimated prompt tokens of those calls (plus one per call): a prefill's wait is the
        tokens queued before it, and one long prompt outweighs many short ones, which a
        count of calls cannot see (docs/behaviour.md#routing-policies)."""
        state = self.registry.get(instance.url)
        if state is None:
            return 0
        if instance.role in TOKEN_ROLES:
            return state.in_flight + state.tokens_in_flight
        return state.in_flight

    def calls(self, instance: Instance) -> int:
        """This worker's upstream calls open on ``instance``: the load the affinity policies
        bound. Measured in the fleet model, a bound in prompt tokens made their tails no
        better (an affinity hit's prompt is mostly cached, which the estimate cannot see)."""
        state = self.registry.get(instance.url)
        return state.in_flight if state is not None else 0

    def pick(self, role: str, exclude: frozenset[str] = frozenset(), model: str | None = None,
             base: str | None = None) -> Instance:
        """A live instance of ``role`` serving ``model`` (docs/behaviour.md#models), chosen by
        the role's policy, skipping URLs in ``exclude`` when others exist."""
        live = self.registry.live(role, model, base)
        if not live:
            raise no_backend(role, model)
        preferred = [i for i in live if i.url not in exclude] or live
        affinity = _CURRENT.get()
        decision = self.decide(role, self.policy(role), preferred, affinity)
        if affinity is not None:
            affinity.decisions.append(decision.describe(role))
        events.routed.fire(role, decision.policy, decision.outcome, decision.instance.url)
        return decision.instance

    def decide(self, role: str, policy: str, candidates: list[Instance],
               affinity: Affinity | None) -> Decision:
        """``policy``'s choice among ``candidates`` (live, not excluded, non-empty).

        ``kv_aware`` starts from the prefix choice and lets the instances' cached blocks
        overrule it (``KVAware.decide``); ``session`` without a ``user`` falls back to the
        prefix key, which a conversation's turns share too.
        """
        if policy == policies.LEAST_LOADED:
            return policies.power_of_two(candidates, self.load, self._rng)
        if policy in AFFINITY_POLICIES and affinity is not None:
            key = affinity.session if policy == policies.SESSION else None
            fallback = key is None and policy == policies.SESSION
            key = key or affinity.prefix
            if key is not None:
                factor = self._settings().routing_load_factor if self._settings else \
                    declared.default("routing_load_factor")
                decision = policies.bounded_rendezvous(key, candidates, self.calls, factor,
                                                       policy, affinity.shared, SHARED_SPREAD)
                if policy == policies.KV_AWARE:
                    if self.kv is None:
                        return Decision(decision.instance, policy, policies.FALLBACK,
                                        "noevents," + decision.why)
                    return self.kv.decide(candidates, affinity, decision, self.calls, factor)
                if fallback:
                    return Decision(decision.instance, policy, decision.outcome,
                                    "prefix:" + decision.why)
                return decision
        n = next(self._cursor(role))
        outcome = policies.ROTATION if policy == policies.ROUND_ROBIN else policies.NOKEY
        return Decision(candidates[n % len(candidates)], policy, outcome, outcome)

    def pick_many(self, role: str, count: int, model: str | None = None) -> list[Instance]:
        """``count`` instances in rotation order, e.g. one encoder per media item.

        The cursor moves by ``count``, so the next request continues where this one stopped
        instead of starting again at the first instance.
        """
        live = self.registry.live(role, model)
        if not live:
            raise no_backend(role, model)
        if self.policy(role) == policies.LEAST_LOADED:
            # The calls open after all are picked: count this request's own picks as load.
            mine: Counter[str] = Counter()
            picked = []
            for _ in range(count):
                decision = policies.power_of_two(
                    live, lambda i: self.load(i) + mine[i.url], self._rng)
                mine[decision.instance.url] += 1
                events.routed.fire(role, decision.policy, decision.outcome,
                                   decision.instance.url)
                picked.append(decision.instance)
            return picked
        cursor = self._cursor(role)
        return [live[next(cursor) % len(live)] for _ in range(count)]

    def next_replica(self, instance: Instance) -> int:
        """The next data-parallel replica of ``instance``, round-robin per instance."""
        if instance.dp_size <= 1:
            return 0
        cursor = self._replicas.get(instance.url)
        if cursor is None:
            cursor = self._replicas[instance.url] = self._new_cursor()
        return next(cursor) % instance.dp_size

    def _cursor(self, role: str) -> Iterator[int]:
        cursor = self._cursors.get(role)
        if cursor is None:
            cursor = self._cursors[role] = self._new_cursor()
        return cursor

    def _new_cursor(self) -> Iterator[int]:
        start = self._start
        if start is None:
            start = random.SystemRandom().randrange(CURSOR_SPREAD)
        return itertools.count(start)
