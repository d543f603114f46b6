"""Background loops: a greenlet that runs one step at an interval and outlives a bad step.

Every per-worker job that runs on its own rhythm (probes, bootstrap discovery, the roster and
health sync, metrics samples, the sweep of idle upstream connections) is one of these, so
they all start, stop and survive errors the same way. Started by ``Services.start()`` in the
worker, never by the app factory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import gevent

logger = logging.getLogger(__name__)


class Periodic:
    """Run ``step`` now and then every ``interval()`` seconds until stopped.

    ``interval`` is read after every step so a reloaded setting applies from the next round;
    a step that raises is logged and the loop waits ``backoff`` (default: the interval).
    """

    def __init__(self, name: str, step: Callable[[], object], interval: Callable[[], float],
                 backoff: float | None = None) -> None:
        self.name = name
        self.step = step
        self.interval = interval
        self.backoff = backoff
        self._greenlet: gevent.Greenlet | None = None

    @property
    def running(self) -> bool:
        return self._greenlet is not None and not self._greenlet.dead

    def start(self) -> None:
        if not self.running:
            self._greenlet = gevent.spawn(self._run)

    def stop(self, wait: float = 0.0) -> None:
        """Kill the loop; with ``wait``, until it has died (at most that many seconds), for a
        step blocked on a connection its owner is about to close."""
        if self._greenlet is not None:
            self._greenlet.kill(block=wait > 0, timeout=wait or None)
            self._greenlet = None

    def _run(self) -> None:
        while True:
            try:
                self.step()
                delay = self.interval()
            except Exception:  # the loop must outlive any one bad round
                logger.exception("%s failed", self.name)
                delay = self.backoff if self.backoff is not None else self.interval()
            gevent.sleep(delay)
