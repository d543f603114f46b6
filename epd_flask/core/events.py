"""What the serving path reports to whoever watches it: one ``EventHook`` per event.

The request context, pipeline, registry, prober and edge fire these hooks; observers (metrics.py)
add listeners to them. Each event is declared once, here, with the arguments its listeners get
(Locust's ``event.py`` is the model). Nothing on the hot path imports a metrics library, and
with nobody listening a hook costs one empty loop. Imports nothing of ours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, ParamSpec

logger = logging.getLogger(__name__)

P = ParamSpec("P")


class FleetEntry(NamedTuple):
    role: str
    url: str
    live: bool


class EventHook(Generic[P]):
    """One event and its listeners. A listener that raises is logged and skipped: watching a
    request must never break it, nor keep the other listeners from hearing of it."""

    def __init__(self) -> None:
        self.name = ""  # set below from the module attribute that declares the hook
        self._listeners: tuple[Callable[P, None], ...] = ()

    def add_listener(self, listener: Callable[P, None]) -> Callable[P, None]:
        """Listen to this event (idempotent); returns ``listener`` so it can decorate."""
        if listener not in self._listeners:
            self._listeners = (*self._listeners, listener)
        return listener

    def remove_listener(self, listener: Callable[P, None]) -> None:
        self._listeners = tuple(x for x in self._listeners if x != listener)

    def fire(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for listener in self._listeners:
            try:
                listener(*args, **kwargs)
            except Exception:
                logger.exception("observer %r failed in %s",
                                 getattr(listener, "__self__", listener), self.name)


#: A client request ended; the listener gets its finished ``RequestContext`` (typed loosely so
#: this module stays at the bottom of the import map).
request_finished: EventHook[[Any]] = EventHook()
#: An upstream call opened: (role, url).
upstream_opened: EventHook[[str, str]] = EventHook()
#: An upstream call closed, whichever way: (role, url).
upstream_closed: EventHook[[str, str]] = EventHook()
#: A routing decision: (role, policy, outcome, url), outcome as ``fleet/policies.py`` names.
routed: EventHook[[str, str, str, str]] = EventHook()
#: A prefill answered with its usage: (url, prompt tokens, of them served from its prefix cache).
prefill_tokens: EventHook[[str, int, int]] = EventHook()
#: An upstream call of a client request failed: (stage, url, error code).
upstream_error: EventHook[[str, str, str]] = EventHook()
#: An attempt is retried before the first byte: (failed stage, error code that caused it).
retry: EventHook[[str, str]] = EventHook()
#: A /health probe ended: (role, url, ok, latency in seconds).
probe: EventHook[[str, str, bool, float]] = EventHook()
#: An instance was evicted: (role, url).
evicted: EventHook[[str, str]] = EventHook()
#: An evicted instance rejoined: (role, url).
rejoined: EventHook[[str, str]] = EventHook()
#: The whole roster with each instance's state, after any change to it.
fleet: EventHook[[Sequence[FleetEntry]]] = EventHook()
#: Every model name some instance of the roster serves, after any change to them.
models: EventHook[[Sequence[str]]] = EventHook()
#: A roster reload was applied (``ok``) or refused (not ``ok``): (source, ok); the source is
#: ``admin`` for an admin API change (the master's SIGHUP reloads are tallied in the state
#: directory, see observe/metrics.py).
reload: EventHook[[str, bool]] = EventHook()
#: This worker's client requests in flight changed: (in flight, its cap).
load: EventHook[[int, int]] = EventHook()
#: A client request was refused before it started: (reason, e.g. ``overloaded``).
refused: EventHook[[str]] = EventHook()
#: KV-cache events heard from an instance: (url, kind, count); kind is ``stored``,
#: ``removed``, ``cleared``, ``malformed`` (a message skipped) or ``gap`` (messages lost).
kv_events: EventHook[[str, str, int]] = EventHook()
#: A stopping worker ended this many requests that outlived its grace period.
ended_by_shutdown: EventHook[[int]] = EventHook()
#: A membership source's reachability (docs/behaviour.md#discovery): (source, up).
discovery: EventHook[[str, bool]] = EventHook()
#: Finished spans of this worker's traces went to the collector (reason None) or were lost
#: (why, as observe/tracing.py names it): (reason, count).
tracing_spans: EventHook[[str | None, int]] = EventHook()



def _name_hooks() -> None:
    for name, value in globals().items():
        if isinstance(value, EventHook):
            value.name = name


_name_hooks()
