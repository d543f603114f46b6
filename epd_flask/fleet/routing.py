"""Which candidate takes the next request of a role: the one routing path
(docs/behaviour.md#routing-policies).

Every choice goes through ``Router.pick`` (``pick_each`` for a request's media items): the
role's candidates come from its source (the live instances serving the model, or for a
Mooncake prefill the (prefill, rank) pairs its bootstrap discovery knows), the router keeps
those the attempt does not exclude and, with admission, of those the ones with room; the
role's policy chooses among them, and the caller's ``record`` hears the decision (the request
context writes it to the log line and the metrics). What a choice may depend on arrives as a
frozen ``RouteRequest``: nothing reaches a policy through a side channel.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from epd_flask.control import policyspecs
from epd_flask.control.roles import PREFILL
from epd_flask.control.roster import Instance, Settings
from epd_flask.core.errors import NoBackend
from epd_flask.core.tracing import RequestTrace
from epd_flask.fleet import policies
from epd_flask.fleet.kvaware import Tokenizer, held_tokens
from epd_flask.fleet.kvcache import Picture
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import Decision, Load, Placement, Policy, PolicyEnv, RouteRequest

#: The roles whose ``least_loaded`` load is prompt tokens in flight rather than calls: a
#: prefill's work is its prompt; a decode's or an encoder's is not.
TOKEN_ROLES = frozenset({PREFILL})
#: An engine read older than this many read intervals (or probe intervals, the longer) no
#: longer counts: the instance stopped answering its /metrics.
ENGINE_MAX_AGE = 3

Readiness = tuple[bool, str]
#: Hears every decision: (role, decision).
Record = Callable[[str, Decision], None]
#: Narrows a role's candidates that are not excluded to those a request should go to first
#: (admission's instances with room for it, ``fleet/saturation.py``); never to none.
Narrow = Callable[[str, RouteRequest, list[Placement]], list[Placement]]


class CandidateSource(Protocol):
    """Where a role's candidates come from."""

    def candidates(self, role: str, model: str | None, base: str | None) -> list[Placement]:
        """The role's candidates serving ``model`` (on ``base``); NoBackend when none."""

    def ready(self) -> Readiness:
        """Whether this source can give candidates yet (e.g. bootstrap discovery ran)."""


def no_backend(settings: Settings, role: str, model: str | None = None,
               what: str = "instance") -> NoBackend:
    """A stage with no live candidate: the roster's status and message for that, or a message
    naming the stage and the model (docs/behaviour.md#routing)."""
    serving = f" serving model `{model}`" if model is not None else ""
    message = settings.no_backend_message or f"no live {role} {what}{serving} is available"
    return NoBackend(message, stage=role, status=settings.no_backend_status)


class LiveInstances:
    """The default source: the registry's live instances of the role.

    Every pick asks, several times per request; the answer changes only with the registry's
    version (membership, liveness, models), so it is kept per (role, model, base) until then.
    """

    #: Distinct (role, model, base) answers kept: a fleet of many adapters stays bounded.
    MAX_KEPT = 256

    def __init__(self, live: LiveFleet) -> None:
        self.live = live
        self._version = -1
        self._kept: dict[tuple[str, str | None, str | None], list[Placement]] = {}

    def candidates(self, role: str, model: str | None, base: str | None) -> list[Placement]:
        registry = self.live.registry
        if registry.version != self._version or len(self._kept) >= self.MAX_KEPT:
            self._kept.clear()
            self._version = registry.version
        key = (role, model, base)
        found = self._kept.get(key)
        if found is None:
            live = registry.live(role, model, base)
            if not live:
                raise no_backend(self.live.settings, role, model)
            found = self._kept[key] = policies.candidates_of(live)
        return found

    def ready(self) -> Readiness:
        return True, "ok"


