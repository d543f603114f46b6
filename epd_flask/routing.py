"""Which instance takes the next request of a role.

Round-robin over live instances with one cursor per role that only ever advances (R3): a
roster change or an eviction shifts the list but never restarts the rotation at its head.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from epd_flask.errors import NoBackend
from epd_flask.registry import Registry
from epd_flask.roster import Instance

NO_BACKEND_MESSAGES = {
    "decode": "no live decode instance is available",
    "prefill": "no live prefill instance is available",
    "prefill_decode": "no live prefill_decode instance is available",
    "encode": "no live encode instance is available",
}


class Router:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._cursors: dict[str, Iterator[int]] = {}

    def pick(self, role: str, exclude: frozenset[str] = frozenset()) -> Instance:
        """The next live instance of ``role``, skipping URLs in ``exclude`` when others exist."""
        live = self.registry.live(role)
        if not live:
            raise NoBackend(NO_BACKEND_MESSAGES.get(role, f"no live {role} instance"), stage=role)
        n = next(self._cursor(role))
        preferred = [i for i in live if i.url not in exclude] or live
        return preferred[n % len(preferred)]

    def _cursor(self, role: str) -> Iterator[int]:
        cursor = self._cursors.get(role)
        if cursor is None:
            cursor = self._cursors[role] = itertools.count()
        return cursor
