"""Membership sources: where a worker learns of instances besides the roster file
(docs/behaviour.md#discovery).

Each source is a class named in ``control/sourcespecs.py`` and built here from the roster's
``discovery:`` entry. It runs its own greenlet(s) between ``start()`` and ``stop()``, hands
its whole current set of instances to the worker's ``LiveFleet`` (``live.offer(name,
instances, origin)``) whenever that set changes, and keeps its reachability in ``state``
(``epd_discovery_up``, the status page, ``GET /instances``).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from epd_flask.control import sourcespecs
from epd_flask.control.roster import Instance, RosterError, parse_instance
from epd_flask.control.statedir import StateDir
from epd_flask.control.urlpolicy import URLPolicy, URLPolicyError, check_addresses
from epd_flask.core.events import Events
from epd_flask.fleet.live import LiveFleet

logger = logging.getLogger(__name__)

@dataclass
class SourceState:
    """Whether a source answers; what it last said about itself."""

    name: str
    up: bool = False
    detail: str = "starting"
    since: float = field(default_factory=time.time)
    members: int = 0
    #: The app's hooks, told of every state recorded.
    events: Events = field(default_factory=Events, repr=False)

    def set(self, up: bool, detail: str) -> bool:
        """Record the state; True when ``up`` changed (the caller logs once per outage)."""
        changed = up != self.up
        if changed:
            self.since = time.time()
        self.up, self.detail = up, detail
        self.events.discovery.fire(self.name, up)
        return changed

    def doc(self) -> dict[str, Any]:
        return {"source": self.name, "up": self.up, "detail": self.detail,
                "since": round(self.since, 3), "members": self.members}


class Source(Protocol):
    name: str
    state: SourceState

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Context:
    """What every source is built with."""

    live: LiveFleet
    #: The URL policy of the moment (the server's own addresses join it once it listens).
    policy: Callable[[], URLPolicy] = URLPolicy
    state_dir: StateDir | None = None
    #: The app's hooks, which every source's state fires on.
    events: Events = field(default_factory=Events)


def build(discovery: dict[str, Any], context: Context) -> dict[str, Source]:
    """The sources the roster's ``discovery:`` names (``Roster.sources``), built, not started."""
    built: dict[str, Source] = {}
    for name, options in discovery.items():
        module, _, cls = sourcespecs.SOURCES[name].implementation.partition(":")
        built[name] = getattr(importlib.import_module(module), cls)(options, context)
    return built


def member(record: Any, where: str, policy: URLPolicy) -> Instance:
    """A record from a source, checked as a registration is (docs/behaviour.md#discovery):
    the roster's schema and the URL policy here, the connector's needs and the fleet's kind
    where the live fleet merges. RosterError names ``where`` it came from."""
    inst = parse_instance(record, where)
    try:
        check_addresses(inst.addresses(), policy)
    except URLPolicyError as exc:
        raise RosterError(f"{where}: {exc}") from None
    return inst


def unique(instances: Sequence[Instance], source: str) -> list[Instance]:
    """One instance per URL, the first kept; a second record for a URL is logged."""
    seen: dict[str, Instance] = {}
    for inst in instances:
        if inst.url in seen:
            if seen[inst.url] != inst:
                logger.warning("%s lists %s twice with different records; the first is used",
                               source, inst.url)
            continue
        seen[inst.url] = inst
    return sorted(seen.values(), key=lambda i: (i.role, i.url))
