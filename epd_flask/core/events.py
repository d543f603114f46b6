"""What the serving path reports to whoever watches it: one app's ``Events``, one
``EventHook`` per event.

Each app builds its own ``Events`` (``app.build_services``) and hands it to everything that
fires: the request context (its legs, retries and routing decisions), registry, prober,
KV-event readers, roster sync, membership sources, in-flight counter, drain and admission;
its observers (observe/observer.py) listen to it. Two apps in one process never hear each
other's events (Locust hangs its hooks on its ``Environment``, Flask sends its signals with
``sender=app``).
Each event is declared once, below, with the arguments its listeners get. Nothing on the hot
path imports a metrics library, and with nobody listening a hook costs one empty loop.
Imports nothing of ours.
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

    def __init__(self, name: str = "") -> None:
        self.name = name
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


class Events:
    """One app's hooks, an attribute each, made fresh per instance from the declarations
    below (their annotations name the arguments)."""

    #: A client request ended; the listener gets its finished ``RequestContext`` (typed
    #: loosely so this module stays at the bottom of the import map).
    request_finished: EventHook[[Any]]
    #: An upstream call opened: (role, url).
    upstream_opened: EventHook[[str, str]]
    #: An upstream call closed, whichever way: (role, url).
    upstream_closed: EventHook[[str, str]]
    #: A routing decision recorded on the request (``RequestContext.decided``): (role, policy,
    #: outcome, url), outcome as ``fleet/policies.py`` names.
    routed: EventHook[[str, str, str, str]]
    #: A prefill answered with its usage: (url, prompt tokens, of them served from its prefix
    #: cache).
    prefill_tokens: EventHook[[str, int, int]]
    #: An upstream call of a client request failed: (stage, url, error code).
    upstream_error: EventHook[[str, str, str]]
    #: An attempt is retried before the first byte: (failed stage, error code that caused it).
    retry: EventHook[[str, str]]
    #: A /health probe ended: (role, url, ok, latency in seconds).
    probe: EventHook[[str, str, bool, float]]
    #: An instance was evicted: (role, url).
    evicted: EventHook[[str, str]]
    #: An evicted instance rejoined: (role, url).
    rejoined: EventHook[[str, str]]
    #: The whole roster with each instance's state, after any change to it.
    fleet: EventHook[[Sequence[FleetEntry]]]
    #: Every model name some instance of the roster serves, after any change to them.
    models: EventHook[[Sequence[str]]]
    #: A roster reload was applied (``ok``) or refused (not ``ok``): (source, ok); the source
    #: is ``admin`` for an admin API change (the master's SIGHUP reloads are tallied in the
    #: state directory, see observe/families.py).
    reload: EventHook[[str, bool]]
    #: This worker's client requests in flight changed: (in flight, its cap).
    load: EventHook[[int, int]]
    #: A client request was refused before it started: (reason, e.g. ``overloaded``).
    refused: EventHook[[str]]
    #: KV-cache events heard from an instance: (url, kind, count); kind is ``stored``,
    #: ``removed``, ``cleared``, ``malformed`` (a message skipped) or ``gap`` (messages lost).
    kv_events: EventHook[[str, str, int]]
    #: A stopping worker ended this many requests that outlived its grace period.
    ended_by_shutdown: EventHook[[int]]
    #: A membership source's reachability (docs/behaviour.md#discovery): (source, up).
    discovery: EventHook[[str, bool]]
    #: Finished spans of this worker's traces went to the collector (reason None) or were
    #: lost (why, as observe/tracing.py names it): (reason, count).
    tracing_spans: EventHook[[str | None, int]]
    #: Admission's tenants, each with its class, whenever the roster changes while admission
    #: is on (docs/behaviour.md#admission): ((tenant, priority), ...), ``default`` among them.
    admission_tenants: EventHook[[Sequence[tuple[str, str]]]]
    #: A request began (+1) or stopped (-1) waiting for capacity: (tenant, priority, change).
    admission_queue: EventHook[[str, str, int]]
    #: Admission let a request through: (tenant, priority, seconds it waited in the queue;
    #: None when it went out at once).
    admission_admitted: EventHook[[str, str, float | None]]
    #: Admission refused a request, or its client left the queue: (tenant, reason as
    #: ``serving/admission.py``'s ``REASONS`` names it).
    admission_rejected: EventHook[[str, str]]
    #: A request's tokens were counted when it ended (its usage, else the estimate):
    #: (tenant, tokens).
    admission_tokens: EventHook[[str, int]]
    #: Whether the shared rate-limit store answered its latest call (None: no store).
    admission_store: EventHook[[bool | None]]
    #: Whether the store where proxy hosts share their open calls answered the host's latest
    #: exchange, this worker's or its exchanging sibling's (None: no store;
    #: docs/behaviour.md#routing-policies).
    load_store: EventHook[[bool | None]]

    def __init__(self) -> None:
        for name in HOOKS:
            setattr(self, name, EventHook(name))

    def hooks(self) -> dict[str, EventHook[Any]]:
        """Every hook by name, in declaration order."""
        hooks: dict[str, EventHook[Any]] = {name: getattr(self, name) for name in HOOKS}
        return hooks


#: The hooks' names, in declaration order.
HOOKS: tuple[str, ...] = tuple(Events.__annotations__)
