"""vLLM's KV-event format and the cache picture built from it, without sockets
(docs/behaviour.md#routing-policies)."""

from __future__ import annotations

import random
import time

import gevent
import msgpack
import pytest

from epd_flask.fleet import kvcache
from epd_flask.fleet.kvcache import CachePicture, MalformedEvents, prompt_keys

BLOCK = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = BLOCK,
           **extra: object) -> dict[str, object]:
    """A BlockStored as vLLM 0.32 encodes it (msgspec, tag in ``type``)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": size, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention", **extra}


def batch(*events: object, rank: int | None = 0) -> bytes:
    return msgpack.packb([1796149219.8, list(events), rank])


class Engine:
    """vLLM's side: per-process random hashes for the chains it caches, as events."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.hashes: dict[tuple[int, ...], int] = {}

    def store(self, tokens: list[int], size: int = BLOCK) -> list[dict[str, object]]:
        """The events of caching ``tokens``' full blocks, only the new ones (vLLM stores a
        block once; its parent is the last block already cached)."""
        parent = None
        new_hashes, new_tokens = [], []
        first_parent = None
        for i in range(len(tokens) // size):
            prefix = tuple(tokens[:(i + 1) * size])
            h = self.hashes.get(prefix)
            if h is None:
                h = self.hashes[prefix] = self.rng.getrandbits(64)
                if not new_hashes:
                    first_parent = parent
                new_hashes.append(h)
                new_tokens += tokens[i * size:(i + 1) * size]
            parent = h
        return [stored(new_hashes, first_parent, new_tokens, size)] if new_hashes else []

    def hash_of(self, tokens: list[int]) -> int:
        return self.hashes[tuple(tokens)]


def picture_of(*event_lists: list[dict[str, object]], max_blocks: int = 1000) -> CachePicture:
    picture = CachePicture(max_blocks)
    for events in event_lists:
        picture.apply(kvcache.decode_batch(batch(*events)))
    return picture


PROMPT = list(range(100, 118))  # 4 full blocks of 4, and 2 tokens over


def test_two_engines_with_different_hashes_give_the_same_picture() -> None:
    """vLLM seeds its hashes per process: only our token-chain keys compare instances."""
    a, b = Engine(1), Engine(2)
    pa, pb = picture_of(a.store(PROMPT)), picture_of(b.store(PROMPT))
    keys = prompt_keys(PROMPT, BLOCK)
    assert len(keys) == 4
    assert pa.matched(keys) == pb.matched(keys) == 4
    assert a.store(PROMPT) == []  # nothing new: vLLM stores a block once


def test_a_later_store_chains_on_its_parent_across_messages() -> None:
    engine = Engine(1)
    first = engine.store(PROMPT[:8])
    second = engine.store(PROMPT)  # parent: the hash of block 2, sent earlier
    assert second[0]["parent_block_hash"] == engine.hash_of(PROMPT[:8])
    picture = picture_of(first, second)
    assert picture.matched(prompt_keys(PROMPT, BLOCK)) == 4
    other = PROMPT[:8] + [0] * 8
    assert picture.matched(prompt_keys(other, BLOCK)) == 2  # the longest prefix held


def test_a_chain_whose_parent_was_missed_still_matches_from_where_it_starts() -> None:
    """A worker that subscribed after the engine cached a prompt's head (a reload's new
    worker) still sees the conversations built on it: vLLM holds a block only with its
    whole prefix, so a held continuation means the head is held too."""
    engine = Engine(1)
    engine.store(PROMPT[:8])  # published before we subscribed
    picture = picture_of(engine.store(PROMPT))
    assert picture.orphans == 1 and len(picture) == 2
    keys = prompt_keys(PROMPT, BLOCK)
    assert picture.matched(keys) == 0  # named from the root alone: unknown
    assert picture.matched(keys, PROMPT) == 4
    # A later turn stored under the orphan chain keeps matching to its end.
    longer = PROMPT[:16] + list(range(500, 508))
    picture.apply(kvcache.decode_batch(batch(*engine.store(longer))))
    assert picture.matched(prompt_keys(longer, BLOCK), longer) == 6
    # Another prompt that shares only the unseen head matches nothing beyond what it holds.
    other = PROMPT[:8] + list(range(900, 908))
    assert picture.matched(prompt_keys(other, BLOCK), other) == 0
    # Removing the orphan root forgets the chain's start.
    picture.apply([kvcache.Removed((engine.hash_of(PROMPT[:12]),))])
    assert picture.matched(keys, PROMPT) == 0


def test_removed_blocks_and_all_cleared_apply() -> None:
    engine = Engine(1)
    picture = picture_of(engine.store(PROMPT))
    keys = prompt_keys(PROMPT, BLOCK)
    third = engine.hash_of(PROMPT[:12])
    picture.apply(kvcache.decode_batch(batch(
        {"type": "BlockRemoved", "block_hashes": [third], "medium": "GPU"})))
    assert picture.matched(keys) == 2
    picture.apply(kvcache.decode_batch(batch({"type": "AllBlocksCleared"})))
    assert picture.matched(keys) == 0 and len(picture) == 0


def test_the_picture_is_bounded_oldest_stores_first() -> None:
    engine = Engine(1)
    prompts = [[p] * 8 for p in range(1, 11)]  # ten prompts of two blocks
    picture = picture_of(*(engine.store(p) for p in prompts), max_blocks=6)
    assert len(picture) == 6
    assert picture.matched(prompt_keys(prompts[0], BLOCK)) == 0
    assert picture.matched(prompt_keys(prompts[-1], BLOCK)) == 2


def test_the_array_form_of_earlier_vllm_and_bytes_hashes_decode_alike() -> None:
    tokens = PROMPT[:8]
    array_form = ["BlockStored", [b"h1", b"h2"], None, tokens, BLOCK, None, "GPU"]
    picture = CachePicture()
    picture.apply(kvcache.decode_batch(batch(array_form, rank=None)))
    assert picture.matched(prompt_keys(tokens, BLOCK)) == 2
    picture.apply(kvcache.decode_batch(batch(["BlockRemoved", [b"h2"], "GPU"])))
    assert picture.matched(prompt_keys(tokens, BLOCK)) == 1


def test_blocks_hashed_with_a_lora_or_media_never_match_plain_text() -> None:
    with_lora = stored([7, 8], None, PROMPT[:8], lora_name="tiny-lora")
    picture = picture_of([with_lora])
    assert len(picture) == 2
    assert picture.matched(prompt_keys(PROMPT[:8], BLOCK)) == 0


def test_a_new_block_size_starts_the_picture_again() -> None:
    picture = picture_of(Engine(1).store(PROMPT))
    picture.apply(kvcache.decode_batch(batch(stored([9], None, PROMPT[:8], size=8))))
    assert picture.block_size == 8 and len(picture) == 1


@pytest.mark.parametrize("payload", [
    b"\xc1garbage", msgpack.packb({"not": "a batch"}), msgpack.packb([1.0]),
    msgpack.packb([1.0, [{"type": "Nope"}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2],
                          "block_size": 4, "parent_block_hash": None}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x", "token_ids": [],
                          "block_size": 4, "parent_block_hash": None}]]),
    msgpack.packb([1.0, [17]]),
])
def test_garbage_is_malformed_not_a_crash(payload: bytes) -> None:
    with pytest.raises(MalformedEvents):
        kvcache.decode_batch(payload)


