"""Legs of one request that run at once: the one place a request spawns greenlets, the handle
that ends them, and the watch on the client while the request waits for them.

A ``Call`` runs one upstream leg in its own greenlet and keeps its outcome (a value, or the
``ProxyError`` it failed with) instead of letting gevent print it. Every ``Call`` belongs to
the client request that started it: whoever holds it stops it (``stop``) on every way out, so
none outlives its request. Killing a greenlet blocked in urllib3 raises ``GreenletExit`` there,
which discards the connection: the instance sees the client go away.

``unless_client_leaves`` runs everything before the answer's status line that way, so a client
that hangs up while any upstream leg is waited on (encoders, prefill, decode before its first
byte, a whole non-stream answer) ends them all within ``CLIENT_CHECK_INTERVAL`` (the worker's
``ClientWatch`` notices). After the status line the WSGI server notices the departure at its
next write and closes the relay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import gevent

from epd_flask.core.errors import ClientDisconnected, ProxyError
from epd_flask.serving.clientwatch import Client

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a kill may take; a killed greenlet only runs its cleanup (closing a socket).
KILL_TIMEOUT = 1.0


class Call(Generic[T]):
    """One leg running in its own greenlet."""

    def __init__(self, name: str, fn: Callable[..., T], *args: Any) -> None:
        self.name = name
        self.value: T | None = None
        self.error: ProxyError | None = None
        self._greenlet = gevent.spawn(self._run, fn, args)

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        try:
            self.value = fn(*args)
        except ProxyError as err:
            self.error = err
        except Exception as exc:  # a bug: report it as one, never as a silent hang
            logger.exception("%s leg failed unexpectedly", self.name)
            self.error = ProxyError(f"{self.name} leg failed: {exc}", stage=self.name)

    @property
    def done(self) -> bool:
        return self._greenlet.dead

    @property
    def failed(self) -> bool:
        return self.done and self.error is not None

    def join(self, timeout: float | None = None) -> bool:
        self._greenlet.join(timeout)
        return self.done

    def kill_soon(self) -> None:
        """End the leg without waiting for it (from another greenlet than the one that
        joins it)."""
        if not self.done:
            self._greenlet.kill(block=False)

    def stop(self, grace: float = 0.0) -> None:
        """End the leg: let it finish for up to ``grace`` seconds, then kill it and wait."""
        if grace > 0 and not self.done:
            self._greenlet.join(grace)
        if not self.done:
            self._greenlet.kill(block=True, timeout=KILL_TIMEOUT)


def wait_any(calls: Sequence[Call[Any]], timeout: float | None = None) -> None:
    """Block until one of ``calls`` is done or ``timeout`` passes."""
    gevent.wait([c._greenlet for c in calls], timeout=timeout, count=1)


def unless_client_leaves(client: Client | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run as a leg of its own while the worker's watch looks at its client.

    Its value, or the error it failed with; if the client hangs up first, the leg is killed
    (every upstream connection it holds closes, so the instances see the abort) and
    ``ClientDisconnected`` is raised. Without a way to watch the client, ``fn`` simply runs.
    """
    if client is None:
        return fn(*args)
    call: Call[T] = Call("request", fn, *args)
    left = False

    def gone() -> None:
        nonlocal left
        if not call.done:
            left = True
            call.kill_soon()
    try:
        with client.watched(gone):
            call.join()
        if left:
            raise ClientDisconnected("client closed the connection before its answer "
                                     "started; every upstream leg was closed")
    finally:
        call.stop()
    if call.error is not None:
        raise call.error
    return call.value  # type: ignore[return-value]
