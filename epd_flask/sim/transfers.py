"""A simulated Mooncake prefill's book of KV transfers: each ``transfer_id`` it was asked to keep
KV for, on which engine (DP rank), and whether that KV is computed yet.

Decode may ask before prefill has even seen the request (the proxy starts both legs at once), so
a waiter can open the slot first; prefill fills it in, and settling it wakes every waiter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gevent.event import Event

#: Transfers remembered per prefill; the oldest are forgotten first.
MAX_TRANSFERS = 4096

UNKNOWN = "unknown"
PENDING = "pending"
READY = "ready"
ABORTED = "aborted"


@dataclass
class Transfer:
    transfer_id: str
    engine_id: str | None = None
    rank: int | None = None
    state: str = UNKNOWN
    settled: Event = field(default_factory=Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "engine_id": self.engine_id,
                "rank": self.rank, "state": self.state}


class TransferBook:
    def __init__(self, limit: int = MAX_TRANSFERS) -> None:
        self._limit = limit
        self._items: OrderedDict[str, Transfer] = OrderedDict()

    def _slot(self, transfer_id: str) -> Transfer:
        slot = self._items.get(transfer_id)
        if slot is None:
            slot = self._items[transfer_id] = Transfer(transfer_id)
            while len(self._items) > self._limit:
                _, old = self._items.popitem(last=False)
                old.settled.set()  # nobody waits forever on a forgotten slot
        return slot

    def open(self, transfer_id: str, engine_id: str, rank: int) -> None:
        """Prefill got a request for ``transfer_id`` and computes its KV on ``engine_id``."""
        slot = self._slot(transfer_id)
        slot.engine_id, slot.rank, slot.state = engine_id, rank, PENDING

    def settle(self, transfer_id: str, ok: bool) -> None:
        """The KV is computed (``ok``) or never will be (the request was aborted)."""
        slot = self._slot(transfer_id)
        slot.state = READY if ok else ABORTED
        slot.settled.set()

    def wait(self, transfer_id: str, timeout: float) -> dict[str, Any]:
        """The transfer once settled, or as it stands after ``timeout`` seconds."""
        slot = self._slot(transfer_id)
        slot.settled.wait(timeout)
        return slot.as_dict()

    def clear(self) -> None:
        for slot in self._items.values():
            slot.settled.set()
        self._items.clear()
