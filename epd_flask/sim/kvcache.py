"""A prefill's memory of what it has computed: a prefix cache of 16-token blocks (so a repeated
prompt prefix shows up as ``remote_prefill_cached_tokens``) and the block ids it hands out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .handles import BLOCK_TOKENS
from .textgen import BYTES_PER_TOKEN

BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN
#: Enough blocks for thousands of distinct prompts; the oldest are forgotten first.
MAX_CACHED_BLOCKS = 65536  # the default; SimConfig.kv_cache_blocks sets it
MAX_BLOCK_ID = 1 << 20


class PrefixCache:
    """Chained block hashes like vLLM's automatic prefix caching, bounded LRU."""

    def __init__(self, capacity: int = MAX_CACHED_BLOCKS) -> None:
        self._capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, prompt_text: str, num_tokens: int) -> int:
        """Tokens of the prompt already cached (a multiple of 16), then remember all its blocks.

        As in vLLM, the last token is always computed, so a fully cached prompt reports one
        block less.
        """
        data = prompt_text.encode("utf-8", "surrogatepass")
        digest = b""
        hits = 0
        missed = False
        for start in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
            digest = hashlib.blake2b(digest + data[start:start + BLOCK_BYTES],
                                     digest_size=16).digest()
            if not missed and digest in self._blocks:
                hits += 1
                self._blocks.move_to_end(digest)
            else:
                missed = True
                self._blocks[digest] = None
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
        cached = hits * BLOCK_TOKENS
        return min(cached, ((num_tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS)

    def resize(self, capacity: int) -> None:
        self._capacity = capacity
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


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
