"""Mooncake bootstrap discovery: which engine each prefill runs on each data-parallel rank.

A MooncakeConnector prefill serves ``GET /query`` on its bootstrap server, naming the engine id
of every DP rank; decode needs that id to pull the KV. The ids change whenever a prefill
restarts, so a background greenlet (started by the server, like the prober) learns them at
start, again as soon as a prefill rejoins after an eviction, and re-checks them every probe
interval (a quick restart is never evicted, only its answer changes). It is the prefill role's
source of candidates: every (prefill, rank) pair with a current engine id, among which the
prefill's routing policy chooses like any other role's (docs/behaviour.md#routing).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import gevent.pool

from epd_flask.control.roles import PREFILL
from epd_flask.control.roster import Instance
from epd_flask.core.errors import ProxyError
from epd_flask.core.logfmt import names, quote
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import Placement
from epd_flask.fleet.routing import no_backend
from epd_flask.upstream.transport import Transport

Readiness = tuple[bool, str]

logger = logging.getLogger(__name__)

#: How often the loop looks at the registry for rejoins and due queries (no I/O unless due).
TICK_SECONDS = 0.25
#: How soon an undiscovered (or rejoined) prefill is asked again.
RETRY_SECONDS = 0.5
QUERY_CONCURRENCY = 16


class BootstrapAnswerError(ValueError):
    """A ``/query`` answer we cannot route by."""


def parse_query(doc: Any) -> tuple[str, ...]:
    """Engine ids by DP rank from a ``/query`` answer.

    Today's shape is keyed by rank: ``{"0": {"engine_id": ..., "worker_addr": ...}, ...}``,
    ranks contiguous from 0. Older bootstrap servers keyed the entries by engine id; their
    rank is the entry's ``dp_rank`` when it has one, else its position.
    """
    if not isinstance(doc, dict) or not doc:
        raise BootstrapAnswerError("the answer names no data-parallel engines")
    ranked: list[tuple[int, str]] = []
    if all(isinstance(k, str) and k.isdigit() for k in doc):
        for key, entry in doc.items():
            engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
            if not isinstance(engine_id, str) or not engine_id:
                raise BootstrapAnswerError(f"rank {key} has no engine_id")
            ranked.append((int(key), engine_id))
    else:
        for position, (engine_id, entry) in enumerate(doc.items()):
            rank = entry.get("dp_rank") if isinstance(entry, dict) else None
            if isinstance(rank, bool) or not isinstance(rank, int):
                rank = position
            ranked.append((rank, engine_id))
    ranked.sort()
    if [rank for rank, _ in ranked] != list(range(len(ranked))):
        raise BootstrapAnswerError(
            f"ranks must be contiguous from 0, got {[rank for rank, _ in ranked]}")
    return tuple(engine_id for _, engine_id in ranked)


@dataclass
class Engines:
    """What one prefill's bootstrap server last told us."""

    bootstrap_url: str
    engine_ids: tuple[str, ...]
    # False once the prefill rejoined after an eviction: it restarted, so its ids are stale
    # and it takes no traffic until asked again.
    current: bool = True


