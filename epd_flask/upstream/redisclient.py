"""A Redis client that fails fast, for the state proxy hosts share: the tenants' rate-limit
buckets (``admission.store``, serving/redisstore.py) and each host's open calls per instance
(``load_store``, fleet/loadshare.py).

The client is redis-py: it speaks RESP over the standard library's ``socket``, which gevent
patches in every worker, so a call waits for Redis without holding the worker's other
requests (its pool's locks are ``threading``'s, patched too). Calls fail fast (no retries,
short timeouts): nothing may wait long on a store that is down; its callers carry on without
it and ask again later.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: Seconds a call to Redis may take (connecting included) before the store counts as down.
TIMEOUT = 0.5
#: Connections one worker keeps to one Redis; more calls at once wait for one.
MAX_CONNECTIONS = 32


def errors() -> tuple[type[BaseException], ...]:
    """What a call to a store that is down, slow or refusing raises."""
    import redis

    return redis.RedisError, OSError


def connect(url: str, max_connections: int = MAX_CONNECTIONS) -> Any:
    """A ``redis.Redis`` for ``url`` (``redis://``, ``rediss://``, ``unix://``); nothing is
    sent until its first call. The client owns its pool, so closing it closes its sockets at
    once (a store replaced on reload, a worker handing its exchange over) instead of whenever
    the garbage collector finds them."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=TIMEOUT, socket_timeout=TIMEOUT,
        socket_connect_timeout=TIMEOUT, retry=Retry(NoBackoff(), 0), health_check_interval=0)
    return redis.Redis.from_pool(pool)


def redacted(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
