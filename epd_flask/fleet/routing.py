"""Which instance takes the next request of a role.

Round-robin over live instances with one cursor per role that only ever advances
(docs/behaviour.md#routing): a
roster change or an eviction shifts the list but never restarts the rotation at its head.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from epd_flask.control.roster import Instance
from epd_flask.core.errors import NoBackend
from epd_flask.fleet.registry import Registry

CURSOR_SPREAD = 1 << 30
NO_BACKEND_MESSAGES = {
    "decode": "no live decode instance is available",
    "prefill": "no live prefill instance is available",
    "prefill_decode": "no live prefill_decode instance is available",
    "encode": "no live encode instance is available",
}


def no_backend(role: str, model: str | None = None) -> NoBackend:
    message = NO_BACKEND_MESSAGES.get(role, f"no live {role} instance is available")
    if model is not None:
        message = message.replace(" is available", f" serving model `{model}` is available")
    return NoBackend(message, stage=role)


class Router:
    """``start=None`` starts each role's cursor at a random position.

    gunicorn replaces every worker on a reload; cursors that all started at 0 would send the
    first request of each new worker to the same (first) instance after every change. Each
    worker starting somewhere random keeps the fleet's load even from the first request.
    """

    def __init__(self, registry: Registry, start: int | None = 0) -> None:
        self.registry = registry
        self._start = start
        self._cursors: dict[str, Iterator[int]] = {}
        self._replicas: dict[str, Iterator[int]] = {}

    def pick(self, role: str, exclude: frozenset[str] = frozenset(), model: str | None = None,
             base: str | None = None) -> Instance:
        """The next live instance of ``role`` serving ``model`` (docs/behaviour.md#models),
        skipping URLs in ``exclude`` when others exist."""
        live = self.registry.live(role, model, base)
        if not live:
            raise no_backend(role, model)
        n = next(self._cursor(role))
        preferred = [i for i in live if i.url not in exclude] or live
        return preferred[n % len(preferred)]

    def pick_many(self, role: str, count: int, model: str | None = None) -> list[Instance]:
        """``count`` instances in rotation order, e.g. one encoder per media item.

        The cursor moves by ``count``, so the next request continues where this one stopped
        instead of starting again at the first instance.
        """
        live = self.registry.live(role, model)
        if not live:
            raise no_backend(role, model)
        cursor = self._cursor(role)
        return [live[next(cursor) % len(live)] for _ in range(count)]

    def next_replica(self, instance: Instance) -> int:
        """The next data-parallel replica of ``instance``, round-robin per instance."""
        if instance.dp_size <= 1:
            return 0
        cursor = self._replicas.get(instance.url)
        if cursor is None:
            cursor = self._replicas[instance.url] = self._new_cursor()
        return next(cursor) % instance.dp_size

    def _cursor(self, role: str) -> Iterator[int]:
        cursor = self._cursors.get(role)
        if cursor is None:
            cursor = self._cursors[role] = self._new_cursor()
        return cursor

    def _new_cursor(self) -> Iterator[int]:
        start = self._start
        if start is None:
            start = random.SystemRandom().randrange(CURSOR_SPREAD)
        return itertools.count(start)