class BootstrapDiscovery:
    def __init__(self, live: LiveFleet, transport: Transport) -> None:
        self.live = live
        self.transport = transport
        self._engines: dict[str, Engines] = {}
        self._asked_at: dict[str, float] = {}
        self._was_live: dict[str, bool] = {}
        self._errors: dict[str, str] = {}
        self._pool = gevent.pool.Pool(QUERY_CONCURRENCY)
        self._loop = Periodic("bootstrap discovery round", self.refresh_due,
                              lambda: TICK_SECONDS)

    # -- the background greenlet ------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def refresh_due(self) -> None:
        """Ask every live prefill whose answer is missing, stale or due for a re-check."""
        now = time.monotonic()
        recheck = self.live.settings.probe_interval
        due: list[Instance] = []
        listed: set[str] = set()
        for state in self.live.registry.states():
            inst = state.instance
            if inst.role != PREFILL:
                continue
            url = inst.url
            listed.add(url)
            entry = self._engines.get(url)
            if entry is not None and entry.bootstrap_url != inst.bootstrap_url:
                entry.current = False  # the roster moved its bootstrap server
            if state.live and not self._was_live.get(url, True) and entry is not None:
                entry.current = False
                logger.info("prefill %s rejoined; asking its bootstrap server again", url)
            self._was_live[url] = state.live
            if not state.live:
                continue  # the prober says when it is back
            wait = recheck if entry is not None and entry.current else RETRY_SECONDS
            asked = self._asked_at.get(url)
            if asked is None or now - asked >= wait:
                due.append(inst)
        for table in (self._engines, self._asked_at, self._was_live, self._errors):
            for url in [u for u in table if u not in listed]:
                del table[url]
        if due:
            self._pool.map(self.refresh, due)

    def refresh(self, inst: Instance) -> bool:
        """Query one prefill's bootstrap server now; True when its engines are known."""
        url = inst.url
        self._asked_at[url] = time.monotonic()
        if not inst.bootstrap_url:
            self._note_error(url, "no bootstrap_url in the roster")
            return False
        try:
            resp = self.transport.send(
                "GET", inst.bootstrap_url + "/query", stage="bootstrap", headers={},
                read_timeout=self.live.settings.probe_timeout, stream=False)
            status, raw = resp.status_code, resp.content
            resp.close()
            if status != 200:
                raise BootstrapAnswerError(f"/query answered {status}")
            engine_ids = parse_query(json.loads(raw))
        except (ProxyError, ValueError) as err:
            self._note_error(url, f"{inst.bootstrap_url}/query: {err}")
            return False
        if self.live.registry.get(url) is None:
            return False  # removed from the roster while we asked
        old = self._engines.get(url)
        if old is None:
            logger.info("prefill %s: Mooncake engines %s", url, names(engine_ids, 16))
        elif old.engine_ids != engine_ids:
            logger.warning("prefill %s announced new Mooncake engines %s (it restarted); "
                           "routing to them from now on", url, names(engine_ids, 16))
        self._engines[url] = Engines(inst.bootstrap_url, engine_ids)
        self._errors.pop(url, None)
        return True

    def _note_error(self, url: str, message: str) -> None:
        if self._errors.get(url) != message:
            logger.warning("prefill %s: Mooncake bootstrap discovery failed: %s", url,
                           quote(message))
        self._errors[url] = message

    # -- what requests and readiness see ----------------------------------------------------

    def placements(self, model: str | None = None, base: str | None = None) -> list[Placement]:
        """Every (live prefill, rank) pair with a current engine id, in roster order; with
        ``model``, only prefills serving it (on ``base``) (docs/behaviour.md#models)."""
        out: list[Placement] = []
        for inst in self.live.registry.live(PREFILL, model, base):
            entry = self._engines.get(inst.url)
            if entry is None or not entry.current or entry.bootstrap_url != inst.bootstrap_url:
                continue
            out.extend(Placement(inst, rank, engine_id)
                       for rank, engine_id in enumerate(entry.engine_ids))
        return out

    def candidates(self, role: str, model: str | None = None,
                   base: str | None = None) -> list[Placement]:
        """The prefill role's candidates: every discovered (prefill, rank) pair."""
        pairs = self.placements(model, base)
        if not pairs:
            raise no_backend(self.live.settings, role, model,
                             "instance with a discovered Mooncake engine")
        return pairs

    def ready(self) -> Readiness:
        """Not ready until every live prefill has been discovered once, and one is usable."""
        # Counted, never named: /ready and /health answer anyone (each failure is logged).
        missing = [i for i in self.live.registry.live(PREFILL) if i.url not in self._engines]
        if missing:
            return False, (f"Mooncake bootstrap of {len(missing)} live prefill(s) not "
                           "discovered yet")
        if not self.placements():
            return False, "no live prefill with a current Mooncake engine id"
        return True, "ok"

    def snapshot(self) -> dict[str, Any]:
        """Per prefill, the engine ids by rank (the /health body)."""
        return {url: {"bootstrap_url": e.bootstrap_url, "engine_ids": list(e.engine_ids),
                      "current": e.current}
                for url, e in self._engines.items()}