@pytest.mark.parametrize("tokens", [
    [5, 6, True, 7], [0, 1, 2, False], [1] * 200 + [True] + [0] * 3, [0.0, 1, 2, 3],
    [2 ** 32, 1, 2, 3], ["a", 1, 2, 3],
], ids=["a boolean", "a boolean among 0s and 1s", "a boolean after many 1s", "a float",
        "2^32", "a string"])
def test_a_store_of_ids_that_are_not_integers_in_range_is_malformed(tokens: list[object]) -> None:
    size = len(tokens)
    with pytest.raises(MalformedEvents):
        kvcache.decode_batch(batch(stored([1], None, tokens, size=size)))


@pytest.mark.parametrize("tokens", [[0, 1, 0, 1], [1] * 200 + [0] * 4, [2 ** 32 - 1, 0, 7, 1]])
def test_ids_of_0_and_1_are_ids(tokens: list[int]) -> None:
    picture = picture_of([stored([1], None, tokens, size=len(tokens))])
    assert picture.matched(prompt_keys(tokens, len(tokens))) == 1


def test_sequence_numbers_are_eight_bytes_big_endian() -> None:
    assert kvcache.sequence_number((258).to_bytes(8, "big")) == 258
    with pytest.raises(MalformedEvents):
        kvcache.sequence_number(b"\x01")


