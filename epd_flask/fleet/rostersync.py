"""The roster file as a membership source: keeps the live fleet in step with the file and with
the sibling workers.

Hands the live fleet every roster published (by the master on start and SIGHUP, or by a
sibling after an admin change), turns admin registrations into edits of the roster file that
every worker picks up, and runs the greenlet that watches the published roster and writes this
worker's health snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import gevent.lock

from epd_flask.control import rosterfile
from epd_flask.control.roster import Instance, Roster
from epd_flask.control.rosterfile import Change
from epd_flask.control.statedir import StateDir
from epd_flask.core.events import Events
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.live import LiveFleet

logger = logging.getLogger(__name__)

SYNC_INTERVAL = 0.2  # seconds: how soon a worker follows a change published by another
#: The reload tally's source label for admin API changes.
ADMIN = "admin"

_fleets_in_process: dict[int, int] = {}


def snapshot_name() -> str:
    """The name of a new worker's health snapshot: its pid, or ``<pid>-<n>`` for the n-th
    fleet in one process. Every worker must write its own: several apps in one process
    (the in-process tests, an embedding) would otherwise replace each other's snapshot, and
    an eviction one of them wrote could be gone, overwritten by a sibling that never saw the
    instance fail, before the next worker boots and reads it."""
    pid = os.getpid()
    n = _fleets_in_process[pid] = _fleets_in_process.get(pid, 0) + 1
    return str(pid) if n == 1 else f"{pid}-{n}"


class RosterSync:
    def __init__(self, live: LiveFleet, roster_path: str, state: StateDir | None,
                 events: Events | None = None) -> None:
        self.live = live
        self.events = events if events is not None else Events()
        self.registry = live.registry
        self.roster_path = roster_path
        self.state = state
        self._edit = gevent.lock.Semaphore()
        # A full disk or a vanished state directory backs off instead of spinning.
        self._loop = Periodic("state sync", self.sync, lambda: SYNC_INTERVAL,
                              backoff=SYNC_INTERVAL * 10)
        self._seen: tuple[int, int, int] | None = None
        self._written = -1
        self._snapshot = snapshot_name()

    @property
    def generation(self) -> int:
        return self.live.view.generation

    def adopt(self, roster: Roster, generation: int, origin: str = "") -> None:
        """Route by ``roster`` from the next request on. Health of instances that stay (same
        URL and role) and the round-robin cursors carry over; requests already under way
        keep the instances they were given."""
        self.live.adopt(roster, generation, origin)

    # -- admin changes -------------------------------------------------------------------

    def register(self, inst: Instance) -> Change:
        with self._changing():
            change = rosterfile.register(self.roster_path, inst)
            if change.status != "unchanged":
                self._publish(change.roster, f"{change.status} {inst.url} through the admin API")
        return change

    def unregister(self, url: str) -> Change:
        with self._changing():
            change = rosterfile.unregister(self.roster_path, url)
            self._publish(change.roster, f"removed {url} through the admin API")
        return change

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        rows = []
        sources = self.live.view.sources
        for s in self.registry.states():
            rows.append({
                **s.instance.record(),
                "source": sources.get(s.instance.url, "file"),
                "state": "live" if s.live else "evicted",
                "confirmed": s.confirmed,
                "consecutive_failures": s.failures,
                "evicted_for_s": None if s.evicted_at is None else round(now - s.evicted_at, 3),
                "last_probe_at": s.last_probe_at,
                "last_probe_ok": s.last_probe_ok,
                "last_latency_ms": None if s.last_latency is None
                else round(s.last_latency * 1000, 3),
                "last_error": s.last_error,
            })
        return {"object": "list", "generation": self.generation, "worker": os.getpid(),
                "roster_file": self.roster_path, "data": rows}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._edit:  # greenlets of this worker first, then other processes
            if self.state is None:
                yield
            else:
                with self.state.lock():
                    yield

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """One admin change: serialised with every other writer of the roster, and counted
        as a reload applied or refused, in the state directory beside the master's SIGHUP
        reloads (``epd_roster_reloads_total``)."""
        with self._locked():
            try:
                yield
            except BaseException:
                self._count_reload(ok=False)
                raise
            self._count_reload(ok=True)

    def _count_reload(self, ok: bool) -> None:
        if self.state is not None:
            try:
                self.state.record_reload(ADMIN, "ok" if ok else "rejected")
            except OSError as exc:
                logger.error("cannot count the roster change in %s: %s", self.state.path, exc)
        self.events.reload.fire(ADMIN, ok)

    def _publish(self, roster: Roster, origin: str) -> None:
        """Every worker must follow, not only this one: publish, then adopt here at once (the
        siblings' sync greenlets follow within SYNC_INTERVAL)."""
        generation = self.generation + 1
        if self.state is not None:
            try:
                generation = self.state.publish(roster, origin)
                self._seen = self.state.signature()
            except OSError as exc:  # the file is written: siblings follow at the next reload
                logger.error("cannot publish the roster to %s: %s", self.state.path, exc)
        self.adopt(roster, generation, origin)

    # -- the sync greenlet ---------------------------------------------------------------

    def start(self) -> None:
        """Inherit the health the previous workers learned, then keep in step."""
        if self.state is None:
            return
        adopted = self.registry.restore(self.state.read_health())
        if adopted:
            logger.info("inherited the health of %d instances from earlier workers",
                        len(adopted))
        # Not the current signature: the roster this worker booted with was read earlier (in
        # create_app), and a publication since then must not be mistaken for it.
        self._seen = None
        self.sync()
        self.state.prune_health(os.getpid())
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        if self.state is not None:
            with contextlib.suppress(OSError):
                self._write_health()

    def sync(self) -> None:
        """One step: follow a newly published roster; write health if it changed."""
        assert self.state is not None
        signature = self.state.signature()
        if signature is not None and signature != self._seen:
            self._seen = signature
            published = self.state.published()
            if published is not None and published.generation != self.generation:
                self.adopt(published.roster, published.generation, published.origin)
        if self.registry.version != self._written:
            self._write_health()

    def _write_health(self) -> None:
        assert self.state is not None
        version = self.registry.version
        self.state.write_health(self._snapshot, self.registry.export())
        self._written = version

