"""Graceful shutdown of one worker: stop admitting, let running requests finish for a while,
then end the rest with a proper error instead of a silent cut.

gunicorn's gevent worker, on SIGTERM (a stop, or the old workers of a reload), stops accepting
on its next one-second tick and waits up to ``graceful_timeout`` for open connections; the
master kills it with SIGKILL when that time is up, and the worker's own last resort before
that is killing its handlers, which cuts every stream without a word. So this module ends the
requests still running a little earlier: each handler greenlet gets ``ShuttingDown`` raised
where it waits. A stream blocked on its upstream turns that into its in-band error event (the
relay's error path, see relay.py); a request that has not answered yet becomes a 503 with
``Retry-After``. Either way the upstream connection is closed, so the instance stops work the
client will never see.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import gevent

from epd_flask.control import settings
from epd_flask.core.errors import ShuttingDown
from epd_flask.core.events import Events
from epd_flask.web.inflight import InFlight

logger = logging.getLogger(__name__)

#: How often the watcher looks at the worker's ``alive`` flag.
WATCH_INTERVAL = 0.1
#: Streams are ended this long before the master's SIGKILL, so the error events are written
#: and the worker exits by itself (its loop looks for idle connections once a second).
KILL_MARGIN_SECONDS = 2.0
#: How often the drain checks whether everything finished on its own.
DRAIN_POLL = 0.05
#: How long ended requests get to write their last bytes before the drain reports.
END_GRACE_SECONDS = 1.0


def end_after(graceful_timeout: float) -> float:
    """Seconds after the stop signal at which still-running requests are ended."""
    return max(graceful_timeout - KILL_MARGIN_SECONDS, graceful_timeout / 2)


class Drain:
    def __init__(self, inflight: InFlight,
                 idle_grace: float = settings.default("EPD_DRAIN_IDLE_GRACE"),
                 events: Events | None = None) -> None:
        self.inflight = inflight
        self.events = events if events is not None else Events()
        self.idle_grace = idle_grace
        self._watcher: gevent.Greenlet | None = None
        self.ended = 0

    def watch(self, alive: Callable[[], bool], graceful_timeout: float) -> None:
        """Start draining when ``alive()`` turns false (gunicorn's worker flag)."""
        if self._watcher is None:
            self._watcher = gevent.spawn(self._watch, alive, end_after(graceful_timeout))

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.kill(block=False)
            self._watcher = None

    def _watch(self, alive: Callable[[], bool], grace: float) -> None:
        while alive():
            gevent.sleep(WATCH_INTERVAL)
        self.run(grace)

    def run(self, grace: float) -> int:
        """Refuse new requests, wait up to ``grace`` seconds, then end the rest; returns how
        many were ended."""
        inflight = self.inflight
        inflight.begin_drain()
        started = time.monotonic()
        logger.info("worker stopping: %d request(s) in flight get up to %.1f s to finish",
                    inflight.count, grace)
        deadline = started + grace
        while time.monotonic() < deadline:
            idle = inflight.end_idle(self.idle_grace)
            if not inflight.count and not idle:
                break
            gevent.sleep(DRAIN_POLL)
        running = inflight.greenlets()
        for greenlet in running:
            # gevent.kill never blocks: the exception is raised where the greenlet waits.
            gevent.kill(greenlet, ShuttingDown(
                "the server is shutting down and ended this request; retry it"))
        self.ended += len(running)
        if running:
            self.events.ended_by_shutdown.fire(len(running))
            logger.warning("worker stopping: ended %d request(s) still running after %.1f s",
                           len(running), time.monotonic() - started)
        else:
            logger.info("worker stopping: every request finished in %.1f s",
                        time.monotonic() - started)
        # Ended requests write their last bytes, then every connection left is closed at once
        # so the worker exits by itself before the master's SIGKILL.
        written = time.monotonic() + END_GRACE_SECONDS
        while (inflight.end_idle(0.0) or inflight.count) and time.monotonic() < written:
            gevent.sleep(DRAIN_POLL)
        return len(running)
