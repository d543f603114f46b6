"""A simulated Mooncake prefill's book of KV transfers: each ``transfer_id`` it was asked to keep
KV for, on which engine (DP rank), for which prompt, and whether that KV is computed yet.

Keyed by the id alone, as a real engine's transfer table is: a second request with an id still
in the book takes the slot over, and a decode pulling that id gets whichever prompt's KV is
there (with real vLLM and Mooncake, a decode then generates from another request's KV).

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
    #: The prompt whose KV this transfer holds (the sim's stand-in for the KV blocks).
    prompt: str | None = None
    settled: Event = field(default_factory=Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "engine_id": self.engine_id,
                "rank": self.rank, "state": self.state, "prompt": self.prompt}


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

    def open(self, transfer_id: str, engine_id: str, rank: int, prompt: str | None = None) -> None:
        """Prefill got a request for ``transfer_id`` and computes ``prompt``'s KV on
        ``engine_id``."""
        slot = self._slot(transfer_id)
        slot.engine_id, slot.rank, slot.state, slot.prompt = engine_id, rank, PENDING, prompt

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
