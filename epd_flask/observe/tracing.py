"""One app's tracing (docs/behaviour.md#tracing): whether it is on, and its lifecycle.

On when an OTLP endpoint is configured (OpenTelemetry's own variables, declared in
control/settings.py), off otherwise. Built with the app, it imports nothing of OpenTelemetry;
the server starts it after the fork (``Services.start``), and only then is the SDK imported
(``otelspans``), its exporter made and the export greenlet spawned. A proxy with tracing off
never loads the SDK, and each request pays one comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epd_flask.core.events import Events
from epd_flask.core.tracing import RequestTrace

if TYPE_CHECKING:
    from epd_flask.observe.otelspans import Tracer

logger = logging.getLogger(__name__)

#: Where OTLP/HTTP traces go under a base endpoint (the OpenTelemetry specification's path).
TRACES_PATH = "v1/traces"
#: Why spans were lost (``epd_tracing_spans_dropped_total``): the queue was full when they
#: ended, the collector refused a batch or took none within the exporter's timeout and
#: retries, or the worker stopped before they could go.
QUEUE_FULL, EXPORT_FAILED, SHUTDOWN = "queue_full", "export_failed", "shutdown"
DROP_REASONS = (QUEUE_FULL, EXPORT_FAILED, SHUTDOWN)


def traces_url(endpoint: str | None, traces_endpoint: str | None) -> str | None:
    """The URL spans are posted to, as the specification resolves the two variables: the
    per-signal one as it is, else the base one with ``v1/traces`` appended; None: neither
    is set, tracing is off."""
    if traces_endpoint:
        return traces_endpoint
    if endpoint:
        return f"{endpoint.removesuffix('/')}/{TRACES_PATH}"
    return None


@dataclass(frozen=True)
class TraceSettings:
    """What an app's tracing is built from; the SDK reads the rest of OpenTelemetry's
    variables itself (sampler, resource, headers, timeouts)."""

    url: str
    max_queue: int
    batch: int
    delay: float

    @classmethod
    def from_config(cls, config: Any) -> TraceSettings | None:
        """None when tracing is off: no endpoint, or ``OTEL_SDK_DISABLED=true`` (only
        ``true`` disables, as the specification says)."""
        if (config.otel_sdk_disabled or "").strip().lower() == "true":
            return None
        url = traces_url(config.otel_exporter_otlp_endpoint,
                         config.otel_exporter_otlp_traces_endpoint)
        if url is None:
            return None
        return cls(url, config.otel_bsp_max_queue_size, config.otel_bsp_max_export_batch_size,
                   config.otel_bsp_schedule_delay / 1000.0)


class Tracing:
    """An app's tracer and span export; ``begin`` gives each request its trace once started
    (before that, and after ``stop``, requests are not traced)."""

    def __init__(self, settings: TraceSettings, events: Events | None = None) -> None:
        self.settings = settings
        #: The app's hooks: what became of its spans is told there.
        self.events = events if events is not None else Events()
        self._tracer: Tracer | None = None

    @property
    def started(self) -> bool:
        return self._tracer is not None

    def start(self) -> None:
        if self._tracer is not None:
            return
        from epd_flask.observe import otelspans  # the SDK, loaded only now

        self._tracer = otelspans.Tracer(self.settings, self.events.tracing_spans.fire)
        self._tracer.start()
        logger.info("tracing: spans go to %s", self.settings.url)

    def begin(self, headers: Mapping[str, str], method: str, path: str, request_id: str,
              upstream_id: str) -> RequestTrace | None:
        """A new request's trace: the client's ``traceparent`` continued, else a new trace
        (the sampler decides whether either is recorded)."""
        tracer = self._tracer
        if tracer is None:
            return None
        return tracer.begin(headers, method, path, request_id, upstream_id)

    def flush(self, timeout: float) -> bool:
        """Export every finished span now (tests, shutdown); False if ``timeout`` passed."""
        return self._tracer.flush(timeout) if self._tracer is not None else True

    def stop(self) -> None:
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            tracer.stop()
