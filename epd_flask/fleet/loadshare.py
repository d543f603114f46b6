"""Every proxy host's open calls per instance, shared through Redis (the roster's
``load_store``), so routing on one host counts the other hosts' calls as it counts its own,
each by its estimated prompt tokens, instead of as the engines' counts of requests
(docs/behaviour.md#routing-policies 2).

Off the request path: each worker runs one exchange every ``INTERVAL`` seconds in a greenlet of
its own, one round trip (a Lua script): it sends the host's counts (the load board's sum over
the host's workers) when they changed since it last sent them or ``HEARTBEAT`` seconds passed,
and gets every other host's back. Every worker of a host sends that same sum under the host's
key, the last write standing: no worker is elected, so none has to take over when one stops or
stalls, and a change is sent by whichever worker's exchange comes first. A host's key expires
``TTL`` seconds after its last write, so a host that dies stops counting within it. Routing reads
the last snapshot (``counts``), never Redis. A snapshot older than ``STALE`` counts for nothing,
and neither does a store that does not answer: routing is then as without one, the engines'
queues counting the other hosts (logged once; ``events.load_store`` hears whether it answers).

A host is the workers of one gunicorn master: one load board, one state directory. Its key is
the machine's name and a digest of the state directory's path (two masters on one machine have
two directories), or the process id without a state directory (an app that counts its own
calls alone). The script reads keys it is not given (the hosts' keys, found in a set): one
Redis, not a cluster.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from epd_flask.core.events import Events
from epd_flask.core.periodic import Periodic
from epd_flask.fleet.loadboard import CALLS, TOKENS, LoadBoard
from epd_flask.upstream import redisclient
from epd_flask.upstream.redisclient import redacted

logger = logging.getLogger(__name__)

#: Seconds between a worker's exchanges while the store answers; after a failure, the next
#: comes ``RETRY_SECONDS`` later. Without a store the loop looks for one every ``IDLE_SECONDS``.
INTERVAL = 0.025
RETRY_SECONDS = 1.0
IDLE_SECONDS = 1.0
#: Counts that did not change are sent again this often, so the host's key never expires
#: while the host lives.
HEARTBEAT = 0.5
#: A host's key lives this long after its last write.
TTL = 2.0
#: A snapshot this old counts for nothing (this worker's exchanges fail or stall).
STALE = 1.0
#: The most instances read from one host's counts; the rest are left out.
MAX_INSTANCES = 4096
PREFIX = "epd-flask:load:"
HOSTS = PREFIX + "hosts"
NONE = (0, 0)

#: ARGV: the hosts' key prefix, this host, its counts ("": unchanged, not sent), their TTL in
#: ms. Returns the other hosts' names and counts, alternating; a host whose key expired leaves
#: the set.
SCRIPT = """
local prefix, own = ARGV[1], ARGV[2]
if ARGV[3] ~= '' then
  redis.call('SET', prefix .. own, ARGV[3], 'PX', ARGV[4])
  redis.call('SADD', KEYS[1], own)
