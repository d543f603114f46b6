"""Who goes next when capacity frees (docs/behaviour.md#admission): strict priority between
classes (``high``, then ``normal``, then ``low``), and within a class weighted fair sharing
among its tenants.

Fair sharing is start-time fair queueing's bookkeeping with finish tags: a waiting request of
tenant t with cost c (one request, or its tokens) gets ``start = max(V, last finish of t)`` and
``finish = start + c / weight(t)``; the smallest finish goes first and ``V`` moves to its
start. Two tenants that both keep requests waiting are served in the ratio of their weights;
a tenant that waited for nothing builds no credit (its next request starts at ``V``), and a
tenant alone takes every free place. When the queue is full, the request that would be
served last is the one pushed out (``last_served``, ``goes_before``). Plain data, no clock, no
greenlets.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from epd_flask.control.settings import PRIORITIES

#: A class's place in the order: lower goes first.
RANK = {name: n for n, name in enumerate(PRIORITIES)}

_seq = itertools.count()


@dataclass(eq=False)
class Waiter:
    """One request waiting for capacity; ``done`` once it was let through or left."""

    tenant: str
    rank: int
    cost: float
    payload: Any = None
    start: float = 0.0
    finish: float = 0.0
    seq: int = field(default_factory=lambda: next(_seq))
    done: bool = False


class _Class:
    """The waiting requests of one class."""

    def __init__(self) -> None:
        self.vtime = 0.0
        self.last: dict[str, float] = {}
        self.heap: list[tuple[float, int, Waiter]] = []
        #: The same waiters, last to be served on top (for a full queue's push-out).
        self.tail: list[tuple[float, int, Waiter]] = []
        self.size = 0

    def tag(self, tenant: str, cost: float, weight: float) -> float:
        """The finish tag a request of ``tenant`` would get now."""
        return max(self.vtime, self.last.get(tenant, 0.0)) + cost / weight

    def push(self, waiter: Waiter, weight: float) -> None:
        waiter.start = max(self.vtime, self.last.get(waiter.tenant, 0.0))
        waiter.finish = waiter.start + waiter.cost / weight
        self.last[waiter.tenant] = waiter.finish
        heapq.heappush(self.heap, (waiter.finish, waiter.seq, waiter))
        heapq.heappush(self.tail, (-waiter.finish, -waiter.seq, waiter))
        self.size += 1

    def last_served(self) -> Waiter | None:
        """The waiting request that would go last."""
        while self.tail and self.tail[0][2].done:
            heapq.heappop(self.tail)
        return self.tail[0][2] if self.tail else None

    def pop(self) -> Waiter | None:
        while self.heap:
            _, _, waiter = heapq.heappop(self.heap)
            if waiter.done:
                continue
            self.size -= 1
            self.vtime = max(self.vtime, waiter.start)
            if not self.size:
                self._forget()
            return waiter
        return None

    def remove(self, waiter: Waiter) -> None:
        """``waiter`` left before its turn: its place is given back (when it was its
        tenant's latest) and dropped from the heap when it comes up."""
        self.size -= 1
        if self.last.get(waiter.tenant) == waiter.finish:
            self.last[waiter.tenant] = waiter.start
        if not self.size:
            self._forget()

    def _forget(self) -> None:
        """Nobody waits: no history is worth keeping (a new backlog starts even)."""
        self.vtime = 0.0
        self.last.clear()
        self.heap.clear()
        self.tail.clear()


class FairQueue:
    """The waiting requests of one pool of capacity, by class."""

    def __init__(self) -> None:
        self._classes = [_Class() for _ in PRIORITIES]

    def __len__(self) -> int:
        return sum(c.size for c in self._classes)

    def push(self, waiter: Waiter, weight: float) -> None:
        self._classes[waiter.rank].push(waiter, weight)

    def pop(self) -> Waiter | None:
        """The next request to let through: the best class first, then the smallest
        finish tag."""
        for cls in self._classes:
            if cls.size:
                waiter = cls.pop()
                if waiter is not None:
                    waiter.done = True
                    return waiter
        return None

    def remove(self, waiter: Waiter) -> None:
        if not waiter.done:
            waiter.done = True
            self._classes[waiter.rank].remove(waiter)

    def last_served(self) -> Waiter | None:
        """The waiting request that would go last: the worst class's largest finish tag."""
        for cls in reversed(self._classes):
            if cls.size:
                return cls.last_served()
        return None

    def goes_before(self, rank: int, tenant: str, cost: float, weight: float,
                    other: Waiter) -> bool:
        """Whether a request of ``tenant`` in class ``rank`` arriving now would be served
        before ``other`` (a waiter of this queue)."""
        if rank != other.rank:
            return rank < other.rank
        return self._classes[rank].tag(tenant, cost, weight) < other.finish

    def best_rank(self) -> int:
        """The best class with a request waiting (len(PRIORITIES) when none)."""
        return next((n for n, c in enumerate(self._classes) if c.size), len(PRIORITIES))
