"""The fleet benchmark's oracle: a routing policy that knows every simulated instance's cache
and queue exactly.

It holds a replica of each prefill simulator's prefix cache and engine clock
(``epd_flask/sim/kvcache.PrefixCache``, ``sim/costmodel.EngineClock``: the simulator's own
classes, configured as ``GET /sim/config`` says) and applies to it every prompt it routes
there, as the simulator will a few milliseconds later. It routes alone on its fleet (one
worker; the sims are reset before its first request), so the replica holds what the simulator
holds. A prefill goes where it would finish first: the work queued there plus the prompt's
tokens that cache does not hold, at its rate. A decode goes where the fewest of its calls are
open (the fewest streams run, so its steps are the shortest). Ties go to the prompt's
rendezvous order, as ``kv_aware``'s do. Asking the simulators at each choice instead would
make every choice wait for four busy Python processes (~100 ms on this machine under a burst),
which no router pays.

It runs inside epd-flask as any policy does (``gunicorn_bench.conf.py`` declares it as
``oracle``), so its requests pay the same proxy, ``/tokenize`` and legs as ``kv_aware``'s: its
TTFT is the best any routing decision can do on this fleet and trace, measured. Not a policy
to ship: it reads the simulator's configuration and copies its internals.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from epd_flask.control.roles import PREFILL
from epd_flask.fleet import policies
from epd_flask.fleet.policies import Decision, Load, Placement, Policy, RouteRequest
from epd_flask.sim.costmodel import EngineClock
from epd_flask.sim.kvcache import PrefixCache, block_hashes

TIMEOUT = 5.0


@dataclass
class Replica:
    """What one prefill simulator holds and has queued."""

    rate: float
    cache: PrefixCache
    clock: EngineClock = field(default_factory=EngineClock)

    @classmethod
    def of(cls, url: str) -> Replica:
        with urllib.request.urlopen(url + "/sim/config", timeout=TIMEOUT) as resp:
            config = json.loads(resp.read())
        return cls(float(config["prefill_tokens_per_s"]),
                   PrefixCache(int(config["kv_cache_blocks"]), int(config["block_size"])))

    def uncached(self, hashes: list[int], tokens: int) -> int:
        """The prompt's tokens this cache does not hold; as vLLM and the sim, the last token
        is always computed."""
        most = max(0, (tokens - 1) // self.cache.block_size)
        return tokens - min(self.cache.held(hashes), most) * self.cache.block_size

    def finish(self, hashes: list[int], tokens: int, now: float) -> float:
        return self.clock.backlog(now) + self.uncached(hashes, tokens) / (self.rate or 1e-9)


class Oracle(Policy):
    needs_tokens = True

    def __init__(self, name: str, env: policies.PolicyEnv) -> None:
        super().__init__(name, env)
        self._replicas: dict[str, Replica] = {}

    def worth_tokens(self, candidates: Sequence[Placement]) -> bool:
        return True

    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        order = policies.rendezvous_order(request.prefix, candidates) \
            if request.prefix is not None else list(candidates)
        if candidates[0].instance.role != PREFILL:
            chosen = min(order, key=lambda c: load.calls(c.instance))
            return Decision(chosen, self.name, "oracle", f"calls={load.calls(chosen.instance)}")
        for c in candidates:
            if c.url not in self._replicas:
                self._replicas[c.url] = Replica.of(c.url)
        tokens = list(request.tokens or ())
        # Nothing below yields to another greenlet: each choice sees the ones before it.
        now = time.monotonic()
        first = self._replicas[candidates[0].url].cache.block_size
        hashes = block_hashes(tokens, first)
        chosen = min(order, key=lambda c: self._replicas[c.url].finish(hashes, len(tokens), now))
        replica = self._replicas[chosen.url]
        finish = replica.finish(hashes, len(tokens), now)
        work = replica.uncached(hashes, len(tokens))
        replica.cache.insert_hashes(hashes, tokens)
        replica.clock.prefill(work, replica.rate, now)
        return Decision(chosen, self.name, "oracle", f"uncached={work},finish={finish:.3f}")
