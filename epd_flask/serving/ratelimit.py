"""Per-tenant request and token limits, as token buckets (docs/behaviour.md#admission).

A limit of L per minute is a bucket of L that refills at L/60 per second: a tenant may spend
its whole minute at once, then at the rate. A request takes 1 from the requests bucket and
its estimate (prompt plus ``max_tokens``) from the tokens bucket, both or neither; the answer's
usage later gives back what it did not use (or takes what the estimate missed, down to debt).
What a refusal says follows OpenAI's rate limits: how many remain, how long until a bucket is
full again (``x-ratelimit-*``), and how long until this request would pass (``Retry-After``).

The buckets live in a ``Store``: one process's memory (a lone app), a file every worker of the
host shares (``HostStore``), or Redis, which every proxy host shares (``RedisStore``,
serving/redisstore.py); ``Limiter`` uses Redis while it answers and the host's file
otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from epd_flask.control.roster import Tenant
from epd_flask.control.statedir import map_shared

logger = logging.getLogger(__name__)

REQUESTS, TOKENS = "requests", "tokens"
SECONDS_PER_MINUTE = 60.0


@dataclass(frozen=True)
class Take:
    """One bucket's part of an operation: its key, its size and what to take (negative:
    give back)."""

    kind: str
    capacity: int
    amount: float


@dataclass(frozen=True)
class Level:
    """A bucket after an operation: what is left and how long until it is full again."""

    kind: str
    limit: int
    remaining: float
    reset: float


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    levels: tuple[Level, ...]
    #: Seconds until this request would pass (refused only).
    retry_after: float = 0.0
    #: The kind that refused it.
    short: str | None = None


def refill(level: float, since: float, capacity: int) -> float:
    """A bucket's level ``since`` seconds after it was ``level``."""
    return min(float(capacity), level + max(0.0, since) * capacity / SECONDS_PER_MINUTE)


def until_full(level: float, capacity: int) -> float:
    return max(0.0, (capacity - level) * SECONDS_PER_MINUTE / capacity)


def decide(levels: Sequence[float], takes: Sequence[Take], give: bool) -> Verdict:
    """The outcome of ``takes`` on buckets now at ``levels`` (the same order): all taken,
    or (not ``give``) none when one lacks its amount."""
    waits = [((t.amount - lv) * SECONDS_PER_MINUTE / t.capacity, t.kind)
             for lv, t in zip(levels, takes, strict=True) if not give and lv < t.amount]
    allowed = not waits
    after = [min(float(t.capacity), lv - t.amount) if allowed else lv
             for lv, t in zip(levels, takes, strict=True)]
    wait, short = max(waits) if waits else (0.0, None)
    return Verdict(allowed, tuple(Level(t.kind, t.capacity, lv, until_full(lv, t.capacity))
                                  for lv, t in zip(after, takes, strict=True)), wait, short)


def corrected(verdict: Verdict, gives: Sequence[Take]) -> Verdict:
    """``verdict``'s levels after ``gives`` (as a store would leave them, without the refill
    since): what an answer's headers tell once its charge is corrected."""
    amounts = {t.kind: t.amount for t in gives}
    levels = []
    for lv in verdict.levels:
        if lv.kind in amounts:
            left = min(float(lv.limit), lv.remaining - amounts[lv.kind])
            lv = Level(lv.kind, lv.limit, left, until_full(left, lv.limit))
        levels.append(lv)
    return Verdict(verdict.allowed, tuple(levels), verdict.retry_after, verdict.short)


def merged(corrections: Sequence[tuple[str, Sequence[Take]]]) -> dict[str, list[Take]]:
    """Corrections per tenant, one take per bucket (their amounts summed, at the latest
    capacity; those that cancel out left out)."""
    sums: dict[str, dict[str, tuple[int, float]]] = {}
    for tenant, takes in corrections:
        per = sums.setdefault(tenant, {})
        for take in takes:
            per[take.kind] = (take.capacity, per.get(take.kind, (0, 0.0))[1] + take.amount)
    out = {}
    for tenant, per in sums.items():
        takes = [Take(kind, cap, amount) for kind, (cap, amount) in per.items() if amount]
        if takes:
            out[tenant] = takes
    return out


