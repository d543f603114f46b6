"""The live fleet of one worker: the one owner of which instances exist and the settings they
are served with (docs/behaviour.md#roster).

Every membership source hands it a whole snapshot: the roster file (its settings and its
instances), and any other source (the admin API, a store, DNS) its current set of instances.
It merges them into one ``FleetView``, swaps it in at once and brings the registry (each
instance's health) along; the pipeline, the router, the prober, the KV-event readers, the model
catalog and the status page read the fleet from here and nowhere else. A request takes the view
of the moment it is routed; one already under way keeps the instances it was given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from epd_flask.control.roles import DECODE, PREFILL_DECODE
from epd_flask.control.roster import (
    EC_CONSUMERS,
    Instance,
    Roster,
    Settings,
    Tenant,
    connector_problem,
    mixes_roles,
)
from epd_flask.fleet.registry import Registry

logger = logging.getLogger(__name__)

#: The roster file's source name: its records win over every other source's.
FILE = "file"
#: Sources in the order their records win when two name one URL; others rank after these.
PRECEDENCE = (FILE, "admin", "etcd", "dns")

Listener = Callable[["FleetView", "FleetView"], None]


@dataclass(frozen=True)
class FleetView:
    """One consistent picture of the fleet: the settings it is served with, the instances
    routed to and which source each came from."""

    settings: Settings
    instances: tuple[Instance, ...] = ()
    #: The source of each instance, by URL.
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: The roster file's generation (published by the master, or by an admin change).
    generation: int = 0
    #: The roster's tenants (docs/behaviour.md#admission).
    tenants: Mapping[str, Tenant] = field(default_factory=lambda: MappingProxyType({}))

    # Read several times per request: worked out once per view (a view never changes).
    @cached_property
    def combined(self) -> bool:
        """True when decode work goes to prefill_decode instances (no separate prefill)."""
        return any(i.role == PREFILL_DECODE for i in self.instances)

    @cached_property
    def decode_role(self) -> str:
        """The role that answers clients."""
        return PREFILL_DECODE if self.combined else DECODE

    def urls(self) -> frozenset[str]:
        return frozenset(i.url for i in self.instances)


def _rank(source: str) -> tuple[int, str]:
    return (PRECEDENCE.index(source) if source in PRECEDENCE else len(PRECEDENCE), source)


@dataclass(frozen=True)
class Misfit:
    """Why an instance cannot join the fleet; ``role`` when it is its role that conflicts."""

    message: str
    role: bool = False


class Fit:
    """The rules a roster file is checked against as a whole (docs/behaviour.md#roster),
    applied to an instance that arrives on its own (from a store, DNS, the admin API): what
    the roster's connector needs, no mixing of combined and split serving, and encoder pushes
    addressed either to every consumer of a role or to none."""

    def __init__(self, settings: Settings, instances: Iterable[Instance] = ()) -> None:
        self.settings = settings
        self.roles: set[str] = set()  # a set: a fleet of thousands is checked in one pass
        self.pushing: dict[str, bool] = {}
        for inst in instances:
            self.add(inst)

    def add(self, inst: Instance) -> None:
        self.roles.add(inst.role)
        if inst.role in EC_CONSUMERS:
            self.pushing.setdefault(inst.role, inst.ec_zmq_addrs is not None)

    def misfit(self, inst: Instance) -> Misfit | None:
        problem = connector_problem(self.settings, inst)
        if problem is not None:
            return Misfit(problem)
        if mixes_roles(inst.role, self.roles):
            serving = "split prefill/decode" if inst.role == PREFILL_DECODE \
                else "combined prefill_decode"
            return Misfit(f"instance {inst.url} ({inst.role}) would mix combined and split "
                          f"serving: the fleet serves {serving} instances, and the two are "
                          "never mixed", role=True)
        pushes = inst.ec_zmq_addrs is not None
        if pushes and inst.role not in EC_CONSUMERS:
            return Misfit(f"instance {inst.url} ({inst.role}): ec_zmq_addrs belong on "
                          "prefill or prefill_decode instances")
        if self.pushing.get(inst.role, pushes) != pushes:
            return Misfit(f"instance {inst.url} ({inst.role}): the fleet's {inst.role} "
                          f"instances {'do not take' if pushes else 'take'} encoder pushes "
                          "(ec_zmq_addrs); every one of a role must, or none")
        return None


def merge(settings: Settings, offers: Mapping[str, Sequence[Instance]]
          ) -> tuple[tuple[Instance, ...], dict[str, str], list[str]]:
    """The instances of every source as one fleet, which source each came from, and what was
    left out and why.

    One URL from two sources is one instance: the higher source's record wins (the file's
    over all). An instance from a source other than the file that does not fit the fleet
    (``Fit``) is left out: the file's instances were validated with the roster, the others
    arrive one by one.
    """
    chosen: dict[str, Instance] = {}
    sources: dict[str, str] = {}
    problems: list[str] = []
    fit = Fit(settings)
    for source in sorted(offers, key=_rank):
        for inst in offers[source]:
            held = sources.get(inst.url)
            if held is not None:
                if chosen[inst.url] != inst:
                    problems.append(f"instance {inst.url} from {source} differs from the record "
                                    f"{held} has; the {held} record is served")
                continue
            if source != FILE:
                misfit = fit.misfit(inst)
                if misfit is not None:
                    problems.append(f"{misfit.message}; left out (from {source})")
                    continue
            chosen[inst.url] = inst
            sources[inst.url] = source
            fit.add(inst)
    return tuple(chosen.values()), sources, problems


class LiveFleet:
    """Sources offer, readers read ``view``; ``registry`` follows every swap."""

    def __init__(self, roster: Roster, generation: int = 0,
                 registry: Registry | None = None) -> None:
        settings = roster.settings
        self.registry = registry if registry is not None else \
            Registry((), settings.fail_threshold, settings.evicted_ttl)
        self._offers: dict[str, tuple[Instance, ...]] = {}
        self._listeners: list[Listener] = []
        self._problems: frozenset[str] = frozenset()
        self._tenants = MappingProxyType(dict(roster.tenants))
        self._view = FleetView(settings, generation=generation)
        self._offers[FILE] = tuple(roster.instances)
        self._swap(settings, generation, "", announce=False)

    @property
    def view(self) -> FleetView:
        return self._view

    @property
    def settings(self) -> Settings:
        return self._view.settings

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(old, new)`` after every change of the view."""
        self._listeners.append(listener)

    def adopt(self, roster: Roster, generation: int, origin: str = "") -> None:
        """The roster file's settings and instances, from the next decision on."""
        self._offers[FILE] = tuple(roster.instances)
        self._tenants = MappingProxyType(dict(roster.tenants))
        self._swap(roster.settings, generation, origin)

    def offer(self, source: str, instances: Iterable[Instance], origin: str = "") -> None:
        """``source``'s whole current set of instances (empty: it has none now)."""
        if source == FILE:
            raise ValueError("the roster file's instances come with its settings: adopt()")
        self._offers[source] = tuple(instances)
        self._swap(self._view.settings, self._view.generation, origin)

    def _swap(self, settings: Settings, generation: int, origin: str,
              announce: bool = True) -> None:
        instances, sources, problems = merge(settings, self._offers)
        old = self._view
        new = FleetView(settings, instances, MappingProxyType(sources), generation,
                        self._tenants)
        self.registry.configure(settings.fail_threshold, settings.evicted_ttl)
        self.registry.replace(instances)
        self._view = new
        for problem in sorted(set(problems) - self._problems):
            logger.warning("fleet: %s", problem)
        self._problems = frozenset(problems)
        before, after = old.urls(), new.urls()
        if announce and (before != after or origin):
            logger.info("fleet generation %d%s: %d instances; added %s; removed %s",
                        generation, f" ({origin})" if origin else "", len(instances),
                        sorted(after - before) or "none", sorted(before - after) or "none")
        if announce:
            for listener in self._listeners:
                try:
                    listener(old, new)
                except Exception:  # one failing reader must not keep the others uninformed
                    logger.exception("fleet listener %r failed", listener)


def added(old: FleetView, new: FleetView) -> list[str]:
    """The URLs ``new`` lists that ``old`` did not, in ``new``'s order."""
    before = old.urls()
    return [i.url for i in new.instances if i.url not in before]