class Router:
    """One policy object per role (kept while the roster names the same policy, so a
    round-robin cursor survives reloads); ``seed`` makes choices repeatable (a lone app, tests),
    None draws a random start per worker."""

    def __init__(self, live: LiveFleet, sources: Mapping[str, CandidateSource] | None = None,
                 pictures: Callable[[str], Picture | None] | None = None,
                 no_pictures: Callable[[Sequence[str]], str] | None = None,
                 tokenizer: Tokenizer | None = None, seed: int | None = None,
                 narrow: Narrow | None = None) -> None:
        self.live = live
        self._default = LiveInstances(live)
        self._sources = dict(sources or {})
        self._narrow = narrow
        self.tokenizer = tokenizer
        self._seed = seed
        self._env = PolicyEnv(lambda: live.settings,
                              random.Random(seed) if seed is not None else random.Random(),
                              lambda: policies.new_cursor(self._seed),
                              pictures or (lambda url: None),
                              no_pictures or (lambda urls: "noevents"))
        self._policies: dict[str, Policy] = {}
        if tokenizer is not None:
            live.subscribe(lambda old, new: tokenizer.forget(new.urls()))

    def source(self, role: str) -> CandidateSource:
        return self._sources.get(role, self._default)

    def policy(self, role: str) -> Policy:
        name = str(self.live.settings.routing.get(role, policyspecs.DEFAULT))
        held = self._policies.get(role)
        if held is None or held.name != name:
            held = self._policies[role] = policies.build(name, self._env)
        return held

    def load(self, role: str) -> Load:
        """The requests each instance's engine holds: its last read queue (what every host
        and worker sent it) corrected by the proxies' calls since, or while no fresh read
        exists their open calls (``InstanceState.queue``). The proxies' calls are this host's,
        every worker's from the load board, so its workers see each other's at once, and
        with a load store the other hosts' as they last published them
        (``Registry.proxies``). On a prefill, weighed in prompt tokens: the proxies' calls by
        their estimated prompt tokens plus one each, the rest of the engine's queue (what no
        proxy published) by the mean estimate of this worker's calls: a prefill's wait is the
        tokens queued before it, and one long prompt outweighs many short ones, which a count
        of calls cannot see (docs/behaviour.md#routing-policies). The affinity policies bound
        requests: an affinity hit's prompt is mostly cached, which the estimate cannot
        see."""
        registry = self.live.registry
        settings = self.live.settings
        now = time.monotonic()
        max_age = ENGINE_MAX_AGE * max(settings.probe_interval, settings.engine_metrics_interval)

        def calls(inst: Instance) -> int:
            state = registry.get(inst.url)
            return state.queue(now, max_age, registry.proxies(inst.url)[0]) \
                if state is not None else 0

        if role not in TOKEN_ROLES:
            return Load(calls, calls)

        def tokens(inst: Instance) -> int:
            state = registry.get(inst.url)
            if state is None:
                return 0
            known, known_tokens = registry.proxies(inst.url)
            others = state.queue(now, max_age, known) - known
            return known + known_tokens + round(others * (1 + registry.mean_tokens))

        return Load(tokens, calls, tokens=True)

    def ready(self, role: str) -> Readiness:
        return self.source(role).ready()

    def _preferred(self, role: str, request: RouteRequest) -> list[Placement]:
        """The role's candidates less the attempt's exclusions (all of them when nothing
        else is left), then narrowed (``narrow``): a retry must leave the instance that
        failed even when the only other one is full (docs/behaviour.md#admission)."""
        found = self.source(role).candidates(role, request.model, request.base)
        allowed = [c for c in found if c.url not in request.exclude] or found
        return self._narrow(role, request, allowed) if self._narrow is not None else allowed

    def lightest(self, role: str, request: RouteRequest) -> int:
        """The least load (``load(role).measure``) among the candidates of ``role`` that would
        be offered ``request``; NoBackend when none is live."""
        measure = self.load(role).measure
        return min(measure(c.instance) for c in self._preferred(role, request))

    def pick(self, role: str, request: RouteRequest, record: Record) -> Placement:
        """A candidate of ``role`` chosen by its policy, told to ``record``."""
        decision = self.policy(role).choose(self._preferred(role, request), request,
                                            self.load(role))
        record(role, decision)
        return decision.target

    def pick_each(self, role: str, keys: Sequence[bytes], request: RouteRequest,
                  record: Record) -> list[Placement]:
        """One candidate per item (a request's media items, keyed by their content), each
        chosen by the role's policy with the items already placed counted as load: they are
        all sent at once."""
        candidates = self._preferred(role, request)
        policy = self.policy(role)
        base = self.load(role)
        mine: Counter[str] = Counter()
        load = Load(lambda i: base.measure(i) + mine[i.url], lambda i: base.calls(i) + mine[i.url],
                    base.tokens)
        picked = []
        for key in keys:
            decision = policy.choose(candidates, replace(request, prefix=key, shared=None,
                                                         session=None), load)
            record(role, decision)
            mine[decision.instance.url] += 1
            picked.append(decision.target)
        return picked

    def with_tokens(self, request: RouteRequest, roles: Iterable[str], body: dict[str, Any],
                    headers: dict[str, str] | None = None,
                    held_on: str | None = None,
                    trace: RequestTrace | None = None) -> RouteRequest:
        """``request`` with the prompt's token ids when a policy of ``roles`` would read them
        and some candidate could use them, or when some candidate of ``held_on`` has a cache
        picture (the caller will ask what it holds: ``held``); asked once per request, on the
        candidate the prompt's prefix ranks first (a span of the request's ``trace``)."""
        if request.tokens is not None or self.tokenizer is None:
            return request
        for role in roles:
            policy = self.policy(role)
            if not policy.needs_tokens:
                continue
            try:
                candidates = self._preferred(role, request)
            except NoBackend:
                continue
            if not policy.worth_tokens(candidates):
                continue
            return self._tokenized(request, candidates, body, headers, trace)
        if held_on is not None:
            try:
                candidates = self._preferred(held_on, request)
            except NoBackend:
                return request
            if any(self._env.pictures(c.url) is not None for c in candidates):
                return self._tokenized(request, candidates, body, headers, trace)
        return request

    def _tokenized(self, request: RouteRequest, candidates: Sequence[Placement],
                   body: dict[str, Any], headers: dict[str, str] | None,
                   trace: RequestTrace | None) -> RouteRequest:
        assert self.tokenizer is not None
        first = policies.rendezvous_order(request.prefix, candidates)[0] \
            if request.prefix is not None else candidates[0]
        return replace(request, tokens=self.tokenizer.tokens(body, first.instance, headers,
                                                             trace))

    def held(self, instance: Instance, request: RouteRequest) -> int | None:
        """How many of the request's prompt tokens ``instance``'s cache holds, from the
        first; None when that cannot be known (no picture, or no tokens)."""
        picture = self._env.pictures(instance.url)
        if picture is None or not request.tokens:
            return None
        return held_tokens(picture, request.tokens)
