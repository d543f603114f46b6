"""What one instance holds in its prefix cache, as its KV-cache events tell it
(docs/behaviour.md#routing-policies): vLLM's event format, decoded, and the picture it builds.

vLLM seeds its block hashes per process, so two instances name the same tokens differently
and a hash means nothing outside the instance that made it. The picture therefore keys
blocks by our own chain hash of the token ids (``block_key``), the same for every instance,
every worker and every host, and keeps vLLM's hash only to find a block's parent and to apply
its removal. Pure Python: no sockets, so it is tested by feeding it events.

The wire format (vllm/distributed/kv_events.py): each ZMQ message is three frames, a topic, an
8-byte big-endian sequence number and a msgpack ``[ts, [event, ...], data_parallel_rank?]``.
An event is a map with its kind under ``type`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``; vLLM 0.32), or an array whose first element is the kind and whose
fields follow in declaration order (earlier vLLM releases). Block hashes are bytes, or
integers when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on (0.32's default).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgpack

from epd_flask.core import cooperate

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
#: Field order of the array form, after the kind (vLLM's struct declaration order).
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys")
REMOVED_FIELDS = ("block_hashes", "medium")
#: Blocks remembered per instance. vLLM's CPU default cache (4 GiB) of an 8B model holds
#: ~2,000 blocks of 16 tokens and a large GPU holds ~100,000; at ~310 bytes a block (measured
#: by tests/bench/kvpicture.py on a full picture) this is ~40 MB per instance per worker in the
#: worst case, and the oldest blocks go first.
MAX_BLOCKS = 131072
ROOT = b"epd-kv-root"
#: The parent name of a chain whose real parent we never heard of (see ``CachePicture``).
ORPHAN = b"epd-kv-orphan"
KEY_BYTES = 16
#: The largest token id a block name can hold (ids are packed as 32-bit unsigned integers;
#: every vocabulary fits). An id outside 0..MAX_TOKEN_ID names no block any engine holds.
MAX_TOKEN_ID = 2 ** 32 - 1
TOKEN_BYTES = array("I").itemsize
#: Blocks named between two hand-backs of the event loop (~1 ms of hashing).
YIELD_BLOCKS = 512


class MalformedEvents(ValueError):
    """A message that is not vLLM's KV-event format."""


# Tuples, not frozen dataclasses: a reader builds one per block an engine evicts, and making
# a frozen dataclass cost more than decoding the event.
class Stored(NamedTuple):
    block_hashes: Sequence[Hashable]
    parent: Hashable | None
    #: The blocks' token ids; decoded from the wire, an ``array("I")`` (already packed).
    token_ids: Sequence[int]
    block_size: int
    #: What else vLLM hashed into these blocks (a LoRA, media, a cache salt); blocks with
    #: any are keyed apart from plain text, so a text prompt never matches them.
    salt: bytes = b""


class Removed(NamedTuple):
    block_hashes: Sequence[Hashable]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def are_token_ids(values: Any) -> bool:
    """Whether ``values`` is a list of token ids a block name can hold: integers (not
    booleans) from 0 to ``MAX_TOKEN_ID``. Checked where ids enter (a client's prompt, a
    /tokenize answer, a store event), so naming blocks never meets one it cannot pack."""
    return packed_ids(values) is not None


def packed_ids(values: Any) -> array[int] | None:
    """``values`` packed as block names pack them, if they are token ids (``are_token_ids``):
    the packing itself refuses what is not an integer in 0..``MAX_TOKEN_ID``, so one pass
    checks and packs."""
    if not isinstance(values, (list, tuple)):
        return None
    try:
        packed = array("I", values)
    except (TypeError, OverflowError):
        return None
    if _holds_booleans(values, packed):
        return None
    return packed


#: What True and False pack as: only an id that packs as one of them can be a boolean.
_BOOLEAN_WORDS = tuple(array("I", [n]).tobytes() for n in (0, 1))
#: Ids of 0 or 1 asked their type one by one; past them, every id is (one pass in C).
_FEW = 64


