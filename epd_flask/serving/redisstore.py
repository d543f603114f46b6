"""Rate-limit buckets in Redis, which every proxy host shares (``admission.store``,
docs/behaviour.md#admission), and the limiter that falls back to the host's own when Redis
does not answer.

The client is upstream/redisclient.py's: calls fail fast. Every operation is one Lua script
(``EVALSHA``), so checking and taking both buckets is atomic across hosts, and its clock is
Redis's (``TIME``): hosts whose clocks differ still refill alike. A request must not wait on a
store that is down: after a failure the next attempt comes ``RETRY_SECONDS`` later.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from epd_flask.core.events import Events
from epd_flask.serving.ratelimit import Store, StoreDown, Take, Verdict, decide, local_store
from epd_flask.upstream import redisclient
from epd_flask.upstream.redisclient import redacted

logger = logging.getLogger(__name__)

#: After a failure, Redis is asked again this much later; meanwhile the host's own buckets
#: count.
RETRY_SECONDS = 5.0
KEY_PREFIX = "epd-flask:ratelimit:"

#: Refill every bucket named in KEYS, then take each ARGV amount from it if every bucket has
#: its amount (ARGV[1] = "1": give, unconditionally). Returns each bucket's level before.
SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local give = ARGV[1] == '1'
local levels = {}
local ok = true
for i = 1, #KEYS do
  local cap = tonumber(ARGV[2 * i])
  local amount = tonumber(ARGV[2 * i + 1])
  local held = redis.call('HMGET', KEYS[i], 'level', 'at')
  local level = cap
  if held[1] then
    level = math.min(cap, tonumber(held[1]) + math.max(0, now - tonumber(held[2])) * cap / 60)
  end
  levels[i] = level
  if not give and level < amount then ok = false end
end
local out = {}
for i = 1, #KEYS do
  local cap = tonumber(ARGV[2 * i])
  local amount = tonumber(ARGV[2 * i + 1])
  if ok then
    local after = math.min(cap, levels[i] - amount)
    redis.call('HSET', KEYS[i], 'level', string.format('%.6f', after),
               'at', string.format('%.6f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((cap - after) * 60000 / cap) + 1000)
  end
  out[i] = string.format('%.6f', levels[i])
end
return out
"""


class RedisStore:
    name = "redis"

    def __init__(self, url: str) -> None:
        self._errors = redisclient.errors()
        self._client: Any = redisclient.connect(url)
        self._script = self._client.register_script(SCRIPT)

    def apply(self, tenant: str, takes: Sequence[Take], give: bool = False) -> Verdict:
        keys = [f"{KEY_PREFIX}{tenant}:{t.kind}" for t in takes]
        args: list[Any] = ["1" if give else "0"]
        for take in takes:
            args += [take.capacity, repr(float(take.amount))]
        try:
            raw = self._script(keys=keys, args=args)
            levels = [float(x) for x in raw]
        except self._errors as exc:
            raise StoreDown(" ".join(str(exc).split())[:200] or type(exc).__name__) from None
        except (TypeError, ValueError) as exc:
            raise StoreDown(f"unreadable answer: {exc}") from None
        return decide(levels, takes, give)

    def close(self) -> None:
        self._client.close()


class Limiter:
    """The buckets a request is counted in: the shared store while it answers, the host's
    own otherwise (docs/behaviour.md#admission). ``up``: None without a shared store, else
    whether it answered its latest call (told to ``events``' ``admission_store``)."""

    def __init__(self, state_dir: str | None, events: Events | None = None) -> None:
        self._state_dir = state_dir
        self._local: Store | None = None
        self._local_pid = 0
        self._url = ""
        self._shared: RedisStore | None = None
        self._retry_at = 0.0
        self.up: bool | None = None
        self._events = events if events is not None else Events()

    def _answered(self, up: bool | None) -> None:
        if up != self.up:
            self.up = up
            self._events.admission_store.fire(up)

    @property
    def local(self) -> Store:
        """The host's buckets, opened at first use by this process: a descriptor opened
        before a fork would share its ``flock`` with the other process (the lock belongs to
        the open file), so neither would exclude the other; and a worker whose tenants have
        no limit opens nothing."""
        pid = os.getpid()
        if self._local is None or self._local_pid != pid:
            self._local, self._local_pid = local_store(self._state_dir), pid
        return self._local

    def configure(self, url: str) -> None:
        """Use the store at ``url`` (empty: none) from the next request on."""
        if url == self._url:
            return
        if self._shared is not None:
            self._shared.close()
        self._url, self._shared, self._retry_at = url, None, 0.0
        if url:
            self._shared = RedisStore(url)
        self._answered(True if url else None)

    def apply(self, tenant: str, takes: Sequence[Take], give: bool = False) -> Verdict:
        shared = self._shared
        if shared is not None and time.monotonic() >= self._retry_at:
            try:
                verdict = shared.apply(tenant, takes, give)
            except StoreDown as exc:
                self._retry_at = time.monotonic() + RETRY_SECONDS
                if self.up:
                    logger.warning("admission: the rate-limit store %s does not answer (%s); "
                                   "each host counts its own until it does",
                                   redacted(self._url), exc)
                self._answered(False)
            else:
                if self.up is False:
                    logger.info("admission: the rate-limit store %s answers again",
                                redacted(self._url))
                self._answered(True)
                return verdict
        return self.local.apply(tenant, takes, give)

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        local, self._local = self._local, None
        close = getattr(local, "close", None)
        if close is not None and self._local_pid == os.getpid():
            close()
