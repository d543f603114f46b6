"""What the serving path reports to whoever watches it: one small observer interface.

The request context, pipeline, registry and prober call ``bus``; observers (metrics.py) subscribe
to it. Nothing on the hot path imports a metrics library, and with nobody subscribed a hook costs
one empty loop. Imports nothing of ours.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class FleetEntry(NamedTuple):
    role: str
    url: str
    live: bool


class Observer:
    """Do-nothing hooks; an observer overrides the ones it watches.

    ``request_finished`` gets the finished ``RequestContext`` (typed loosely so this module stays
    at the bottom of the import map).
    """

    def request_finished(self, ctx: Any) -> None: ...

    def upstream_opened(self, role: str, url: str) -> None: ...

    def upstream_closed(self, role: str, url: str) -> None: ...

    def upstream_error(self, stage: str, url: str, kind: str) -> None: ...

    def retry(self, stage: str, cause: str) -> None: ...

    def probe(self, role: str, url: str, ok: bool, latency: float) -> None: ...

    def evicted(self, role: str, url: str) -> None: ...

    def rejoined(self, role: str, url: str) -> None: ...

    def fleet(self, entries: Sequence[FleetEntry]) -> None:
        """The whole roster with each instance's state, after any change to it."""

    def reload(self, ok: bool) -> None:
        """A roster reload was applied (``ok``) or refused (not ``ok``)."""

    def load(self, in_flight: int, limit: int) -> None:
        """This worker's client requests in flight changed (``limit``: its cap)."""

    def refused(self, reason: str) -> None:
        """A client request was refused before it started (``overloaded``)."""

    def ended_by_shutdown(self, count: int) -> None:
        """A stopping worker ended ``count`` requests that outlived its grace period."""


class Bus(Observer):
    """Hands every hook to each subscriber; an observer that raises never breaks a request."""

    def __init__(self) -> None:
        self._observers: tuple[Observer, ...] = ()

    def subscribe(self, observer: Observer) -> None:
        if observer not in self._observers:
            self._observers = (*self._observers, observer)

    def unsubscribe(self, observer: Observer) -> None:
        self._observers = tuple(o for o in self._observers if o is not observer)

    def _emit(self, hook: str, *args: Any) -> None:
        for observer in self._observers:
            try:
                getattr(observer, hook)(*args)
            except Exception:
                logger.exception("observer %r failed in %s", observer, hook)

    def request_finished(self, ctx: Any) -> None:
        self._emit("request_finished", ctx)

    def upstream_opened(self, role: str, url: str) -> None:
        self._emit("upstream_opened", role, url)

    def upstream_closed(self, role: str, url: str) -> None:
        self._emit("upstream_closed", role, url)

    def upstream_error(self, stage: str, url: str, kind: str) -> None:
        self._emit("upstream_error", stage, url, kind)

    def retry(self, stage: str, cause: str) -> None:
        self._emit("retry", stage, cause)

    def probe(self, role: str, url: str, ok: bool, latency: float) -> None:
        self._emit("probe", role, url, ok, latency)

    def evicted(self, role: str, url: str) -> None:
        self._emit("evicted", role, url)

    def rejoined(self, role: str, url: str) -> None:
        self._emit("rejoined", role, url)

    def fleet(self, entries: Sequence[FleetEntry]) -> None:
        self._emit("fleet", entries)

    def reload(self, ok: bool) -> None:
        self._emit("reload", ok)

    def load(self, in_flight: int, limit: int) -> None:
        self._emit("load", in_flight, limit)

    def refused(self, reason: str) -> None:
        self._emit("refused", reason)

    def ended_by_shutdown(self, count: int) -> None:
        self._emit("ended_by_shutdown", count)


bus = Bus()