def _holds_booleans(values: Sequence[Any], packed: array[int]) -> bool:
    """Whether ``values``, which packed as ``packed``, holds a boolean. Asking every id its
    type took as long as hashing the blocks; the 0s and 1s, found in the packed bytes, are
    the only ids that can be booleans, and there are few."""
    raw = packed.tobytes()
    asked = 0
    for word in _BOOLEAN_WORDS:
        at = raw.find(word)
        while at != -1:
            if at % TOKEN_BYTES == 0:
                if type(values[at // TOKEN_BYTES]) is bool:
                    return True
                asked += 1
                if asked > _FEW:
                    return bool in set(map(type, values))
            at = raw.find(word, at + 1)
    return False


def sequence_number(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedEvents(f"a sequence number frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one message's payload frame; ``MalformedEvents`` if it is not one."""
    return list(open_batch(payload)[1])


def open_batch(payload: bytes) -> tuple[int, Iterator[Event]]:
    """How many events one message's payload frame says it carries, read before any is
    decoded, and the events one at a time: a reader can refuse a message by its count and
    spread a large one's work over many turns. ``MalformedEvents`` from either when the
    payload is not a ``[timestamp, [events...], ...]`` batch; no array in it may claim more
    items than the payload has bytes (a length bomb is refused before anything is built)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                max_buffer_size=max(len(payload), 1))
    try:
        unpacker.feed(payload)
        if unpacker.read_array_header() < 2:
            raise MalformedEvents("not a [timestamp, [events...]] batch")
        unpacker.skip()
        count = unpacker.read_array_header()
    except MalformedEvents:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MalformedEvents(f"not a [timestamp, [events...]] batch: {exc}") from None
    return count, _events(unpacker, count)


def _events(unpacker: msgpack.Unpacker, count: int) -> Iterator[Event]:
    for _ in range(count):
        try:
            raw = unpacker.unpack()
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            raise MalformedEvents(f"not msgpack: {exc}") from None
        yield decode_event(raw)


def pieces(event: Event, blocks: int) -> Iterator[Event]:
    """``event`` cut into events of at most ``blocks`` blocks that, applied in order, do what
    it does: each stored piece's parent is the previous piece's last block."""
    if isinstance(event, Cleared) or len(event.block_hashes) <= blocks:
        yield event
        return
    hashes = event.block_hashes
    if isinstance(event, Removed):
        for start in range(0, len(hashes), blocks):
            yield Removed(hashes[start:start + blocks])
        return
    size = event.block_size
    parent = event.parent
    for start in range(0, len(hashes), blocks):
        part = hashes[start:start + blocks]
        yield Stored(part, parent, event.token_ids[start * size:(start + len(part)) * size],
                     size, event.salt)
        parent = part[-1]


def _hashes(value: Any) -> Sequence[Hashable]:
    if not isinstance(value, (list, tuple)) or not _HASH_TYPES.issuperset(map(type, value)):
        raise MalformedEvents("block_hashes is not a list of bytes or integers")
    return value


_HASH_TYPES = frozenset((bytes, int))


def decode_event(raw: Any) -> Event:
    """One event, decoded. A reader decodes one per block an engine evicts, so the common
    cases are checked first and nothing is built twice."""
    if isinstance(raw, dict):
        kind, f = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw:
        kind, f = raw[0], None
    else:
        raise MalformedEvents(f"an event that is neither a map nor an array: "
                              f"{type(raw).__name__}")
    if kind == REMOVED:
        if f is None:
            f = dict(zip(REMOVED_FIELDS, raw[1:], strict=False))
        return Removed(_hashes(f.get("block_hashes")))
    if kind == CLEARED:
        return Cleared()
    if kind != STORED:
        raise MalformedEvents(f"an unknown event kind {kind!r}")
    if f is None:
        f = dict(zip(STORED_FIELDS, raw[1:], strict=False))
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    size = f.get("block_size")
    if parent is not None and not isinstance(parent, (bytes, int)):
        raise MalformedEvents("parent_block_hash is not bytes, an integer or nil")
    tokens = packed_ids(f.get("token_ids"))
    if tokens is None:
        raise MalformedEvents(f"token_ids is not a list of integers in 0..{MAX_TOKEN_ID}")
    if not isinstance(size, int) or size <= 0 or len(tokens) != size * len(hashes):
        raise MalformedEvents(f"{len(tokens)} token ids for {len(hashes)} blocks of {size!r}")
    extra = [f.get("lora_name"), f.get("extra_keys")]
    salt = b"" if not any(_meaningful(x) for x in extra) else repr(extra).encode()
    return Stored(hashes, parent, tokens, size, salt)


def _meaningful(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        # vLLM sends one entry per block, nearly always None
        return value.count(None) != len(value) and any(_meaningful(v) for v in value)
    return value is not None


def block_key(parent: bytes, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """Our name for a block: blake2b over its parent's name and its token ids, the same in
    every process. Token ids are packed as 32-bit integers (every vocabulary fits)."""
    return _name(parent, array("I", token_ids).tobytes(), salt)


#: The hash every name starts from; copying it is cheaper than making it anew per block.
_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=b"epd-kv")


def _name(parent: bytes, packed: bytes, salt: bytes = b"") -> bytes:
    h = _HASHER.copy()
    h.update(parent)
    h.update(packed)
    if salt:
        h.update(salt)
    return h.digest()


class _Pacer:
    """Hands the event loop back after every ``YIELD_BLOCKS`` blocks named, so a long
    prompt's thousands of hashes never hold a worker's other requests for their sum."""

    def __init__(self) -> None:
        self.named = 0

    def step(self) -> None:
        self.named += 1
        if self.named % YIELD_BLOCKS == 0:
            cooperate.yield_now()


def prompt_keys(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The keys of a prompt's full blocks (vLLM caches only full blocks), first to last."""
    keys: list[bytes] = []
    parent = ROOT
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    packed = array("I", tokens[:count * block_size]).tobytes()
    step = block_size * TOKEN_BYTES
    pacer = _Pacer()
    for i in range(count):
        parent = _name(parent, packed[i * step:(i + 1) * step])
        keys.append(parent)
        pacer.step()
    return keys


class Picture(Protocol):
    """What routing asks of an instance's picture: the reader's own (``CachePicture``) or a
    sibling's copy of it (``HeldKeys``)."""

    block_size: int | None

    def matched(self, keys: Sequence[bytes], tokens: Sequence[int] = ()) -> int: ...


class CachePicture:
    """One instance's cached blocks by our key, least recently stored first.

    ``ready`` once an event told the block size. A store whose parent is unknown (stored
    before we subscribed: a new worker after a reload, or events lost in a gap) cannot be
    named from the root; it is named from ``ORPHAN`` and its first block kept as an orphan
    root. vLLM only caches a block whose whole prefix it holds, so a prompt whose block j
    has an orphan root's tokens is taken to be held up to there (``matched``): without
    that, every conversation over a prefix cached before the worker subscribed (a hot
    system prompt, which vLLM never stores again) would stay invisible. The price: a block
    with the same tokens under another prefix matches too.
    """

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._theirs: OrderedDict[Hashable, bytes] = OrderedDict()
        self._ours: dict[bytes, Hashable] = {}
        self._roots: set[bytes] = set()
        self.orphans = 0
        #: Set by the host's reading worker, whose siblings follow this picture: every
        #: change is noted there until it is sent (fleet/kvrelay.py).
        self.changes: Changes | None = None

    @property
    def ready(self) -> bool:
        return self.block_size is not None

    def __len__(self) -> int:
        return len(self._ours)

    def holds(self, key: bytes) -> bool:
        return key in self._ours

    def keys(self) -> Iterable[bytes]:
        return self._ours.keys()

    def roots(self) -> Iterable[bytes]:
        return self._roots

    def apply(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, Removed):
                self.remove(event.block_hashes)
            elif isinstance(event, Stored):
                self._store(event)
            else:
                self.clear()

    def remove(self, block_hashes: Iterable[Hashable]) -> None:
        theirs, ours, roots = self._theirs, self._ours, self._roots
        for h in block_hashes:
            key = theirs.pop(h, None)
            if key is None:
                continue
            if self.changes is None:  # one per evicted block: kept short
                ours.pop(key, None)
                roots.discard(key)
            else:
                self._forget(key)

    def clear(self) -> None:
        self._theirs.clear()
        self._ours.clear()
        self._roots.clear()
        if self.changes is not None:
            self.changes.clear()

    def _forget(self, ours: bytes) -> None:
        if self._ours.pop(ours, None) is not None and self.changes is not None:
            self.changes.held[ours] = False
        if ours in self._roots:
            self._roots.discard(ours)
            if self.changes is not None:
                self.changes.roots[ours] = False

    def _store(self, event: Stored) -> None:
        if self.block_size != event.block_size:
            if self.block_size is not None:
                self.clear()  # another engine configuration: nothing known still holds
            self.block_size = event.block_size
        known = ROOT if event.parent is None else self._theirs.get(event.parent)
        if known is None:
            self.orphans += 1
        parent = ORPHAN if known is None else known
        step = event.block_size * TOKEN_BYTES
        tokens = event.token_ids
        packed = (tokens if isinstance(tokens, array) else array("I", tokens)).tobytes()
        salt = event.salt
        theirs_map, ours_map = self._theirs, self._ours
        noted = None if self.changes is None else self.changes.held
        at = 0
        for theirs in event.block_hashes:
            parent = _name(parent, packed[at:at + step], salt)
            if theirs in theirs_map or parent in ours_map:
                self._hold(theirs, parent)
            else:  # a new block under a new hash, nearly always: nothing to undo
                theirs_map[theirs] = parent
                ours_map[parent] = theirs
            if noted is not None:
                noted[parent] = True
            if at == 0 and known is None:
                self._roots.add(parent)
                if self.changes is not None:
                    self.changes.roots[parent] = True
            at += step
        while len(theirs_map) > self.max_blocks:
            _, ours = theirs_map.popitem(last=False)
            self._forget(ours)

    def _hold(self, theirs: Hashable, ours: bytes) -> None:
        """Pair ``theirs`` with ``ours``, undoing any pairing either had: the two maps stay
        one to one whatever the publisher sends (a hash reused for other tokens, the same
        tokens under a new hash after a restart with a new seed), so the bound on one is a
        bound on both."""
        old_ours = self._theirs.pop(theirs, None)
        if old_ours is not None and old_ours != ours:
            self._forget(old_ours)
        old_theirs = self._ours.get(ours)
        if old_theirs is not None and old_theirs != theirs:
            del self._theirs[old_theirs]
        self._theirs[theirs] = ours
        self._ours[ours] = theirs

    def matched(self, keys: Sequence[bytes], tokens: Sequence[int] = ()) -> int:
        """How many of ``keys`` this instance holds from the first on (``matched``)."""
        return matched(self._ours, self._roots, self.block_size, keys, tokens)


class Changes:
    """What a picture's blocks became since it was last published (fleet/kvrelay.py): each
    key's last state, so a block stored and evicted within one message is sent once, as
    gone. ``cleared``: everything before these went."""

    __slots__ = ("cleared", "held", "roots")

    def __init__(self, cleared: bool = False) -> None:
        self.held: dict[bytes, bool] = {}
        self.roots: dict[bytes, bool] = {}
        self.cleared = cleared

    def __bool__(self) -> bool:
        return self.cleared or bool(self.held) or bool(self.roots)

    def clear(self) -> None:
        self.held.clear()
        self.roots.clear()
        self.cleared = True


class HeldKeys:
    """A picture as a sibling worker receives it from the host's reading worker: only our
    keys and orphan roots, which is all ``matched`` needs; the reader keeps vLLM's hashes,
    the bound and the order. Pure Python, applied from fleet/kvrelay.py's messages."""

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self.held: set[bytes] = set()
        self.roots: set[bytes] = set()

    @property
    def ready(self) -> bool:
        return self.block_size is not None

    def clear(self) -> None:
        self.held.clear()
        self.roots.clear()

    def change(self, added: Iterable[bytes], removed: Iterable[bytes],
               roots_added: Iterable[bytes], roots_removed: Iterable[bytes]) -> None:
        self.held.difference_update(removed)
        self.held.update(added)
        self.roots.difference_update(roots_removed)
        self.roots.update(roots_added)

    def matched(self, keys: Sequence[bytes], tokens: Sequence[int] = ()) -> int:
        return matched(self.held, self.roots, self.block_size, keys, tokens)


def matched(held: Container[bytes], roots: Container[bytes], block_size: int | None,
            keys: Sequence[bytes], tokens: Sequence[int] = ()) -> int:
    """How many of ``keys`` (a prompt's blocks, in order; ``tokens`` its token ids) this
    instance holds from the first on: the prefix a prefill there would not compute
    again. Past the blocks named from the root, a block whose tokens start an orphan
    chain counts with all before it, and so does the rest of that chain it holds.

    One pass: a walk along an orphan chain goes on from where it stopped, never from
    the next block again (a prompt of one block repeated, whose every block starts the
    chain, would otherwise cost the square of its length). Two orphan chains that
    overlap in one prompt count the one met first."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    count = len(keys)
    if not roots or not tokens or block_size is None or n == count:
        return n
    packed = array("I", tokens[:count * block_size]).tobytes()
    step = block_size * TOKEN_BYTES
    pacer = _Pacer()
    best = j = n
    while j < count:
        key = _name(ORPHAN, packed[j * step:(j + 1) * step])
        pacer.step()
        j += 1
        if key not in roots:
            continue
        while j < count:
            key = _name(key, packed[j * step:(j + 1) * step])
            pacer.step()
            if key not in held:
                break
            j += 1
        best = max(best, j)
    return best