class Store(Protocol):
    name: str

    def apply(self, tenant: str, takes: Sequence[Take], give: bool = False) -> Verdict:
        """Take ``takes`` from ``tenant``'s buckets at once (``give``: unconditionally)."""


class MemoryStore:
    """Buckets in this process (a lone app, the in-process tests)."""

    name = "memory"

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}

    def apply(self, tenant: str, takes: Sequence[Take], give: bool = False) -> Verdict:
        now = time.monotonic()
        levels = []
        for take in takes:
            level, at = self._buckets.get((tenant, take.kind), (float(take.capacity), now))
            levels.append(refill(level, now - at, take.capacity))
        verdict = decide(levels, takes, give)
        if verdict.allowed:
            for level in verdict.levels:
                self._buckets[tenant, level.kind] = (level.remaining, now)
        return verdict


_SLOT = struct.Struct("<Qdd")  # key, level, when (CLOCK_MONOTONIC: the same in every process)
_HOST_SLOTS = 1024  # 256 tenants x 2 kinds, with room for open addressing
_HOST_SIZE = _HOST_SLOTS * _SLOT.size


class HostStore:
    """Buckets in a file every worker of the host maps, changed under an exclusive ``flock``
    (held for the few loads and stores of one operation): each host enforces one limit, not
    one per worker. Slots by hash of (tenant, kind), open addressing."""

    name = "host"

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._map = map_shared(fd, _HOST_SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def _slot(self, key: int) -> int:
        start = key % _HOST_SLOTS
        for probe in range(_HOST_SLOTS):
            slot = (start + probe) % _HOST_SLOTS
            held = _SLOT.unpack_from(self._map, slot * _SLOT.size)[0]
            if held in (key, 0):
                return slot
        return start  # full (more tenants than any roster names): share a bucket

    def apply(self, tenant: str, takes: Sequence[Take], give: bool = False) -> Verdict:
        keys = [_host_key(tenant, t.kind) for t in takes]
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            slots = [self._slot(k) for k in keys]
            levels = []
            for key, slot, take in zip(keys, slots, takes, strict=True):
                held, level, at = _SLOT.unpack_from(self._map, slot * _SLOT.size)
                levels.append(refill(level, now - at, take.capacity) if held == key
                              else float(take.capacity))
            verdict = decide(levels, takes, give)
            if verdict.allowed:
                for key, slot, level in zip(keys, slots, verdict.levels, strict=True):
                    _SLOT.pack_into(self._map, slot * _SLOT.size, key, level.remaining, now)
            return verdict
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _host_key(tenant: str, kind: str) -> int:
    digest = hashlib.blake2b(f"{tenant}\x1f{kind}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1  # 0 marks a free slot


def local_store(state_dir: str | None) -> Store:
    """The host's buckets when there is a state directory its workers share, else this
    process's."""
    if state_dir:
        try:
            return HostStore(Path(state_dir) / "ratelimit.bin")
        except OSError as exc:
            logger.warning("admission: cannot share rate-limit counters in %s (%s); each "
                           "worker counts its own", state_dir, exc)
    return MemoryStore()


class StoreDown(Exception):
    """The shared store did not answer."""


def takes_for(tenant: Tenant, tokens: int) -> list[Take]:
    """What admitting one request of ``tokens`` (estimated) takes from ``tenant``."""
    takes = []
    if tenant.requests_per_minute is not None:
        takes.append(Take(REQUESTS, tenant.requests_per_minute, 1))
    if tenant.tokens_per_minute is not None:
        takes.append(Take(TOKENS, tenant.tokens_per_minute, tokens))
    return takes


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 100) / 100:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def headers(levels: Sequence[Level]) -> list[tuple[str, str]]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits a tenant has."""
    out = []
    for level in levels:
        out += [(f"x-ratelimit-limit-{level.kind}", str(level.limit)),
                (f"x-ratelimit-remaining-{level.kind}", str(max(0, math.floor(level.remaining)))),
                (f"x-ratelimit-reset-{level.kind}", duration(level.reset))]
    return out
