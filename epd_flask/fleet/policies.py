"""Routing policies: which of the candidates takes a request, and why
(docs/behaviour.md#routing-policies).

A policy is a class with one method, ``choose``, declared by name in
``control/policyspecs.py``; the router keeps one instance per role and worker and hands it the
role's candidates, the attempt's ``RouteRequest`` and how busy each candidate is. Everything a
choice depends on arrives as an argument: a policy reads nothing else of the request.

The affinity policies (``prefix``, ``session``) are rendezvous (highest-random-weight) hashing
with bounded load: every candidate gets a score from a stable hash of (key, candidate), the
highest score wins unless its load is over the bound, and then the next in score order takes
it. The order depends only on the key and the candidates, never on this process, so every
worker on every host makes the same choice with no coordination, and a joining or leaving
instance moves only the keys it wins or held (1/n of them). ``least_loaded`` is
power-of-two-choices.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from epd_flask.control import policyspecs
from epd_flask.control.roster import Instance, Settings
from epd_flask.fleet.kvcache import Picture

#: Decision outcomes, the metric's bounded label values.
ROTATION, LEAST, TIE, HIT, SPILL, NOKEY = "rotation", "least", "tie", "hit", "spill", "nokey"
#: ``kv_aware``'s outcomes: chosen by cached blocks; no instance holds any of the prompt's
#: blocks; no picture or no tokens to match (both of the last two take the prefix choice).
KVHIT, KVMISS, FALLBACK = "kvhit", "kvmiss", "fallback"
#: The share of a role's instances the conversations of one system prompt are kept on (see
#: ``tiered_order``): half, so a few system prompts still cover the whole fleet.
SHARED_SPREAD = 0.5


@dataclass(frozen=True)
class Placement:
    """One candidate: an instance and, where the request must name one, the data-parallel
    rank it runs on (with the engine id that rank announced, for Mooncake)."""

    instance: Instance
    dp_rank: int | None = None
    engine_id: str | None = None

    @property
    def url(self) -> str:
        return self.instance.url

    @property
    def key(self) -> str:
        """What the affinity policies hash: one rank of an instance is its own cache."""
        return self.instance.url if self.dp_rank is None \
            else f"{self.instance.url}#{self.dp_rank}"


@dataclass(frozen=True)
class RouteRequest:
    """What one attempt of a request offers routing: computed once from its body
    (``fleet/affinity.py``), then narrowed per attempt and per stage.

    ``prefix``: a stable hash of the prompt's leading part; ``shared``: a hash of the part many
    conversations share (a chat's system prompt), or None; ``session``: a hash of the client's
    session identity, or None; ``prompt_tokens``: the prompt's estimated length; ``tokens``:
    its token ids once known (None: not asked; empty: they cannot be known); ``model`` and
    ``base``: what every candidate must serve (docs/behaviour.md#models); ``exclude``: URLs a
    failed attempt left, avoided while others exist; ``keep``: the places of each instance
    with ``max_concurrency`` the request leaves free (admission's reserve for a better class,
    docs/behaviour.md#admission); ``rank``: the request's class when routing keeps it apart
    from the unanswered prompts of its class and better ones (admission with
    ``forward_priority``, docs/behaviour.md#admission), None when nothing is kept apart.
    """

    model: str | None = None
    base: str | None = None
    exclude: frozenset[str] = frozenset()
    prefix: bytes | None = None
    shared: bytes | None = None
    session: bytes | None = None
    prompt_tokens: int = 0
    tokens: tuple[int, ...] | None = None
    keep: int = 0
    rank: int | None = None


@dataclass(frozen=True)
class Load:
    """How busy each instance is, as this worker sees it: ``measure`` what ``least_loaded``
    compares, ``calls`` the open calls the affinity policies bound; ``tokens``: whether
    ``measure`` counts prompt tokens (a prefill's queue), so a prompt's own tokens add to it."""

    measure: Callable[[Instance], int]
    calls: Callable[[Instance], int]
    tokens: bool = False


@dataclass(frozen=True)
class Decision:
    target: Placement
    policy: str
    outcome: str
    why: str

    @property
    def instance(self) -> Instance:
        return self.target.instance

    def describe(self, role: str) -> str:
        return f"{role}:{self.policy}({self.why})"


@dataclass(frozen=True)
class PolicyEnv:
    """What every policy of one worker shares: the live settings, its random source, where
    round-robin cursors start, and the KV-cache pictures (``kv_aware``)."""

    settings: Callable[[], Settings]
    rng: random.Random
    new_cursor: Callable[[], Iterator[int]]
    pictures: Callable[[str], Picture | None] = lambda url: None
    #: Why none of these instances has a picture (``noevents``, ``stale``): the fallback's why.
    no_pictures: Callable[[Sequence[str]], str] = lambda urls: "noevents"


class Policy:
    """The common ground of a policy; ``name`` is the name the roster used for it."""

    #: Whether ``choose`` reads ``RouteRequest.tokens`` (the router then asks for them once
    #: per request, when ``worth_tokens`` says some candidate could use them).
    needs_tokens: ClassVar[bool] = False

    def __init__(self, name: str, env: PolicyEnv) -> None:
        self.name = name
        self.env = env

    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        """One of ``candidates`` (live, serving the model, not excluded, never empty)."""
        raise NotImplementedError

    def worth_tokens(self, candidates: Sequence[Placement]) -> bool:
        return False


def build(name: str, env: PolicyEnv) -> Policy:
    """The policy ``name`` as ``control/policyspecs.py`` declares it."""
    try:
        spec = policyspecs.POLICIES[name]
    except KeyError:
        raise ValueError(f"routing policy {name!r} is not available in this build; choose one "
                         f"of {', '.join(sorted(policyspecs.POLICIES))}") from None
    module, _, attr = spec.partition(":")
    cls: type[Policy] = getattr(importlib.import_module(module), attr)
    return cls(name, env)


class RoundRobin(Policy):
    """One cursor that only advances (docs/behaviour.md#routing): a roster change or an
    eviction shifts the list but never restarts the rotation at its head."""

    def __init__(self, name: str, env: PolicyEnv) -> None:
        super().__init__(name, env)
        self._cursor = env.new_cursor()

    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        return self.rotate(candidates, ROTATION)

    def rotate(self, candidates: Sequence[Placement], outcome: str) -> Decision:
        return Decision(candidates[next(self._cursor) % len(candidates)], self.name, outcome,
                        outcome)


class LeastLoaded(Policy):
    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        return power_of_two(candidates, load.measure, self.env.rng, self.name)


class Prefix(RoundRobin):
    """Keyed by the prompt's prefix; a request without one rotates (``nokey``)."""

    def key(self, request: RouteRequest) -> tuple[bytes | None, str]:
        return request.prefix, ""

    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        key, note = self.key(request)
        if key is None:
            return self.rotate(candidates, NOKEY)
        decision = bounded_rendezvous(key, candidates, load.calls,
                                      self.env.settings().routing_load_factor, self.name,
                                      request.shared, SHARED_SPREAD)
        if note:
            return Decision(decision.target, self.name, decision.outcome,
                            note + decision.why)
        return decision


class Session(Prefix):
    """Keyed by the client's session; without one, by the prefix key, which a conversation's
    turns share too."""

    def key(self, request: RouteRequest) -> tuple[bytes | None, str]:
        if request.session is not None:
            return request.session, ""
        return request.prefix, "prefix:"


def score(key: bytes, candidate: str) -> int:
    """The rendezvous weight of ``candidate`` (a URL, or URL#rank) for ``key``: blake2b, the
    same in every process (Python's ``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + candidate.encode("utf-8"),
                                          digest_size=8).digest(), "big")


def rendezvous_order(key: bytes, candidates: Sequence[Placement]) -> list[Placement]:
    """``candidates`` from the highest weight for ``key`` to the lowest."""
    return sorted(candidates, key=lambda c: (score(key, c.key), c.key), reverse=True)


def tiered_order(shared: bytes, key: bytes, candidates: Sequence[Placement],
                 spread: float) -> list[Placement]:
    """``key``'s rendezvous order within the ``spread`` share of the candidates that rank
    highest for ``shared``, then within the rest.

    Conversations that share a system prompt then share a few instances (each computes that
    prompt once) instead of all of them, while each conversation still has one home. Still a
    pure function of the keys and the candidates: the same everywhere, and a joining or
    leaving instance moves only what it wins or held in either tier.
    """
    tier = rendezvous_order(shared, candidates)
    size = max(1, math.ceil(spread * len(tier)))
    return rendezvous_order(key, tier[:size]) + rendezvous_order(key, tier[size:])


def load_bound(loads: Sequence[int], factor: float) -> int:
    """The most requests one instance may hold before the next one is placed elsewhere:
    ``ceil(factor * (total + 1) / n)``, consistent hashing with bounded loads (Mirrokni,
    Thorup, Zadimoghaddam, SODA 2018). Some instance is always under it."""
    return max(1, math.ceil(factor * (sum(loads) + 1) / max(1, len(loads))))


def bounded_rendezvous(key: bytes, candidates: Sequence[Placement],
                       load: Callable[[Instance], int], factor: float,
                       policy: str, shared: bytes | None = None,
                       spread: float = 1.0) -> Decision:
    """The first candidate in ``key``'s rendezvous order (tiered by ``shared`` when given)
    whose load is under the bound."""
    order = rendezvous_order(key, candidates) if shared is None or spread >= 1.0 \
        else tiered_order(shared, key, candidates, spread)
    loads = {c.key: load(c.instance) for c in candidates}
    bound = load_bound(list(loads.values()), factor)
    for rank, placed in enumerate(order):
        if loads[placed.key] < bound:
            if rank == 0:
                return Decision(placed, policy, HIT, "hit")
            return Decision(placed, policy, SPILL, f"spill{rank}:{loads[order[0].key]}>={bound}")
    return Decision(order[0], policy, HIT, "hit")  # unreachable: the bound leaves room


def power_of_two(candidates: Sequence[Placement], load: Callable[[Instance], int],
                 rng: random.Random, policy: str = "least_loaded") -> Decision:
    """The less loaded of two candidates drawn at random (Mitzenmacher, "The power of two
    choices in randomized load balancing", 2001): near the best of all, without every
    worker herding onto the same least-loaded instance."""
    if len(candidates) == 1:
        return Decision(candidates[0], policy, LEAST, "only")
    a, b = rng.sample(list(candidates), 2)
    la, lb = load(a.instance), load(b.instance)
    if la == lb:
        return Decision(a, policy, TIE, f"tie:{la}")
    if lb < la:
        a, b, la, lb = b, a, lb, la
    return Decision(a, policy, LEAST, f"{la}<{lb}")


def kv_choice(order: Sequence[Placement], matched: Mapping[str, int], blocks: int,
              load: Callable[[Instance], int], factor: float, fallback: Decision,
              policy: str = "kv_aware") -> Decision:
    """The candidate holding the longest prefix of the prompt's ``blocks`` (``matched``: by
    URL, how many it holds from the first), among those under the same load bound as
    ``bounded_rendezvous``, so a hot prefix still spills over. ``order`` is the candidates
    in the request's rendezvous order: ties go to the prefix choice, then to the first in
    that order, so every worker breaks them alike; no block held anywhere: the prefix
    choice. Each load is read once: another worker's calls may change it between two reads."""
    loads = {c.key: load(c.instance) for c in order}
    bound = load_bound(list(loads.values()), factor)
    eligible = [c for c in order if loads[c.key] < bound] or list(order)
    best = max(matched.get(c.url, 0) for c in eligible)
    if best == 0:
        return Decision(fallback.target, policy, KVMISS, f"blocks=0/{blocks},{fallback.why}")
    tied = [c for c in eligible if matched.get(c.url, 0) == best]
    chosen = next((c for c in tied if c == fallback.target), tied[0])
    return Decision(chosen, policy, KVHIT, f"blocks={best}/{blocks},load={loads[chosen.key]}")


def kv_cost_choice(order: Sequence[Placement], matched: Mapping[str, int],
                   sizes: Mapping[str, int], blocks: int, tokens: int,
                   load: Callable[[Instance], int], fallback: Decision,
                   policy: str = "kv_aware") -> Decision:
    """``kv_aware`` on a role whose load is prompt tokens (a prefill): the candidate where the
    prompt would be done first as far as this worker can tell, the prompt tokens queued there
    (``load``) plus the prompt's ``tokens`` it does not hold (``matched``: by URL, how many of
    the prompt's ``blocks`` it holds from the first, of ``sizes`` tokens each). A cached prefix
    is worth the tokens it saves and no more: a long queue outweighs a few held blocks, which
    a count of calls under a bound cannot see. Ties go to the prefix choice, then to the first
    in ``order`` (the request's rendezvous order), so every worker breaks them alike. Each
    load is read once: a sibling worker's calls may change it between two reads."""
    loads = {c.key: load(c.instance) for c in order}
    costs = {c.key: loads[c.key] + tokens - matched.get(c.url, 0) * sizes.get(c.url, 0)
             for c in order}
    best = min(costs.values())
    tied = [c for c in order if costs[c.key] == best]
    chosen = next((c for c in tied if c == fallback.target), tied[0])
    held = matched.get(chosen.url, 0)
    return Decision(chosen, policy, KVHIT if held else KVMISS,
                    f"blocks={held}/{blocks},load={loads[chosen.key]}")


def new_cursor(seed: int | None) -> Iterator[int]:
    """A round-robin cursor: from 0 with a seed (a lone app, tests), else from a random place,
    so the workers a reload starts together do not all send their first request to the
    same instance."""
    start = 0 if seed is not None else random.SystemRandom().randrange(CURSOR_SPREAD)
    return itertools.count(start)


CURSOR_SPREAD = 1 << 30


def candidates_of(instances: Sequence[Instance]) -> list[Placement]:
    """Instances as candidates: one per instance, or one per replica for an instance whose
    replicas must be named (encoders push embeddings to one: ``ec_zmq_addrs``)."""
    out: list[Placement] = []
    for inst in instances:
        if inst.ec_zmq_addrs:
            out.extend(Placement(inst, rank) for rank in range(inst.dp_size))
        else:
            out.append(Placement(inst))
    return out
