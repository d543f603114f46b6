"""A prefill's memory of what it has computed: vLLM's automatic prefix caching over the sim's
token ids (chained hashes of ``block_size``-token blocks, bounded, least recently used first
out), the KV-cache events that memory makes (kvevents.py), and the block ids it hands out.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from typing import Any

from . import kvevents, textgen

#: vLLM's default block size on GPU; its CPU build needs a multiple of 32.
DEFAULT_BLOCK_SIZE = 16
#: Enough blocks for thousands of distinct prompts; the oldest are forgotten first.
MAX_CACHED_BLOCKS = 65536  # the default; SimConfig.kv_cache_blocks sets it
MAX_BLOCK_ID = 1 << 20


#: vLLM's NONE_HASH, the parent of a first block: sha256 of the default seed (pickled) when
#: PYTHONHASHSEED is unset (vllm/v1/core/kv_cache_utils.py, init_none_hash).
NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
MASK_64 = (1 << 64) - 1


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hashes of the full blocks of ``token_ids`` exactly as vLLM 0.32 computes them with
    its default ``--prefix-caching-hash-algo sha256`` (sha256 of the pickled ``(parent hash,
    block's ids, extra keys)``) and publishes them (the low 64 bits, as an int), so a router
    that rebuilds vLLM's hashes from a prompt's token ids finds the sim's blocks."""
    hashes = []
    parent = NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start:start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=5)).digest()
        hashes.append(int.from_bytes(parent, "big") & MASK_64)
    return hashes


class PrefixCache:
    """Blocks by chained hash, bounded LRU; with ``recording`` on, what changes is kept as vLLM
    KV events until ``take_events``.

    A request's blocks are touched last to first, so its first block is the most recent: as
    vLLM frees a request's blocks tail first, an old conversation loses its tail before its
    head and what is cached is always a whole prefix of some prompt.
    """

    def __init__(self, capacity: int = MAX_CACHED_BLOCKS,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self._capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.recording = False
        self._events: list[dict[str, Any]] = []

    def lookup_and_insert(self, prompt_text: str, num_tokens: int | None = None) -> int:
        """Tokens of the prompt already cached, then remember all its blocks (see ``insert``);
        ``num_tokens`` is the prompt's token count, the length of its token ids."""
        return self.insert(textgen.token_ids(prompt_text))

    def insert(self, token_ids: list[int]) -> int:
        """Tokens already cached (a multiple of the block size), then cache all full blocks.

        As in vLLM, the last token is always computed, so a fully cached prompt reports one
        block less.
        """
        return self.insert_hashes(block_hashes(token_ids, self.block_size), token_ids)

    def insert_hashes(self, hashes: list[int], token_ids: list[int]) -> int:
        """``insert`` for a prompt whose block hashes are already known."""
        size = self.block_size
        blocks = self._blocks
        hits = 0
        while hits < len(hashes) and hashes[hits] in blocks:
            hits += 1
        if self.recording:
            self._record_stored(hashes, token_ids, blocks)
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self._evict()
        cached = hits * size
        return min(cached, ((len(token_ids) - 1) // size) * size)

    def held(self, hashes: list[int]) -> int:
        """How many of ``hashes`` (a prompt's blocks), from the first, are cached; the order of
        eviction is left as it was."""
        blocks = self._blocks
        count = 0
        while count < len(hashes) and hashes[count] in blocks:
            count += 1
        return count

    def _record_stored(self, hashes: list[int], token_ids: list[int],
                       blocks: OrderedDict[int, None]) -> None:
        """One BlockStored per run of new blocks (one run, unless a chain lost a middle)."""
        size = self.block_size
        run: list[int] = []
        for i, h in enumerate(hashes):
            if h not in blocks:
                run.append(i)
                if i + 1 < len(hashes) and hashes[i + 1] not in blocks:
                    continue
                first = run[0]
                self._events.append(kvevents.block_stored(
                    [hashes[j] for j in run], hashes[first - 1] if first else None,
                    token_ids[first * size:(i + 1) * size], size))
                run = []

    def _evict(self) -> None:
        blocks = self._blocks
        while len(blocks) > self._capacity:
            evicted, _ = blocks.popitem(last=False)
            if self.recording:
                self._events.append(kvevents.block_removed(evicted))

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def resize(self, capacity: int) -> None:
        self._capacity = capacity
        self._evict()

    def set_block_size(self, block_size: int) -> None:
        """A new block size makes every cached hash meaningless: the cache starts over."""
        if block_size != self.block_size:
            self.block_size = block_size
            self.clear()

    def clear(self) -> None:
        self._blocks.clear()
        if self.recording:
            self._events = [kvevents.all_blocks_cleared()]

    def __len__(self) -> int:
        return len(self._blocks)


class BlockAllocator:
    """Hands out increasing block ids, wrapping long before they could look absurd."""

    def __init__(self) -> None:
        self._next = 1

    def allocate(self, count: int) -> list[int]:
        ids = []
        for _ in range(count):
            ids.append(self._next)
            self._next = self._next % MAX_BLOCK_ID + 1
        return ids

    def reset(self) -> None:
        self._next = 1
