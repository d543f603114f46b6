"""Embeddings encoders have published, where a language model's EC connector looks them up.

Real ECExampleConnector shares a directory between the encoder and the language model, keyed
by the item's mm_hash. Here the sims of one process share an in-memory store per fleet secret
(sims started separately share nothing, so a language model there encodes media itself). The
store keeps the metadata published with each key, so a reference sized differently is caught.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

#: Keys kept per fleet; the oldest go first, as an encoder cache evicts.
MAX_KEYS = 100_000

_STORES: dict[str, OrderedDict[str, Any]] = {}


def publish(fleet: str, key: str, metadata: Any) -> None:
    store = _STORES.setdefault(fleet, OrderedDict())
    store[key] = metadata
    store.move_to_end(key)
    while len(store) > MAX_KEYS:
        store.popitem(last=False)


def lookup(fleet: str, key: str | None) -> tuple[bool, Any]:
    """``(found, metadata)`` for ``key`` in ``fleet``'s store."""
    store = _STORES.get(fleet)
    if key is None or store is None or key not in store:
        return False, None
    return True, store[key]
