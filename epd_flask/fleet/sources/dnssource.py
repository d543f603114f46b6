"""Membership from DNS (docs/behaviour.md#discovery): each ``discovery.dns`` name is looked up
every ``interval``; the addresses in its answer are its role's instances.

A Kubernetes headless Service publishes only ready pods, so a pod that is terminating leaves
the answer and drains. An authoritative answer without records (NXDOMAIN, NODATA) empties the
name; a nameserver that does not answer (timeout, refusal, SERVFAIL) keeps the last answer and
marks the source down. One greenlet per name; the source offers the union of every name's
instances whenever one changes.
"""

from __future__ import annotations

import logging
from typing import Any

import dns.exception
import dns.rdatatype
import dns.resolver
import gevent

from epd_flask.control.roster import Instance, RosterError
from epd_flask.control.sourcespecs import DnsName, nameserver_address, render
from epd_flask.fleet.sources import Context, SourceState, member, unique

logger = logging.getLogger(__name__)

NAME = "dns"
#: Seconds one lookup may take, at most (less for a shorter interval).
LOOKUP_TIMEOUT = 2.0


class Unreachable(Exception):
    """No nameserver gave an answer to trust: keep what the name had."""


def resolver_for(entry: DnsName) -> dns.resolver.Resolver:
    """The system's resolver, or one asking only ``entry.nameserver``."""
    if entry.nameserver is None:
        resolver = dns.resolver.Resolver(configure=True)
    else:
        host, port = nameserver_address(entry.nameserver)
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = [host], port
    resolver.lifetime = min(LOOKUP_TIMEOUT, max(entry.interval, 0.2))
    resolver.timeout = resolver.lifetime
    resolver.cache = None
    return resolver


def _query(resolver: dns.resolver.Resolver, name: str, kind: str) -> Any:
    """The answer's records, or () for NXDOMAIN/NODATA; Unreachable otherwise."""
    try:
        answer = resolver.resolve(name, kind, raise_on_no_answer=False, search=False)
    except dns.resolver.NXDOMAIN:
        return (), None
    except (dns.exception.DNSException, OSError) as exc:  # timeouts, no nameserver, ...
        raise Unreachable(f"{name} {kind}: {exc}") from None
    return (answer.rrset or ()), answer.response


def lookup(resolver: dns.resolver.Resolver, entry: DnsName) -> list[tuple[str, int]]:
    """(host, port) of every instance the name's answer lists."""
    if not entry.srv:
        assert entry.port is not None
        hosts = [r.address for kind in ("A", "AAAA") for r in _query(resolver, entry.name,
                                                                        kind)[0]]
        return [(h, entry.port) for h in sorted(set(hosts))]
    records, response = _query(resolver, entry.name, "SRV")
    addresses: dict[str, list[str]] = {}
    for rrset in (response.additional if response is not None else ()):
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            addresses.setdefault(rrset.name.to_text(), []).extend(r.address for r in rrset)
    found = set()
    for r in records:
        target = r.target.to_text()
        for host in addresses.get(target) or [target.rstrip(".")]:
            found.add((host, int(r.port)))
    return sorted(found)


class DnsSource:
    name = NAME

    def __init__(self, entries: tuple[DnsName, ...], context: Context) -> None:
        self.entries = entries
        self.context = context
        self.state = SourceState(NAME, events=context.events)
        self._found: dict[int, list[Instance]] = {}
        self._failing: dict[int, str] = {}
        #: Per name, the records it answered that were refused (each logged once).
        self._refused: dict[int, set[str]] = {}
        self._greenlets: list[gevent.Greenlet] = []

    def start(self) -> None:
        self._greenlets = [gevent.spawn(self._follow, n, e) for n, e in enumerate(self.entries)]

    def stop(self) -> None:
        gevent.killall(self._greenlets, block=True, timeout=2)
        self._greenlets = []

    def _follow(self, n: int, entry: DnsName) -> None:
        resolver = resolver_for(entry)
        while True:
            try:
                self.refresh(n, entry, lookup(resolver, entry))
            except Unreachable as exc:
                self._unreachable(n, entry, str(exc))
            except Exception:  # the loop must outlive any failure
                logger.exception("DNS membership for %s failed unexpectedly", entry.name)
            gevent.sleep(entry.interval)

    def refresh(self, n: int, entry: DnsName, found: list[tuple[str, int]]) -> None:
        """The name answered ``found``: its instances from now on."""
        instances = []
        refused: set[str] = set()
        for host, port in found:
            url_host = f"[{host}]" if ":" in host else host
            record = {**render(entry.instance, host), "role": entry.role,
                      "url": f"{entry.scheme}://{url_host}:{port}"}
            try:
                instances.append(member(record, f"DNS {entry.name} ({host})",
                                        self.context.policy()))
            except RosterError as exc:
                refused.add(str(exc))
        for problem in sorted(refused - self._refused.get(n, set())):
            logger.error("%s; skipped", problem)  # once, not at every lookup
        self._refused[n] = refused
        if self._failing.pop(n, None) is not None:
            logger.info("DNS %s answers again", entry.name)
        changed = self._found.get(n) != instances
        self._found[n] = instances
        if changed:
            self._offer(f"DNS {entry.name}: {len(instances)} addresses")
        self._update_state()

    def _unreachable(self, n: int, entry: DnsName, why: str) -> None:
        if n not in self._failing:
            logger.warning("DNS %s: no answer (%s); keeping its last %d instances", entry.name,
                           why, len(self._found.get(n, ())))
        self._failing[n] = why
        self._update_state()

    def _update_state(self) -> None:
        if self._failing:
            self.state.set(False, "; ".join(self._failing.values()))
        else:
            self.state.set(True, f"{len(self.entries)} names answering")

    def _offer(self, origin: str) -> None:
        instances = unique([i for n in sorted(self._found) for i in self._found[n]], "DNS")
        self.state.members = len(instances)
        self.context.live.offer(NAME, instances, origin)
