"""Legs of one request that run at once: the one place a request spawns greenlets, and the
handle that ends them.

A ``Call`` runs one upstream leg in its own greenlet and keeps its outcome (a value, or the
``ProxyError`` it failed with) instead of letting gevent print it. Every ``Call`` belongs to
the client request that started it: whoever holds it stops it (``stop``) on every way out, so
none outlives its request. Killing a greenlet blocked in ``requests`` raises ``GreenletExit``
inside urllib3, which discards the connection: the instance sees the client go away.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import gevent

from epd_flask.core.errors import ProxyError

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

    def stop(self, grace: float = 0.0) -> None:
        """End the leg: let it finish for up to ``grace`` seconds, then kill it and wait."""
        if grace > 0 and not self.done:
            self._greenlet.join(grace)
        if not self.done:
            self._greenlet.kill(block=True, timeout=KILL_TIMEOUT)


def wait_any(calls: Sequence[Call[Any]], timeout: float) -> None:
    """Block until one of ``calls`` is done or ``timeout`` passes."""
    gevent.wait([c._greenlet for c in calls], timeout=timeout, count=1)


def peer_closed(sock: Any) -> bool:
    """True if the client at ``sock`` hung up; never consumes bytes it sent."""
    raw = getattr(sock, "_sock", sock)
    try:
        return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True
