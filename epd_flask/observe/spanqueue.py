"""Finished spans on their way to the collector: a bounded queue and one export greenlet per
worker (docs/behaviour.md#tracing).

A request never waits for the collector: ending a span appends it, encoded, to the queue or,
when the queue is full, drops it and counts the drop. The greenlet posts batches through the
SDK's OTLP/HTTP exporter (``requests`` on gevent's sockets), whenever a batch is full or the
schedule delay passes; a collector that is down or slow holds only this greenlet, for at most
the exporter's own timeout per batch (``OTEL_EXPORTER_OTLP_TIMEOUT``), while the queue fills
and then drops. The SDK's own ``BatchSpanProcessor`` would do the same with a thread (a
greenlet, once gevent patched ``threading``) but reports its drops only through an
OpenTelemetry meter; this one reports them to the proxy's metrics
(``epd_tracing_spans_dropped_total``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

import gevent
from gevent.event import Event
from gevent.lock import BoundedSemaphore
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from epd_flask.observe import otlpwire
from epd_flask.observe.spanrecord import SpanRecord
from epd_flask.observe.tracing import EXPORT_FAILED, QUEUE_FULL, SHUTDOWN

logger = logging.getLogger(__name__)

#: How long a stopping worker spends sending what is left.
SHUTDOWN_FLUSH_SECONDS = 3.0

#: Told of spans exported (``reason`` None) or lost (its reason): (reason, count).
Report = Callable[[str | None, int], None]


class SpanQueue:
    """Where one worker's finished spans wait for their batch."""

    def __init__(self, exporter: SpanExporter, encoder: otlpwire.Encoder, *, max_queue: int,
                 batch: int, delay: float, report: Report) -> None:
        self._exporter = exporter
        self._encoder = encoder
        self._post = otlpwire.poster(exporter)
        self._encode_span = encoder.span if self._post is not None else None
        self._max_queue = max_queue
        self._batch = batch
        self._delay = delay
        self._report = report
        # A span's encoded field; a record only when the encoder could not encode it.
        self._queue: deque[bytes | SpanRecord] = deque()
        self._wake = Event()
        self._exporting = BoundedSemaphore(1)
        self._greenlet: gevent.Greenlet | None = None

    def add(self, span: SpanRecord) -> None:
        """A sampled span ended: it waits encoded, a few bytes the garbage collector never
        walks, rather than as a record (its attributes, events, strings) kept alive until
        its batch goes."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._report(QUEUE_FULL, 1)
            return
        encode = self._encode_span
        if encode is None:
            queue.append(span)
        else:
            try:
                queue.append(encode(span))
            except TypeError:  # the SDK's exporter gets it
                queue.append(span)
        if len(queue) >= self._batch:
            self._wake.set()

    def start(self) -> None:
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        while True:
            woken = self._wake.wait(self._delay)
            self._wake.clear()
            try:
                # Woken by a full batch: full batches only (a post costs the same for 3 spans
                # as for 512, so the rest waits to fill); the delay passed: everything.
                self._export_all(full_only=woken)
            except Exception:  # the loop must outlive any one bad batch
                logger.exception("tracing: exporting spans failed")

    def _export_all(self, full_only: bool = False) -> None:
        with self._exporting:
            queue = self._queue
            while queue and (len(queue) >= self._batch or not full_only):
                count = min(self._batch, len(queue))
                self._export([queue.popleft() for _ in range(count)])

    def _export(self, batch: Sequence[bytes | SpanRecord]) -> None:
        """One batch; cut short (a flush's deadline, the worker stopping), it counts as
        failed."""
        sent = False
        try:
            sent = self._send(batch)
        except Exception:
            logger.exception("tracing: the exporter failed")
        finally:
            self._report(None if sent else EXPORT_FAILED, len(batch))

    def _send(self, batch: Sequence[bytes | SpanRecord]) -> bool:
        """Encoded here (otlpwire.py, a third of the SDK's cost) and posted by the
        exporter's own client; what this encoder does not know, the SDK encodes."""
        encoder = self._encoder
        encoded = [span for span in batch if type(span) is bytes]
        left = [span for span in batch if type(span) is not bytes] \
            if len(encoded) < len(batch) else []
        sent = True
        if encoded:
            assert self._post is not None  # spans are encoded only when they can be posted
            sent = self._post(encoder.request(encoded))
        if left:
            readable = [encoder.readable(span) for span in left]  # type: ignore[arg-type]
            sent = self._exporter.export(readable) is SpanExportResult.SUCCESS and sent
        return sent

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Send every queued span now; False if that took longer than ``timeout_millis``
        (what is left is sent later)."""
        try:
            with gevent.Timeout(timeout_millis / 1000.0):
                self._export_all()
        except gevent.Timeout:
            return False
        return True

    def shutdown(self) -> None:
        """Stop exporting: what can go within ``SHUTDOWN_FLUSH_SECONDS`` goes, the rest is
        counted as lost."""
        if self._greenlet is not None:
            self._greenlet.kill(block=True, timeout=1.0)
            self._greenlet = None
        self.force_flush(int(SHUTDOWN_FLUSH_SECONDS * 1000))
        if self._queue:
            self._report(SHUTDOWN, len(self._queue))
            self._queue.clear()
        self._exporter.shutdown()
