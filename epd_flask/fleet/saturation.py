"""When an instance is full, and whether a request of a role could go out now
(docs/behaviour.md#admission).

An instance with a roster ``max_concurrency`` is full when the requests this proxy host has
running on it (every worker's, ``loadboard.py``) reach it: an exact count, changed the moment
a request starts or ends. One without is full when its engine's queue (vLLM's
``vllm:num_requests_waiting``, read by the prober: the one signal every proxy host shares)
holds ``ENGINE_WAITING_FULL`` or more. The engine's figure is as old as its last read (up to
``engine_metrics_interval``) and does not say how fast it drains: an engine read with a
backlog of prefills to start held every request of a bounded instance back for a second after
each read (the benchmark's interactive tenant waited 0.73 s at the median instead of 0.15 s),
so where the operator gave a bound, the bound decides. Among the instances an attempt may use,
routing prefers those that are not full (``Capacity.roomy``, the router's last narrowing) and,
for a class the engines compute first, those with the least of its class's prompts still
unanswered (``Capacity.apart``); admission holds a request back while every candidate of a role
it needs is full.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from epd_flask.control.roster import ADMITTED_ROLES, Instance, admits
from epd_flask.fleet.live import FleetView, LiveFleet
from epd_flask.fleet.loadboard import UNANSWERED, UNANSWERED_CALLS, UNANSWERED_SINCE, LoadBoard
from epd_flask.fleet.policies import Placement, RouteRequest
from epd_flask.fleet.registry import InstanceState
from epd_flask.fleet.routing import ENGINE_MAX_AGE

#: An engine with this many requests waiting is full. vLLM puts every new request in its
#: waiting queue until its next step schedules it, so one or two waiting are the ordinary
#: traffic of a busy engine, not saturation; four means a step's arrivals found no room (its
#: batch or its KV cache is full), and from there each request sent waits first come, first
#: served behind the others, whatever its tenant.
ENGINE_WAITING_FULL = 4

#: Unanswered prompt tokens within this factor of the fewest count as as many: an estimate of
#: UTF-8 bytes / 4 is off by more than that between two texts of one length in tokens.
AS_MANY = 1.25

#: An instance's engine queue as this worker knows it (None: not known).
Waiting = Callable[[InstanceState], int | None]


def engine_waiting(live: LiveFleet) -> Waiting:
    """The engine's waiting queue as the prober last read it (``vllm:num_requests_waiting``),
    while that read is fresh (as routing's load takes it), corrected by the proxies' calls
    opened or closed since (``Registry.proxies``) when the engine was queueing then: a call
    sent to a queueing engine waits, one that ends lets a waiting request run. An engine that
    queued nothing at its last read counts as not queueing until the next one: most calls
    sent meanwhile run."""
    def waiting(state: InstanceState) -> int | None:
        engine, read_at = state.engine, state.engine_read_at
        if engine is None or read_at is None:
            return None
        settings = live.settings
        max_age = ENGINE_MAX_AGE * max(settings.probe_interval, settings.engine_metrics_interval)
        if time.monotonic() - read_at > max_age:
            return None
        if engine.waiting <= 0:
            return 0
        calls = live.registry.proxies(state.instance.url)[0]
        return max(0, engine.waiting + calls - state.engine_calls_at_read)
    return waiting


def engine_full(waiting: int | None) -> bool:
    """Whether an engine with ``waiting`` requests in its queue takes no more now."""
    return waiting is not None and waiting >= ENGINE_WAITING_FULL


class Capacity:
    """Reads the host's load (the board) and the engines' queues against the roster."""

    def __init__(self, live: LiveFleet, board: LoadBoard, waiting: Waiting | None = None) -> None:
        self.live = live
        self.board = board
        self.waiting = waiting if waiting is not None else engine_waiting(live)
        self._view: FleetView | None = None
        self._active = False

    @property
    def active(self) -> bool:
        """Whether anything is counted at all: the roster configures admission, names
        tenants or bounds an instance (otherwise routing and serving are as without it)."""
        view = self.live.view
        if view is not self._view:
            self._view = view
            self._active = admits(view.settings, view.tenants, view.instances)
        return self._active

    def full(self, inst: Instance, keep: int = 0) -> bool:
        """Whether ``inst`` takes no more now, for a request that leaves ``keep`` places of
        a bounded instance free."""
        cap = inst.max_concurrency
        if cap is not None:
            return self.board.count(inst.url) >= cap - keep
        state = self.live.registry.get(inst.url)
        return state is not None and engine_full(self.waiting(state))

    def room(self, role: str, model: str | None, reserved: int = 0, keep: int = 0) -> bool:
        """Whether a request of ``role`` for ``model`` could go out now, with ``reserved``
        requests of this worker already let through for it and not yet routed, leaving
        ``keep`` places of each bounded instance free (held for a better class). A role
        with no live instance has room: the pipeline answers ``no_backend`` at once."""
        free = 0
        candidates = False
        waiting, count = self.waiting, self.board.count
        for state in self.live.registry.states():
            inst = state.instance
            if not state.live or inst.role != role or not state.serves(model):
                continue
            candidates = True
            if inst.max_concurrency is None:
                if not engine_full(waiting(state)):
                    return True
                continue
            free += max(0, inst.max_concurrency - count(inst.url) - keep)
            if free > reserved:
                return True
        return not candidates

    def roomy(self, role: str, request: RouteRequest,
              found: list[Placement]) -> list[Placement]:
        """``found`` (a role's candidates an attempt may use) without the full ones (for a
        request that leaves ``request.keep`` places free), while any is not: a request let
        through goes where there is room. Applied after the attempt's exclusions, so a retry
        leaves a failed instance for a full one rather than going back to it
        (docs/behaviour.md#admission)."""
        if role not in ADMITTED_ROLES or len(found) < 2 or not self.active:
            return found
        full, keep = self.full, request.keep
        found = [c for c in found if not full(c.instance, keep)] or found
        return self.apart(found, request.rank) if request.rank is not None else found

    def unanswered(self, url: str, rank: int) -> tuple[int, float]:
        """The estimated prompt tokens of this host's requests of class ``rank`` or better
        routed to ``url`` whose answer has not begun, and the mean time (ms) they were routed
        (0 when there are none)."""
        counts = self.board.counts(url)
        tokens = sum(counts[field] for field in UNANSWERED[:rank + 1])
        calls = sum(counts[field] for field in UNANSWERED_CALLS[:rank + 1])
        since = sum(counts[field] for field in UNANSWERED_SINCE[:rank + 1])
        return tokens, since / calls if calls else 0.0

    def apart(self, found: list[Placement], rank: int) -> list[Placement]:
        """Those of ``found`` with the fewest unanswered prompt tokens of class ``rank`` or
        better: an engine that computes better classes first (vLLM's priority scheduling)
        makes a request wait for those prompts only, which a policy's load (every call,
        whatever its class) does not show. Two interactive requests a few milliseconds
        apart then go to two engines instead of one waiting for the other's prefill.
        Engines with prompts waiting differ in how far they are through them: the estimates
        (UTF-8 bytes / 4) are no finer than ``AS_MANY``, so among those within it of the
        fewest, those whose unanswered requests were routed earliest on average, where the
        newcomer's prefill starts first (docs/behaviour.md#admission, rule 14)."""
        if len(found) < 2 or rank >= len(UNANSWERED):
            return found
        ahead = {c.url: self.unanswered(c.url, rank) for c in found}
        least = min(tokens for tokens, _ in ahead.values())
        if least == 0:
            return [c for c in found if ahead[c.url][0] == 0]
        found = [c for c in found if ahead[c.url][0] <= least * AS_MANY]
        earliest = min(ahead[c.url][1] for c in found)
        return [c for c in found if ahead[c.url][1] == earliest]
