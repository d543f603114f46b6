"""Membership from etcd (docs/behaviour.md#discovery): every record under
``<prefix>instances/`` is an instance, read whole, then followed by a watch.

One greenlet reads the prefix and watches it from the revision read; a broken watch or an
unreachable etcd sends it back to reading (the whole prefix again, so changes made meanwhile
apply) after a backoff of at most ``MAX_BACKOFF``. A second greenlet pings the endpoint the
watch uses every ``PING_INTERVAL``: a watch on a connection that died without a FIN would
otherwise wait for ever. When that endpoint does not answer, the watch is cut and the prefix
read again from the other endpoints first. The last membership read is kept in the state
directory, so a worker that starts while etcd is down serves it. The admin API writes
through ``register`` and ``unregister`` (no lease: a record lasts until deleted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any
from urllib.parse import quote

import gevent
import gevent.event

from epd_flask.control.roster import Instance, RosterError
from epd_flask.control.sourcespecs import EtcdOptions
from epd_flask.control.statedir import atomic_write
from epd_flask.fleet.sources import Context, SourceState, member, unique
from epd_flask.upstream.etcd import Compacted, EtcdClient, EtcdError, Event, Watch

logger = logging.getLogger(__name__)

NAME = "etcd"
MIN_BACKOFF = 0.1
MAX_BACKOFF = 5.0
PING_INTERVAL = 2.0
#: How long an admin write waits for this worker's watch to bring it back.
WRITE_WAIT = 2.0
SAVED_FILE = "discovery-etcd.json"
#: Watch batches applied in a row before the offer greenlet gets a turn.
YIELD_EVERY = 256


def members_prefix(prefix: str) -> str:
    return prefix + "instances/"


def member_key(prefix: str, url: str) -> str:
    """Where the admin API and ``epd-flask register`` keep an instance: its URL, escaped, is
    its id (one URL is one instance)."""
    return members_prefix(prefix) + quote(url, safe="")


class EtcdSource:
    name = NAME

    def __init__(self, options: EtcdOptions, context: Context,
                 client: EtcdClient | None = None) -> None:
        self.options = options
        self.context = context
        self.client = client or EtcdClient(options.endpoints)
        self.members = members_prefix(options.prefix)
        self.state = SourceState(NAME, events=context.events)
        self.revision = 0
        self._records: dict[str, Instance] = {}  # key -> instance
        self._raw: dict[str, Any] = {}  # key -> record as stored, for the saved copy
        self._saved_revision = -1
        self._watch: Watch | None = None
        self._greenlets: list[gevent.Greenlet] = []
        self._outage_logged = False
        #: The revision of the records the live fleet was last given.
        self.offered = 0
        self._changed = gevent.event.Event()

    # -- running -------------------------------------------------------------------------

    def start(self) -> None:
        self._greenlets = [gevent.spawn(self._run), gevent.spawn(self._pinger),
                           gevent.spawn(self._offerer)]

    def stop(self) -> None:
        gevent.killall(self._greenlets, block=True, timeout=2)
        self._greenlets = []
        if self._watch is not None:
            self._watch.close()
        self._save()
        self.client.close()

    def _run(self) -> None:
        backoff = MIN_BACKOFF
        first = True
        while True:
            read = False
            try:
                self._read_all()
                read = True
                backoff = MIN_BACKOFF
                self._watch = self.client.watch(self.members, self.revision + 1)
                for n, batch in enumerate(self._watch, 1):
                    self._apply(batch)
                    if n % YIELD_EVERY == 0:  # a long backlog: let the fleet have some
                        gevent.sleep(0)
                if self._watch.closed:  # the pinger cut it: etcd stopped answering
                    raise EtcdError("etcd stopped answering the ping")
            except Compacted:
                logger.info("etcd compacted the watch's revision; reading %s again",
                            self.members)
                continue
            except Exception as exc:  # the loop must outlive any failure
                if not isinstance(exc, EtcdError):
                    logger.exception("etcd membership failed unexpectedly")
                if read:  # the watch broke after a good read: read again before saying down
                    gevent.sleep(MIN_BACKOFF)
                    continue
                self._down(str(exc))
                if first:
                    self._restore()
                gevent.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            finally:
                first = False

    def _offerer(self) -> None:
        """Hands the live fleet the records whenever they changed. The watch greenlet applies
        every event it has already received before this one runs (reading what is buffered
        never yields), so a worker behind a burst of changes offers the fleet once for all
        of them instead of once each; an event alone is offered as soon as it is read."""
        while True:
            self._changed.wait()
            self._changed.clear()
            try:
                self._offer(f"etcd revision {self.revision}")
            except Exception:  # the loop must outlive any failure: the next change offers
                logger.exception("offering etcd's membership failed unexpectedly")

    def _pinger(self) -> None:
        while True:
            gevent.sleep(PING_INTERVAL)
            try:
                self._ping()
                self._save()
            except Exception:  # the loop must outlive any failure
                logger.exception("etcd ping failed unexpectedly")

    def _ping(self) -> None:
        watch = self._watch
        if watch is None or watch.closed:
            return
        try:
            self.client.ping(watch.endpoint)
        except EtcdError as exc:  # read again from any endpoint that answers
            logger.warning("etcd %s stopped answering under the watch (%s); reading again",
                           watch.endpoint, exc)
            self.client.demote(watch.endpoint)
            watch.close()

    def _down(self, why: str) -> None:
        if self.state.set(False, why) or not self._outage_logged:
            self._outage_logged = True
            logger.warning("etcd unreachable (%s); serving the last membership it gave "
                           "(%d instances), retrying every <= %.0f s", why,
                           len(self._records), MAX_BACKOFF)

    # -- reading -------------------------------------------------------------------------

    def _read_all(self) -> None:
        revision, kvs = self.client.range_prefix(self.members)
        records: dict[str, Instance] = {}
        raw: dict[str, Any] = {}
        for kv in kvs:
            inst = self._parse(kv.key, kv.value)
            if inst is not None:
                records[kv.key] = inst
                raw[kv.key] = inst.record()
        self._records, self._raw, self.revision = records, raw, revision
        if self.state.set(True, f"watching {self.members} from revision {revision + 1}"):
            logger.info("etcd answers again: %d instances under %s at revision %d",
                        len(records), self.members, revision)
        self._outage_logged = False
        self._offer(f"etcd revision {revision}")

    def _apply(self, batch: list[Event]) -> None:
        for event in batch:
            if event.kind == "delete":
                self._records.pop(event.key, None)
                self._raw.pop(event.key, None)
            else:
                inst = self._parse(event.key, event.value)
                if inst is None:  # a bad record replaces nothing... and leaves nothing
                    self._records.pop(event.key, None)
                    self._raw.pop(event.key, None)
                else:
                    self._records[event.key] = inst
                    self._raw[event.key] = inst.record()
            self.revision = max(self.revision, event.revision)
        self._changed.set()

    def _parse(self, key: str, value: bytes) -> Instance | None:
        """A record, or None (logged with its key): one bad record never stops the others."""
        try:
            doc = json.loads(value)
        except ValueError as exc:
            logger.error("etcd key %s: not a JSON instance record (%s); skipped", key, exc)
            return None
        try:
            return member(doc, f"etcd key {key}", self.context.policy())
        except RosterError as exc:
            logger.error("%s; skipped", exc)
            return None

    def _offer(self, origin: str) -> None:
        revision = self.revision
        instances = unique(list(self._records.values()), f"etcd prefix {self.members}")
        self.state.members = len(instances)
        self.context.live.offer(NAME, instances, origin)
        self.offered = revision

    # -- the copy kept for a start without etcd ------------------------------------------

    def _save(self) -> None:
        state = self.context.state_dir
        if state is None or self._saved_revision == self.revision or not self.revision:
            return
        doc = {"endpoints": list(self.options.endpoints), "prefix": self.options.prefix,
               "revision": self.revision, "saved_at": time.time(), "records": self._raw}
        try:
            state.ensure()
            atomic_write(state.path / SAVED_FILE, json.dumps(doc).encode())
            self._saved_revision = self.revision
        except OSError as exc:
            logger.error("cannot keep the etcd membership in %s: %s", state.path, exc)

    def _restore(self) -> None:
        """At a start without etcd: the membership an earlier worker saved, if it was read
        from this prefix."""
        state = self.context.state_dir
        if state is None or self._records:
            return
        try:
            doc = json.loads((state.path / SAVED_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.error("cannot read the saved etcd membership: %s", exc)
            return
        if doc.get("prefix") != self.options.prefix:
            return
        for key, record in (doc.get("records") or {}).items():
            with contextlib.suppress(RosterError):
                self._records[key] = member(record, f"etcd key {key}", self.context.policy())
                self._raw[key] = record
        logger.info("etcd unreachable at start: serving the %d instances saved at revision "
                    "%s", len(self._records), doc.get("revision"))
        self._offer(f"saved etcd membership, revision {doc.get('revision')}")

    # -- the admin API's writes ----------------------------------------------------------

    def register(self, inst: Instance) -> str:
        """Put ``inst`` (no lease); "registered", "updated" or "unchanged"."""
        key = member_key(self.options.prefix, inst.url)
        value = json.dumps(inst.record(), sort_keys=True).encode()
        current = self.client.get(key)
        if current is not None and current.value == value:
            return "unchanged"
        revision = self.client.put(key, value)
        self._wait_for(revision)
        return "registered" if current is None else "updated"

    def unregister(self, url: str) -> Instance | None:
        """Delete every record of ``url``; the instance removed (None for a record that
        never parsed). KeyError if etcd had none."""
        keys = {k for k, inst in self._records.items() if inst.url == url}
        keys.add(member_key(self.options.prefix, url))
        gone = [self._records[k] for k in keys if k in self._records]
        deleted, revision = 0, 0
        for key in sorted(keys):
            n, revision = self.client.delete(key)
            deleted += n
        if not deleted:
            raise KeyError(url)
        self._wait_for(revision)
        return gone[0] if gone else None

    def instance(self, url: str) -> Instance | None:
        return next((i for i in self._records.values() if i.url == url), None)

    def _wait_for(self, revision: int) -> None:
        """Until this worker's fleet has ``revision`` (bounded): the answer to an admin write
        then describes what this worker routes by."""
        deadline = time.monotonic() + WRITE_WAIT
        while self.offered < revision and time.monotonic() < deadline:
            gevent.sleep(0.005)