def test_prompt_keys_depend_on_every_earlier_block() -> None:
    a = prompt_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    b = prompt_keys([1, 2, 3, 0, 5, 6, 7, 8], BLOCK)
    assert a[0] != b[0] and a[1] != b[1]
    assert prompt_keys([1, 2, 3], BLOCK) == []
    assert len(prompt_keys(list(range(40)), BLOCK, limit=3)) == 3


def test_one_hash_reused_for_many_stores_keeps_the_bound() -> None:
    """A publisher that names every block with the same hash (a broken or hostile one) must
    not grow the picture past its bound."""
    picture = CachePicture(max_blocks=100)
    for n in range(5000):
        picture.apply([kvcache.Stored((7,), None, (n, n, n, n), BLOCK)])
    assert len(picture) <= 100


def test_the_bound_holds_for_any_event_sequence() -> None:
    """Random stores, removals and clears over a small space of hashes and tokens (so hashes
    and block names collide and repeat in every way): the picture never holds more than its
    bound, and every block it holds can still be removed by the hash that stored it."""
    rng = random.Random(5)
    for _ in range(40):
        picture = CachePicture(max_blocks=rng.choice((1, 3, 10)))
        for _ in range(300):
            roll = rng.random()
            if roll < 0.75:
                n = rng.randint(1, 4)
                hashes = tuple(rng.randint(0, 12) for _ in range(n))
                parent = rng.choice((None, rng.randint(0, 12)))
                tokens = tuple(rng.randint(0, 2) for _ in range(n * BLOCK))
                picture.apply([kvcache.Stored(hashes, parent, tokens, BLOCK)])
            elif roll < 0.98:
                picture.apply([kvcache.Removed(tuple(rng.randint(0, 12) for _ in range(2)))])
            else:
                picture.apply([kvcache.Cleared()])
            assert len(picture) <= picture.max_blocks
        picture.apply([kvcache.Removed(tuple(range(13)))])
        assert len(picture) == 0  # nothing held that no hash names any more


def test_matching_a_long_prompt_of_repeated_blocks_is_linear_and_yields() -> None:
    """A reload's new worker holds a conversation of one block repeated as an orphan chain
    (its head was stored before it subscribed); a prompt of that block repeated 4,096 times
    starts a walk along the chain from every block. Matching must cost a pass over the
    prompt, and hand the event loop back while it runs: a ticker greenlet keeps ticking."""
    blocks = 4096
    tokens = [7] * (blocks * BLOCK)
    picture = picture_of([stored(list(range(1, blocks + 1)), 99999, tokens)],
                         max_blocks=2 * blocks)
    assert picture.orphans == 1
    ticks: list[float] = []

    def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            gevent.sleep(0.005)

    ticker = gevent.spawn(tick)
    gevent.sleep(0.02)
    try:
        started = time.monotonic()
        keys = prompt_keys(tokens, BLOCK)
        held = picture.matched(keys, tokens)
        took = time.monotonic() - started
    finally:
        ticker.kill()
    assert held == blocks
    # Bounds only a stall breaks: matching walked from every block took 50 s on a loaded
    # 2-core machine; one pass takes ~30 ms there.
    assert took < 3.0, took
    during = [t for t in ticks if t >= started]
    gaps = [b - a for a, b in zip([started, *during], [*during, started + took], strict=True)]
    assert max(gaps) < 0.5, max(gaps)
