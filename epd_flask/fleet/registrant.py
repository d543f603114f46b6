"""``epd-flask register``: keep one instance's record in etcd while it is healthy
(docs/behaviour.md#discovery).

Runs beside one vLLM instance (a sidecar container, a systemd unit), in its own process and
without gevent: waits for the instance's ``/health`` to answer 200, puts its record under a
lease of ``--ttl`` seconds and renews the lease while ``/health`` answers. After
``--fail-threshold`` failed checks in a row the record is withdrawn, and put back once the
instance is healthy. SIGTERM and SIGINT withdraw it and exit 0; a registrant killed outright
leaves a record that goes when its lease expires.

A signal only marks the registrant as stopping and wakes its sleep (``signal.set_wakeup_fd``):
the step under way (a health check, a put, a renewal) finishes first, so the withdrawal knows
the lease that step granted and talks to etcd over a connection no interrupted call left
half-read. (No lock or exception in the handler: one taken by the code it interrupts would
deadlock it, one raised mid-call loses what the call did.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence
from typing import Any, get_args

import urllib3

from epd_flask.control import settings as declared
from epd_flask.control.roster import ROLES, Instance, RosterError, parse_instance
from epd_flask.fleet.sources.etcdsource import member_key
from epd_flask.upstream.etcd import EtcdClient, EtcdError

logger = logging.getLogger("epd_flask.register")

HEALTH_TIMEOUT = 2.0


def _instance_flags(parser: argparse.ArgumentParser) -> list[str]:
    """One flag per instance field besides role and url (``dp_size`` is ``--dp-size``), from
    the record's own declaration; lists are comma-separated."""
    names = []
    for name, info in Instance.model_fields.items():
        if name in ("role", "url"):
            continue
        is_list = any(a is tuple or getattr(a, "__origin__", None) is tuple
                      for a in (info.annotation, *get_args(info.annotation)))
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            metavar="A,B,..." if is_list else "VALUE",
                            help=f"the record's {name}" + (" (comma-separated)"
                                                           if is_list else ""))
        names.append(name)
    return names


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(
        prog="epd-flask register",
        description="Keep one instance's record in etcd under a lease while its /health "
                    "answers; withdraw it when the instance fails or on SIGTERM/SIGINT.")
    parser.add_argument("--etcd", action="append", required=True, metavar="URL",
                        help="an etcd client URL (repeat, or comma-separate, for several)")
    parser.add_argument("--prefix", required=True,
                        help="the proxies' discovery.etcd.prefix, e.g. /epd-flask/prod/")
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--url", required=True, help="the instance's base URL")
    parser.add_argument("--ttl", type=int, default=10,
                        help="seconds the record outlives a registrant that dies (default 10)")
    parser.add_argument("--fail-threshold", type=int,
                        default=declared.ROSTER["fail_threshold"].default,
                        help="failed /health checks in a row before the record is withdrawn "
                             "(default %(default)s)")
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between checks (default: a third of --ttl, at most 2)")
    parser.add_argument("--health-url", default=None,
                        help="what is checked (default: <url>/health)")
    return parser, _instance_flags(parser)


def record_of(opts: argparse.Namespace, fields: Sequence[str]) -> Instance:
    doc: dict[str, Any] = {"role": opts.role, "url": opts.url}
    for name in fields:
        value = getattr(opts, name)
        if value is None:
            continue
        annotation = str(Instance.model_fields[name].annotation)
        doc[name] = [v.strip() for v in value.split(",")] if "tuple" in annotation else value
    return parse_instance(doc, "the instance")


class Registrant:
    def __init__(self, client: EtcdClient, key: str, inst: Instance, ttl: int,
                 fail_threshold: int, interval: float, health_url: str) -> None:
        self.client = client
        self.key = key
        self.value = json.dumps(inst.record(), sort_keys=True).encode()
        self.ttl = ttl
        self.fail_threshold = fail_threshold
        self.interval = interval
        self.health_url = health_url
        self.lease = 0
        #: The signal that asked the loop to end (after its current step).
        self.stopping: str | None = None
        self._http = urllib3.PoolManager(retries=False,
                                         timeout=urllib3.Timeout(total=HEALTH_TIMEOUT))

    def healthy(self) -> bool:
        try:
            return self._http.request("GET", self.health_url).status == 200
        except (urllib3.exceptions.HTTPError, OSError):
            return False

    def run(self, wake: int) -> None:
        """Check and act every ``interval`` until ``stopping`` is set; a byte readable on
        ``wake`` (the signals' wakeup pipe) ends a sleep early."""
        failures = 0
        waiting = True
        while self.stopping is None:
            ok = self.healthy()
            failures = 0 if ok else failures + 1
            if waiting and ok:
                waiting = False
                logger.info("%s answers; registering it", self.health_url)
            try:
                if ok and not self.lease:
                    self._put()
                elif self.lease and failures >= self.fail_threshold:
                    logger.warning("%s failed %d checks in a row; withdrawing its record",
                                   self.health_url, failures)
                    self.withdraw()
                elif self.lease and self.client.keepalive(self.lease) <= 0:
                    logger.warning("the lease of %s was lost; registering again", self.key)
                    self.lease = 0
                    if ok:
                        self._put()
            except EtcdError as exc:
                logger.warning("etcd: %s; retrying", exc)
            if select.select([wake], [], [], self.interval)[0]:
                os.read(wake, 512)

    def _put(self) -> None:
        lease = self.client.grant(self.ttl)
        self.client.put(self.key, self.value, lease)
        self.lease = lease
        logger.info("registered %s under a %d s lease", self.key, self.ttl)

    def withdraw(self) -> None:
        """Revoking the lease deletes the record with it."""
        if self.lease:
            lease, self.lease = self.lease, 0
            self.client.revoke(lease)
            logger.info("withdrew %s", self.key)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser, fields = build_parser()
    opts = parser.parse_args(argv)
    endpoints = [e.strip() for arg in opts.etcd for e in arg.split(",") if e.strip()]
    if opts.ttl < 2:
        parser.error("--ttl must be at least 2 seconds")
    interval = opts.interval if opts.interval is not None else min(2.0, opts.ttl / 3)
    if not 0 < interval <= opts.ttl / 2:
        parser.error("--interval must be positive and at most half of --ttl (the lease is "
                     "renewed once per check)")
    if not opts.prefix.startswith("/") or not opts.prefix.endswith("/"):
        parser.error("--prefix must start and end with '/', as the proxies' discovery.etcd")
    try:
        inst = record_of(opts, fields)
    except RosterError as exc:
        parser.error(str(exc))
    registrant = Registrant(EtcdClient(endpoints), member_key(opts.prefix, inst.url), inst,
                            opts.ttl, opts.fail_threshold, interval,
                            opts.health_url or inst.url + "/health")

    def stop(signum: int, _frame: Any) -> None:
        registrant.stopping = signal.Signals(signum).name

    wake, woken = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    registrant.run(wake)
    logger.info("%s: withdrawing the record and exiting", registrant.stopping)
    try:
        registrant.withdraw()
    except EtcdError as err:
        logger.error("could not withdraw the record (it goes when its lease expires): %s", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