end
local out = {}
for _, host in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if host ~= own then
    local counts = redis.call('GET', prefix .. host)
    if counts then
      out[#out + 1] = host
      out[#out + 1] = counts
    else
      redis.call('SREM', KEYS[1], host)
    end
  end
end
return out
"""

Counts = dict[str, tuple[int, int]]


def host_name(state_dir: str | os.PathLike[str] | None) -> str:
    """This proxy host's key: the same in every worker of one master, another for each master."""
    machine = socket.gethostname() or "localhost"
    if not state_dir:
        return f"{machine}:pid{os.getpid()}"
    path = os.path.realpath(state_dir).encode("utf-8", "surrogateescape")
    return f"{machine}:{hashlib.blake2b(path, digest_size=6).hexdigest()}"


def host_counts(board: LoadBoard, urls: Iterable[str]) -> Counts:
    """The calls this host's workers have open on each of ``urls`` and their estimated prompt
    tokens; instances with neither left out."""
    out: Counts = {}
    for url in urls:
        counts = board.counts(url)
        if counts[CALLS] or counts[TOKENS]:
            out[url] = (counts[CALLS], counts[TOKENS])
    return out


def encode(counts: Mapping[str, tuple[int, int]]) -> bytes:
    return orjson.dumps({url: list(pair) for url, pair in counts.items()})


def decode(raw: bytes) -> Counts:
    """One host's counts as it sent them; what is not a pair of non-negative integers is left
    out, and all of it past ``MAX_INSTANCES``."""
    doc = orjson.loads(raw)
    out: Counts = {}
    if not isinstance(doc, dict):
        return out
    for url, pair in doc.items():
        if len(out) >= MAX_INSTANCES:
            break
        if isinstance(pair, list) and len(pair) == 2 and all(
                type(v) is int and v >= 0 for v in pair):
            out[url] = (pair[0], pair[1])
    return out


def others(answer: Iterable[Any]) -> Counts:
    """The script's answer (host, counts, host, counts, ...) summed per instance; a host whose
    counts cannot be read counts for nothing."""
    items = list(answer)
    total: dict[str, list[int]] = {}
    for raw in items[1::2]:
        try:
            counts = decode(raw)
        except (orjson.JSONDecodeError, TypeError):
            continue
        for url, (calls, tokens) in counts.items():
            pair = total.get(url)
            if pair is None:
                total[url] = [calls, tokens]
            else:
                pair[0] += calls
                pair[1] += tokens
    return {url: (pair[0], pair[1]) for url, pair in total.items()}


class LoadShare:
    """This worker's view of the other hosts' open calls, kept fresh by its own loop; and the
    host's counts, sent from it. ``configure`` names the store (empty: none)."""

    def __init__(self, board: LoadBoard, host: str, events: Events | None = None) -> None:
        self.board = board
        self.host = host
        self._events = events if events is not None else Events()
        self._urls: Callable[[], Iterable[str]] = tuple
        self._url = ""
        self._client: Any = None
        self._script: Any = None
        self._errors: tuple[type[BaseException], ...] = ()
        self._sent = b""
        self._sent_at = float("-inf")
        self._snapshot: Counts = {}
        self._read_at = float("-inf")
        self._retry_at = 0.0
        #: None without a store; else whether it answered this worker's latest exchange.
        self.up: bool | None = None
        self._loop = Periodic("load share", self.exchange, self._interval)

    def follow(self, urls: Callable[[], Iterable[str]]) -> None:
        """Where the instances whose counts are sent come from (the registry's, read at each
        exchange)."""
        self._urls = urls

    def configure(self, url: str) -> None:
        """Use the store at ``url`` (empty: none) from the next exchange on."""
        if url == self._url:
            return
        self._close()
        self._url, self._snapshot, self._sent, self._retry_at = url, {}, b"", 0.0
        if url:
            self._client = redisclient.connect(url, max_connections=2)
            self._script = self._client.register_script(SCRIPT)
            self._errors = redisclient.errors()
        self._answered(True if url else None)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        self._close()

    def counts(self, url: str) -> tuple[int, int]:
        """The calls the other hosts have open on ``url`` and their estimated prompt tokens, as
        last heard; (0, 0) when nothing fresh was heard."""
        if not self._snapshot or time.monotonic() - self._read_at > STALE:
            return NONE
        return self._snapshot.get(url, NONE)

    def exchange(self) -> None:
        """Send this host's counts if due and take the other hosts' (one round trip)."""
        script = self._script
        if script is None or time.monotonic() < self._retry_at:
            return
        payload = encode(host_counts(self.board, self._urls()))
        now = time.monotonic()
        send = payload != self._sent or now - self._sent_at >= HEARTBEAT
        try:
            answer = script(keys=[HOSTS], args=[PREFIX, self.host, payload if send else b"",
                                                int(TTL * 1000)])
        except self._errors as exc:
            self._failed(" ".join(str(exc).split())[:200] or type(exc).__name__)
            return
        if script is not self._script:
            return  # the store changed while this exchange waited
        if send:
            self._sent, self._sent_at = payload, now
        self._snapshot, self._read_at = others(answer or ()), time.monotonic()
        if self.up is False:
            logger.info("routing: the load store %s answers again; the other proxy hosts' "
                        "calls count as they publish them", redacted(self._url))
        self._answered(True)

    def _failed(self, why: str) -> None:
        self._snapshot, self._sent = {}, b""
        self._retry_at = time.monotonic() + RETRY_SECONDS
        if self.up:
            logger.warning("routing: the load store %s does not answer (%s); the other proxy "
                           "hosts count through the engines' queues until it does",
                           redacted(self._url), why)
        self._answered(False)

    def _interval(self) -> float:
        if self._script is None:
            return IDLE_SECONDS
        return INTERVAL if self.up else RETRY_SECONDS

    def _answered(self, up: bool | None) -> None:
        if up != self.up:
            self.up = up
            self._events.load_store.fire(up)

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = self._script = None
