"""One client request's identity and bookkeeping, carried through every stage.

Plain data: the pipeline fills in timings and outcomes, the relay adds what it streamed, and
the request log line is written from it when the response is finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("epd_flask.requests")


@dataclass
class RequestContext:
    request_id: str
    route: str
    upstream_headers: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    retries: int = 0
    chunks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    status: int | None = None
    error: str | None = None
    # Asks the server whether the client already hung up (it can tell, gunicorn's gevent
    # worker can); without one, a departure is noticed at the first write.
    client_gone: Callable[[], bool] = field(default=lambda: False, repr=False)
    _logged: bool = False

    def mark(self, name: str, since: float) -> None:
        """Record a stage's duration in milliseconds."""
        self.timings[name] = round((time.monotonic() - since) * 1000.0, 3)

    def finish(self, status: int | None = None, error: str | None = None) -> None:
        """Write the request's single log line, once, whichever path ends it."""
        if self._logged:
            return
        self._logged = True
        if status is not None:
            self.status = status
        if error is not None:
            self.error = error
        self.mark("total", self.started)
        if not logger.isEnabledFor(logging.INFO):
            return
        stages = " ".join(f"{k}_ms={v}" for k, v in self.timings.items())
        chosen = " ".join(f"{k}={v}" for k, v in self.instances.items())
        logger.info(
            "request_id=%s route=%s status=%s %s %s retries=%d chunks=%d bytes=%d%s",
            self.request_id, self.route, self.status, chosen, stages, self.retries,
            self.chunks, self.bytes_out, f" error={self.error!r}" if self.error else "",
        )
