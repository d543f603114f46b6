"""Everything a running sim remembers: live knobs, armed faults, counters and the recent
requests. Tests and the HTTP control surface read and change the server through this one object.

All callers run in greenlets of one hub, and no method here yields, so no locking is needed.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import Counter, deque
from typing import Any

from . import kvevents
from .batch import Batch
from .config import LIVE_KNOBS, SimConfig, coerce_knob
from .costmodel import EngineClock
from .kvcache import BlockAllocator, PrefixCache
from .transfers import TransferBook

DEFAULT_FAIL_STATUS = 500
#: Distinct paths counted one by one; a scanner's random paths end up under "other".
MAX_COUNTED_PATHS = 256
COUNTERS = (
    "completions",
    "streams_started",
    "streams_completed",
    "streams_aborted",
    "streams_dropped",
    "requests_aborted",
    "errors",
    "failed_injected",
    "hung_injected",
    "in_flight",
    "max_in_flight",
    "kv_handles_valid",
    "kv_handles_invalid",
    "kv_handles_absent",
    "kv_handles_incomplete",
    "kv_handles_no_blocks",
    "kv_handles_mooncake",
    "kv_handles_issued",
    "kv_transfers_timed_out",
    "kv_transfers_aborted",
    "kv_transfers_crossed",
    "request_ids_reused",
    "prefix_cached_tokens",
    "prefix_computed_tokens",
    "items_encoded",
    "ec_pushes",
    "ec_params_received",
    "ec_items_received",
    "ec_embeds_resolved",
    "ec_embeds_mismatched",
    "ec_embeds_unresolved",
    "media_from_ec",
    "media_encoded_locally",
    "health_checks",
    "connections_opened",
    "keepalive_closes",
    "profiles_started",
    "profiles_stopped",
    "kv_event_batches_published",
    "kv_event_batches_dropped",
)
FAULTS = ("fail_next", "fail_status", "drop_after", "hang_next", "health_fail")


def _fresh_faults() -> dict[str, Any]:
    return {"fail_next": 0, "fail_status": DEFAULT_FAIL_STATUS, "drop_after": None,
            "hang_next": 0, "health_fail": False}


class SimState:
    """The live state of one ``SimServer``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config.with_engine_id()
        self.engine_id: str = self.config.engine_id  # type: ignore[assignment]
        # Rank 0 is the server's own engine id; other DP ranks get their own, new per start.
        self.rank_engine_ids = [self.engine_id] + [
            str(uuid.uuid4()) for _ in range(self.config.dp_size - 1)]
        self.started_at = time.time()
        self.prefix_cache = PrefixCache(self.config.kv_cache_blocks, self.config.block_size)
        # Open only while the server serves (SimServer.start to stop), as vLLM's publisher.
        self.kv_publisher: kvevents.Publisher | None = None
        self._serving = False
        self.engine = EngineClock()
        self.batch = Batch()
        self.blocks = BlockAllocator()
        self.transfers = TransferBook()
        self._records: deque[dict[str, Any]] = deque(maxlen=self.config.record_limit)
        # LoRA adapters loaded at run time, by name: their path and when they were loaded.
        # Like a real engine's, they outlive a reset of counters and faults.
        self.adapters: dict[str, dict[str, Any]] = {}
        self.reset()

    # -- the public API ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A snapshot (a copy: safe to keep and compare with a later one)."""
        out: dict[str, Any] = dict(self._counters)
        out["requests"] = dict(self._paths)
        out["dp_ranks"] = dict(self._ranks)
        out["models"] = dict(self._models)
        out["adapters"] = sorted(self.adapters)
        out["last_abort_at"] = self.last_abort_at
        out["engine_dead"] = self.engine_dead
        out["healthy"] = self.healthy
        out["profiling"] = self.profiling
        out["role"] = self.config.role
        out["engine_id"] = self.engine_id
        out["faults"] = dict(self.faults)
        return out

    def configure(self, **knobs: Any) -> dict[str, Any]:
        """Change live knobs (see ``config.LIVE_KNOBS``); all or nothing. Returns the config."""
        checked = {}
        for name, value in knobs.items():
            if name not in LIVE_KNOBS:
                raise ValueError(f"unknown or not live-changeable knob {name!r}; "
                                 f"live knobs: {', '.join(sorted(LIVE_KNOBS))}")
            checked[name] = coerce_knob(name, value)
        events = checked.get("kv_events_config", self.config.kv_events_config)
        if self._serving and events != self.config.kv_events_config:
            self._switch_publisher(events, self.config.kv_events_config)
        for name, value in checked.items():
            setattr(self.config, name, value)
        self.prefix_cache.set_block_size(self.config.block_size)
        self.prefix_cache.resize(self.config.kv_cache_blocks)
        self.publish_kv_events()
        return self.config.as_dict()

    def kv_event_sources(self) -> dict[str, Any]:
        """vLLM's ``GET /kv_event_sources``: the publisher's configuration per DP rank."""
        if self.kv_publisher is None:
            return {}
        return {"0": dict(self.kv_publisher.config)}

    def inject(self, **faults: Any) -> dict[str, Any]:
        """Arm faults (all or nothing). Counts replace, they do not add. Returns all faults."""
        checked = {}
        for name, value in faults.items():
            if name in ("fail_next", "hang_next"):
                checked[name] = _count(name, value)
            elif name == "drop_after":
                checked[name] = None if value is None else _count(name, value)
            elif name == "fail_status":
                if isinstance(value, bool) or not isinstance(value, int) \
                        or not 400 <= value <= 599:
                    raise ValueError("fail_status must be an integer in 400..599")
                checked[name] = value
            elif name == "health_fail":
                if not isinstance(value, bool):
                    raise ValueError("health_fail must be a boolean")
                checked[name] = value
            else:
                raise ValueError(f"unknown fault {name!r}; faults: {', '.join(FAULTS)}")
        self.faults.update(checked)
        return dict(self.faults)

    def requests(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The most recent recorded requests, newest last (deep copies)."""
        records = list(self._records)
        if limit is not None:
            records = records[-limit:] if limit > 0 else []
        return copy.deepcopy(records)

    def reset(self) -> None:
        """Forget faults, counters, records and cached blocks; revive a dead engine.

        Knobs stay as configured: a test that slowed the server keeps it slow.
        """
        self.faults: dict[str, Any] = _fresh_faults()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._paths: Counter[str] = Counter()
        self._ranks: Counter[str] = Counter()
        self._live_ids: Counter[str] = Counter()
        self._models: Counter[str] = Counter()
        self.last_abort_at: float | None = None
        self.engine_dead = False
        self.profiling = False
        self._records.clear()
        self.prefix_cache.clear()
        self.engine.reset()
        self.blocks.reset()
        self.transfers.clear()
        self.publish_kv_events()

    def open_kv_events(self) -> None:
        """The server starts serving: publish KV events if configured (ValueError if the
        endpoint cannot be opened)."""
        self._serving = True
        self._switch_publisher(self.config.kv_events_config, None)

    def close_kv_events(self) -> None:
        self._serving = False
        self._switch_publisher(None, None)

    def _switch_publisher(self, config: dict[str, Any] | None,
                          fallback: dict[str, Any] | None) -> None:
        """Replace the publisher; if the new one cannot open, reopen ``fallback`` and raise."""
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None
        try:
            if config is not None:
                self.kv_publisher = kvevents.Publisher(config, self.config.host)
        except ValueError:
            if fallback is not None:
                self.kv_publisher = kvevents.Publisher(fallback, self.config.host)
            raise
        finally:
            self.prefix_cache.recording = self.kv_publisher is not None

    def publish_kv_events(self) -> None:
        """Send what the prefix cache did since the last batch, as vLLM does per engine step."""
        events = self.prefix_cache.take_events()
        if events and self.kv_publisher is not None:
            sent = self.kv_publisher.publish(events)
            self.count("kv_event_batches_published" if sent else "kv_event_batches_dropped")

    # -- used by the app --------------------------------------------------------------------

    def engine_gauges(self, now: float | None = None) -> tuple[int, int, float]:
        """What vLLM's scheduler would report now: (requests running, requests waiting, KV
        cache usage from 0 to 1). Waiting are the requests past ``max_num_seqs`` (batch.py)
        and the prefills the cost model has queued and not started; every other completion in
        flight runs; usage counts the blocks the requests
        in flight hold (the cost model's, 0 without it)."""
        waiting = self.batch.waiting + self.engine.waiting(now)
        running = max(0, self._counters["in_flight"] - waiting)
        usage = min(1.0, self.engine.blocks_held(now) / max(1, self.config.kv_cache_blocks))
        return running, waiting, usage

    @property
    def healthy(self) -> bool:
        return not (self.faults["health_fail"] or self.engine_dead)

    def count(self, name: str, by: int = 1) -> None:
        self._counters[name] += by

    def count_path(self, path: str) -> None:
        if path in self._paths or len(self._paths) < MAX_COUNTED_PATHS:
            self._paths[path] += 1
        else:
            self._paths["other"] += 1

    def count_rank(self, rank: int) -> None:
        self._ranks[str(rank)] += 1

    def count_model(self, model: str) -> None:
        """A completion accepted for ``model`` (the base model's name or an adapter's)."""
        self._models[model] += 1

    def record(self, entry: dict[str, Any]) -> None:
        if self._records.maxlen:
            self._records.append(entry)

    def enter(self, request_id: str | None = None) -> None:
        """A completion starts; ``request_id`` is its ``X-Request-Id``, the name real vLLM
        gives the request inside the engine (a second one in flight under the same name is
        counted: there, the two share state keyed by it)."""
        self._counters["in_flight"] += 1
        if self._counters["in_flight"] > self._counters["max_in_flight"]:
            self._counters["max_in_flight"] = self._counters["in_flight"]
        if request_id is not None:
            if self._live_ids[request_id]:
                self._counters["request_ids_reused"] += 1
            self._live_ids[request_id] += 1

    def leave(self, request_id: str | None = None, slot: bool = False) -> None:
        """A completion ended; ``slot``: it had its place in the batch (batch.py)."""
        if slot:
            self.batch.release(self.config.max_num_seqs)
        self._counters["in_flight"] -= 1
        if request_id is not None:
            self._live_ids[request_id] -= 1
            if self._live_ids[request_id] <= 0:
                del self._live_ids[request_id]

    def abort(self, stream: bool) -> None:
        self._counters["streams_aborted" if stream else "requests_aborted"] += 1
        self.last_abort_at = time.time()

    def take_fail(self) -> int | None:
        """The status to fail this request with, if a ``fail_next`` is armed (consumes one)."""
        if self.faults["fail_next"] > 0:
            self.faults["fail_next"] -= 1
            self._counters["failed_injected"] += 1
            return self.faults["fail_status"]
        return None

    def take_hang(self) -> bool:
        if self.faults["hang_next"] > 0:
            self.faults["hang_next"] -= 1
            self._counters["hung_injected"] += 1
            return True
        return False

    def take_drop(self) -> int | None:
        """Chunks the next stream may send before it is cut, if ``drop_after`` is armed."""
        drop = self.faults["drop_after"]
        self.faults["drop_after"] = None
        return drop


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer")
    return value
