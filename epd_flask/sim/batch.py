"""The engine's batch, as vLLM's scheduler keeps it: at most ``max_num_seqs`` requests run at
once (0: no bound), the others wait. vLLM's default policy (``fcfs``) takes waiting requests in
arrival order; ``--scheduling-policy priority`` takes the lowest ``priority`` first, then
arrival. A request that waits is not running: ``/metrics`` counts it in
``vllm:num_requests_waiting``, the rest in ``vllm:num_requests_running``. A client that hangs up
while its request waits takes it out of the queue, as vLLM aborts it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from gevent.event import Event

POLICIES = ("fcfs", "priority")
#: How often a waiting request looks whether its client is still there.
GONE_CHECK = 0.05


class Batch:
    def __init__(self) -> None:
        self.running = 0
        self._waiting: list[tuple[int, int, Event]] = []
        self._seq = itertools.count()
        self._left: set[Event] = set()

    @property
    def waiting(self) -> int:
        return len(self._waiting) - len(self._left)

    def acquire(self, limit: int, priority: int, policy: str,
                gone: Callable[[], bool]) -> bool:
        """Wait for a place in the batch; False if the client left meanwhile."""
        if limit <= 0 or (self.running < limit and not self.waiting):
            self.running += 1
            return True
        event = Event()
        rank = priority if policy == "priority" else 0
        heapq.heappush(self._waiting, (rank, next(self._seq), event))
        while not event.wait(GONE_CHECK):
            # A wait that timed out in the same turn of the loop as ``release`` granted it says
            # False with the place already counted as running: the place is this request's.
            if event.is_set():
                break
            if gone():
                self._left.add(event)
                return False
        return True

    def release(self, limit: int) -> None:
        self.running -= 1
        while self._waiting and (limit <= 0 or self.running < limit):
            _, _, event = heapq.heappop(self._waiting)
            if event in self._left:
                self._left.discard(event)
                continue
            self.running += 1
            event.set()
