"""Live or evicted: what this worker believes about each roster instance.

Fed by active probes and by passive signals from real requests. State is per worker (each
gunicorn worker probes for itself), keyed by URL so it survives a roster change for every
instance that is still listed; ``export``/``restore`` carry it across a reload, when gunicorn
replaces the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from epd_flask.control import settings
from epd_flask.control.roster import Instance
from epd_flask.core.events import Events, FleetEntry
from epd_flask.core.logfmt import change, quote
from epd_flask.fleet.enginemetrics import EngineLoad
from epd_flask.fleet.loadboard import CALLS, TOKENS, LoadBoard
from epd_flask.fleet.loadshare import LoadShare

logger = logging.getLogger(__name__)

#: The weight of each new call in ``Registry.mean_tokens``.
MEAN_WEIGHT = 0.05

@dataclass
class InstanceState:
    """``live`` is optimistic (a new instance is live until it fails); ``confirmed`` means this
    worker, or the one it inherited state from, has seen the instance answer."""

    instance: Instance
    live: bool = True
    confirmed: bool = False
    failures: int = 0
    changed_at: float = 0.0
    evicted_at: float | None = None
    last_probe_at: float | None = None
    last_probe_ok: bool | None = None
    last_latency: float | None = None
    last_error: str | None = None
    in_flight: int = 0
    #: The estimated prompt tokens of those calls: what a prefill has queued
    #: (docs/behaviour.md#routing-policies).
    tokens_in_flight: int = 0
    #: The engine's last readable queue (``GET /metrics``), when it was read (monotonic) and
    #: the proxies' calls open then (``Registry.proxies``); a failed read leaves them
    #: (docs/behaviour.md#routing-policies).
    engine: EngineLoad | None = None
    engine_read_at: float | None = None
    engine_calls_at_read: int = 0
    engine_error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    #: The instance's last readable ``/v1/models`` answer, cards by model id (None: never
    #: read); an unreadable answer leaves it as it was (docs/behaviour.md#models).
    cards: dict[str, dict[str, Any]] | None = None
    models_error: str | None = None

    def served(self) -> frozenset[str] | None:
        """The model names this instance takes requests for: its roster ``models`` when
        given, else what its ``/v1/models`` last listed; None while neither is known (then it
        is a candidate for any model, so a fleet starts serving before its first read)."""
        if self.instance.models is not None:
            return frozenset(self.instance.models)
        return None if self.cards is None else frozenset(self.cards)

    def queue(self, now: float, max_age: float, calls: int) -> int:
        """The requests this instance's engine holds, as best this worker knows, given
        ``calls``, the proxies' calls open on it now (``Registry.proxies``): its last read if
        not older than ``max_age``, corrected by their calls opened or closed since (what
        every host sent it then, plus what the proxies heard of did since); else their open
        calls."""
        if self.engine is None or self.engine_read_at is None \
                or now - self.engine_read_at > max_age:
            return calls
        return max(calls, self.engine.queue + calls - self.engine_calls_at_read)

    def serves(self, model: str | None) -> bool:
        names = self.served()
        return model is None or names is None or model in names

    def parent(self, model: str) -> str | None:
        """The base model of ``model`` when this instance lists it as an adapter."""
        card = (self.cards or {}).get(model)
        parent = card.get("parent") if card else None
        return parent if isinstance(parent, str) and parent else None

    def same_base(self, model: str, base: str | None) -> bool:
        """Whether ``model`` runs on ``base`` here (None, or a lineage unknown here: yes)."""
        if base is None or self.cards is None or model not in self.cards:
            return True
        return (self.parent(model) or model) == base


class Registry:
    """Instances by URL with their health; eviction after ``fail_threshold`` failures in a row.

    An evicted instance keeps being probed and rejoins on its first success; after
    ``evicted_ttl`` seconds (0 = never) it is forgotten.
    """

    def __init__(
        self, instances: Iterable[Instance],
        fail_threshold: int = settings.default("fail_threshold"),
        evicted_ttl: float = settings.default("evicted_ttl"),
        events: Events | None = None, board: LoadBoard | None = None,
        share: LoadShare | None = None,
    ) -> None:
        self.events = events if events is not None else Events()
        #: Where this worker publishes its open calls and reads its siblings' (their sum is
        #: ``host``); without one (no state directory) the host is this worker.
        self.board = board if board is not None else LoadBoard(None)
        #: The other proxy hosts' open calls, when a load store is shared (``proxies``).
        self.share = share
        self.fail_threshold = fail_threshold
        self.evicted_ttl = evicted_ttl
        self._states: dict[str, InstanceState] = {}
        self.version = 0
        #: The mean estimated prompt tokens of the calls this worker opens (a moving average):
        #: what a request another host sent an engine is taken to weigh.
        self.mean_tokens = 0.0
        self.replace(instances)

    def replace(self, instances: Iterable[Instance]) -> None:
        """Adopt a new roster, keeping health of instances that stay (same URL and role)."""
        fresh: dict[str, InstanceState] = {}
        for inst in instances:
            old = self._states.get(inst.url)
            if old is not None and old.instance.role == inst.role:
                old.instance = inst
                fresh[inst.url] = old
            else:
                fresh[inst.url] = InstanceState(inst)
        self._states = fresh
        self.version += 1
        self._announce()

    def configure(self, fail_threshold: int, evicted_ttl: float) -> None:
        self.fail_threshold = fail_threshold
        self.evicted_ttl = evicted_ttl

    def get(self, url: str) -> InstanceState | None:
        return self._states.get(url)

    def track(self, url: str, delta: int, tokens: int = 0) -> None:
        """An upstream call to ``url`` for a prompt of ``tokens`` (estimated) opened (+1) or
        closed (-1): the load routing reads; an opened one is also claimed on the load store,
        if any, for the other hosts' next choices. In this worker's state a call to an
        instance the roster dropped meanwhile counts for nobody."""
        state = self._states.get(url)
        if state is not None:
            state.in_flight = max(0, state.in_flight + delta)
            state.tokens_in_flight = max(0, state.tokens_in_flight + delta * tokens)
        # The host's count goes by URL whatever the roster says now: a call that closes after
        # its instance was dropped (and perhaps listed again) is taken off as it was put on.
        self.board.add(url, delta, CALLS)
        if tokens:
            self.board.add(url, delta * tokens, TOKENS)
        if delta > 0 and tokens > 0:
            self.mean_tokens += MEAN_WEIGHT * (tokens - self.mean_tokens)
        if delta > 0 and self.share is not None:
            self.share.claim(url, tokens)

    def host(self, url: str) -> tuple[int, int]:
        """The upstream calls open on ``url`` from every worker of this proxy host, and their
        estimated prompt tokens (the load board; this worker's alone without one)."""
        counts = self.board.counts(url)
        return counts[CALLS], counts[TOKENS]

    def proxies(self, url: str) -> tuple[int, int]:
        """The upstream calls open on ``url`` from every proxy host this worker hears of, and
        their estimated prompt tokens: this host's (``host``) and, with a load store, the
        other hosts' as they last published them (docs/behaviour.md#routing-policies 2)."""
        calls, tokens = self.host(url)
        if self.share is None:
            return calls, tokens
        theirs = self.share.counts(url)
        return calls + theirs[0], tokens + theirs[1]

    def record_engine(self, url: str, load: EngineLoad, now: float | None = None) -> None:
        """A read of ``url``'s engine queue; what the proxies had open on it then
        (``proxies``) is kept, so the calls they open or close later can be added to it."""
        state = self._states.get(url)
        if state is None:
            return
        if state.engine_error is not None:
            logger.info("instance %s: its engine's queue is read again", url)
            state.engine_error = None
        state.engine = load
        state.engine_read_at = time.monotonic() if now is None else now
        state.engine_calls_at_read = self.proxies(url)[0]

    def record_engine_failure(self, url: str, error: str) -> None:
        """A failed read: the last values stay (they age out of routing), logged once until a
        read succeeds again."""
        state = self._states.get(url)
        if state is None:
            return
        if state.engine_error is None:
            logger.warning("instance %s: cannot read its engine's queue (%s); routing counts "
                           "this worker's calls to it until it can", url, error)
        state.engine_error = error

    def states(self) -> list[InstanceState]:
        return list(self._states.values())

    def instances(self, role: str | None = None) -> list[Instance]:
        states = self._states.values()
        return [s.instance for s in states if role is None or s.instance.role == role]

    def live(self, role: str, model: str | None = None,
             base: str | None = None) -> list[Instance]:
        """Live instances of ``role``; with ``model``, those serving it (on ``base``, when
        given: a prefill must run a request on the base model its decode runs it on)."""
        return [s.instance for s in self._states.values()
                if s.live and s.instance.role == role and s.serves(model)
                and (base is None or model is None or s.same_base(model, base))]

    def serves_anywhere(self, role: str, model: str | None) -> bool:
        """Whether any instance of ``role``, live or evicted, is known to serve ``model``
        (or might: its models are not known yet)."""
        return any(s.instance.role == role and s.serves(model) for s in self._states.values())

    def base_of(self, url: str, model: str | None) -> str | None:
        """The base model ``model`` runs on at ``url``, if that instance knows."""
        state = self._states.get(url)
        if state is None or model is None or state.cards is None or model not in state.cards:
            return None
        return state.parent(model) or model

    def record_models(self, url: str, cards: dict[str, dict[str, Any]] | None,
                      error: str | None = None) -> None:
        """A ``/v1/models`` read: its cards, or (``cards`` None) why it failed, in which case
        the last known list stays."""
        state = self._states.get(url)
        if state is None:
            return
        if cards is None:
            if error != state.models_error:
                logger.warning("instance %s: cannot read its models (%s); keeping %s", url,
                               quote(error), "its last known list" if state.cards is not None
                               else "it a candidate for any model")
            state.models_error = error
            return
        state.models_error = None
        if cards.keys() != (state.cards or {}).keys() or state.cards is None:
            logger.info("instance %s (%s) serves models: %s", url, state.instance.role,
                        change(state.cards, cards))
            state.cards = cards
            self._changed(state)
            self._announce()
        else:
            state.cards = cards

    def confirmed(self, role: str) -> list[Instance]:
        """Live instances known to answer: what readiness counts."""
        return [s.instance for s in self._states.values()
                if s.live and s.confirmed and s.instance.role == role]

    def record_success(self, url: str, latency: float | None = None) -> None:
        state = self._states.get(url)
        if state is None:
            return  # removed meanwhile: a late result must not resurrect it
        rejoined = not state.live
        if rejoined:
            logger.info("instance %s (%s) rejoined", url, state.instance.role)
        if not (state.live and state.confirmed and state.failures == 0):
            self._changed(state)
        state.live = True
        state.confirmed = True
        state.failures = 0
        state.evicted_at = None
        state.last_error = None
        if latency is not None:
            state.last_latency = latency
        if rejoined:
            self.events.rejoined.fire(state.instance.role, url)
            self._announce()

    def record_failure(self, url: str, reason: str) -> None:
        """A failed probe, or a refused connection on a real request (the passive signal)."""
        state = self._states.get(url)
        if state is None:
            return
        state.failures += 1
        state.last_error = reason
        self._changed(state)
        if state.live and state.failures >= self.fail_threshold:
            state.live = False
            state.evicted_at = time.monotonic()
            logger.warning(
                "instance %s (%s) evicted after %d consecutive failures: %s",
                url, state.instance.role, state.failures, reason,
            )
            self.events.evicted.fire(state.instance.role, url)
            self._announce()

    def _changed(self, state: InstanceState) -> None:
        state.changed_at = time.time()
        self.version += 1

    def forget_expired(self, now: float | None = None) -> list[str]:
        """Drop instances evicted for longer than the TTL; returns their URLs."""
        if self.evicted_ttl <= 0:
            return []
        now = time.monotonic() if now is None else now
        gone = [
            url for url, s in self._states.items()
            if not s.live and s.evicted_at is not None and now - s.evicted_at > self.evicted_ttl
        ]
        for url in gone:
            logger.warning("instance %s forgotten after %.0f s evicted", url, self.evicted_ttl)
            del self._states[url]
        if gone:
            self.version += 1
            self._announce()
        return gone

    def _announce(self) -> None:
        self.events.fleet.fire([FleetEntry(s.instance.role, url, s.live)
                                for url, s in self._states.items()])
        self.events.models.fire(
            sorted({m for s in self._states.values() for m in s.served() or ()}))

    def export(self) -> dict[str, dict[str, Any]]:
        """Health by URL as plain JSON-able data, with wall-clock times another process can
        read (monotonic clocks are not comparable across reboots)."""
        now_wall, now_mono = time.time(), time.monotonic()
        out: dict[str, dict[str, Any]] = {}
        for url, s in self._states.items():
            out[url] = {
                "role": s.instance.role, "live": s.live, "confirmed": s.confirmed,
                "failures": s.failures, "changed_at": s.changed_at,
                "evicted_at": None if s.evicted_at is None
                else now_wall - (now_mono - s.evicted_at),
                "last_probe_at": s.last_probe_at, "last_probe_ok": s.last_probe_ok,
                "last_latency": s.last_latency, "last_error": s.last_error,
                "cards": s.cards,
            }
        return out

    def restore(self, entries: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Adopt exported health for instances still listed in the same role, where it is
        newer than what this registry knows; returns the URLs adopted."""
        now_wall, now_mono = time.time(), time.monotonic()
        adopted = []
        for url, entry in entries.items():
            state = self._states.get(url)
            try:
                if state is None or entry.get("role") != state.instance.role \
                        or float(entry.get("changed_at") or 0) <= state.changed_at:
                    continue
                evicted_wall = entry.get("evicted_at")
                state.live = bool(entry["live"])
                state.confirmed = bool(entry.get("confirmed"))
                state.failures = int(entry.get("failures") or 0)
                state.changed_at = float(entry["changed_at"])
                if state.live:
                    state.evicted_at = None
                elif evicted_wall is None:
                    state.evicted_at = now_mono
                else:  # the TTL keeps counting from the original eviction
                    state.evicted_at = now_mono - max(0.0, now_wall - float(evicted_wall))
                state.last_probe_at = entry.get("last_probe_at")
                state.last_probe_ok = entry.get("last_probe_ok")
                state.last_latency = entry.get("last_latency")
                state.last_error = entry.get("last_error")
                cards = entry.get("cards")
                if isinstance(cards, dict) and all(isinstance(c, dict) for c in cards.values()):
                    state.cards = dict(cards)
            except (KeyError, TypeError, ValueError):
                logger.warning("ignoring an unreadable health snapshot entry for %s", url)
                continue
            adopted.append(url)
        if adopted:
            self.version += 1
            self._announce()
        return adopted

    def snapshot(self) -> dict[str, dict[str, list[str]]]:
        """Per role, the live and evicted URLs (the /health body)."""
        out: dict[str, dict[str, list[str]]] = {}
        for s in self._states.values():
            bucket = out.setdefault(s.instance.role, {"live": [], "evicted": []})
            bucket["live" if s.live else "evicted"].append(s.instance.url)
        return out
