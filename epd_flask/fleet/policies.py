"""Routing policies as pure functions: which of the candidates takes a request, and why
(docs/behaviour.md#routing-policies).

The affinity policies (``prefix``, ``session``) are rendezvous (highest-random-weight) hashing
with bounded load: every instance gets a score from a stable hash of (key, URL), the highest
score wins unless its load is over the bound, and then the next in score order takes it. The
order depends only on the key and the URLs, never on this process, so every worker on every
host makes the same choice with no coordination, and a joining or leaving instance moves only
the keys it wins or held (1/n of them). ``least_loaded`` is power-of-two-choices.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd_flask.control.roster import Instance

ROUND_ROBIN, LEAST_LOADED, PREFIX, KV_AWARE, SESSION = (
    "round_robin", "least_loaded", "prefix", "kv_aware", "session")
#: Decision outcomes, the metric's bounded label values.
ROTATION, LEAST, TIE, HIT, SPILL, NOKEY = "rotation", "least", "tie", "hit", "spill", "nokey"
#: ``kv_aware``'s outcomes: chosen by cached blocks; no instance holds any of the prompt's
#: blocks; no picture or no tokens to match (both of the last two take the prefix choice).
KVHIT, KVMISS, FALLBACK = "kvhit", "kvmiss", "fallback"


@dataclass
class Affinity:
    """What one request offers the affinity policies, computed once from its body.

    ``prefix``: a stable hash of the prompt's leading part (``fleet/affinity.py``);
    ``shared``: a hash of the part many conversations share (a chat's system prompt), or None;
    ``session``: a hash of the client's session identity (the ``user`` field), or None;
    ``prompt_tokens``: the prompt's estimated length. ``decisions`` collects one
    ``role:policy(why)`` per pick for the request's log line.
    """

    prefix: bytes | None = None
    shared: bytes | None = None
    session: bytes | None = None
    prompt_tokens: int = 0
    decisions: list[str] = field(default_factory=list)
    #: The body itself, for ``kv_aware``, which must know the prompt's tokens; ``tokens``
    #: holds them once known (``()`` when they cannot be), so a retry asks only once.
    body: dict[str, Any] | None = None
    tokens: Sequence[int] | None = None
    #: The request's upstream headers (credentials as its other calls carry them).
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class Decision:
    instance: Instance
    policy: str
    outcome: str
    why: str

    def describe(self, role: str) -> str:
        return f"{role}:{self.policy}({self.why})"


def score(key: bytes, url: str) -> int:
    """The rendezvous weight of ``url`` for ``key``: blake2b, the same in every process
    (Python's ``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + url.encode("utf-8"),
                                          digest_size=8).digest(), "big")


def rendezvous_order(key: bytes, candidates: Sequence[Instance]) -> list[Instance]:
    """``candidates`` from the highest weight for ``key`` to the lowest."""
    return sorted(candidates, key=lambda inst: (score(key, inst.url), inst.url), reverse=True)


def tiered_order(shared: bytes, key: bytes, candidates: Sequence[Instance],
                 spread: float) -> list[Instance]:
    """``key``'s rendezvous order within the ``spread`` share of the candidates that rank
    highest for ``shared``, then within the rest.

    Conversations that share a system prompt then share a few instances (each computes that
    prompt once) instead of all of them, while each conversation still has one home. Still a
    pure function of the keys and the URLs: the same everywhere, and a joining or leaving
    instance moves only what it wins or held in either tier.
    """
    tier = rendezvous_order(shared, candidates)
    size = max(1, math.ceil(spread * len(tier)))
    return rendezvous_order(key, tier[:size]) + rendezvous_order(key, tier[size:])


def load_bound(loads: Sequence[int], factor: float) -> int:
    """The most requests one instance may hold before the next one is placed elsewhere:
    ``ceil(factor * (total + 1) / n)``, consistent hashing with bounded loads (Mirrokni,
    Thorup, Zadimoghaddam, SODA 2018). Some instance is always under it."""
    return max(1, math.ceil(factor * (sum(loads) + 1) / max(1, len(loads))))


def bounded_rendezvous(key: bytes, candidates: Sequence[Instance],
                       load: Callable[[Instance], int], factor: float,
                       policy: str, shared: bytes | None = None,
                       spread: float = 1.0) -> Decision:
    """The first instance in ``key``'s rendezvous order (tiered by ``shared`` when given)
    whose load is under the bound."""
    order = rendezvous_order(key, candidates) if shared is None or spread >= 1.0 \
        else tiered_order(shared, key, candidates, spread)
    bound = load_bound([load(i) for i in candidates], factor)
    for rank, inst in enumerate(order):
        if load(inst) < bound:
            if rank == 0:
                return Decision(inst, policy, HIT, "hit")
            return Decision(inst, policy, SPILL, f"spill{rank}:{load(order[0])}>={bound}")
    return Decision(order[0], policy, HIT, "hit")  # unreachable: the bound leaves room


def power_of_two(candidates: Sequence[Instance], load: Callable[[Instance], int],
                 rng: random.Random) -> Decision:
    """The less loaded of two instances drawn at random (Mitzenmacher, "The power of two
    choices in randomized load balancing", 2001): near the best of all, without every
    worker herding onto the same least-loaded instance."""
    if len(candidates) == 1:
        return Decision(candidates[0], LEAST_LOADED, LEAST, "only")
    a, b = rng.sample(list(candidates), 2)
    la, lb = load(a), load(b)
    if la == lb:
        return Decision(a, LEAST_LOADED, TIE, f"tie:{la}")
    if lb < la:
        a, b, la, lb = b, a, lb, la
    return Decision(a, LEAST_LOADED, LEAST, f"{la}<{lb}")


def kv_choice(order: Sequence[Instance], matched: Mapping[str, int], blocks: int,
              load: Callable[[Instance], int], factor: float, fallback: Decision) -> Decision:
    """The instance holding the longest prefix of the prompt's ``blocks`` (``matched``: by
    URL, how many it holds from the first), among those under the same load bound as
    ``bounded_rendezvous``, so a hot prefix still spills over. ``order`` is the candidates
    in the request's rendezvous order: ties go to the prefix choice, then to the first in
    that order, so every worker breaks them alike; no block held anywhere: the prefix
    choice."""
    bound = load_bound([load(i) for i in order], factor)
    eligible = [i for i in order if load(i) < bound] or list(order)
    best = max(matched.get(i.url, 0) for i in eligible)
    if best == 0:
        return Decision(fallback.instance, KV_AWARE, KVMISS, f"blocks=0/{blocks},{fallback.why}")
    tied = [i for i in eligible if matched.get(i.url, 0) == best]
    chosen = next((i for i in tied if i.url == fallback.instance.url), tied[0])
    return Decision(chosen, KV_AWARE, KVHIT, f"blocks={best}/{blocks},load={load(chosen)}")
