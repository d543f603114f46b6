"""Decode's answer to the client: bytes as they arrive, and an in-band error if it dies.

Once the status line is out, a failure can only be told inside the stream. For SSE the relay
forwards whole events, all that one read brought in one write (never waiting for more), so an
error event never lands in the middle of a half-relayed one. The upstream response is closed
on every exit, including the client going away (the WSGI server closes this generator), which
is what frees the slot on the instance. A leg still running beside decode (Mooncake's
prefill) is ended here too: given a moment to finish when decode completed, killed at once
when the stream ended any other way.

``decode_total_timeout`` bounds the relay as a whole, the time the server spends writing to
a slow client included: while the relay waits on the server's write it reads nothing from
decode, so no socket timeout of its own can fire. A loop timer at the deadline closes decode
then (the instance aborts the request), and the relay ends with its in-band error as soon as
the write returns. A client that accepts nothing at all is the worker's to reset
(``EPD_CLIENT_WRITE_TIMEOUT``, web/worker.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent

from epd_flask.control.settings import default
from epd_flask.core import errors
from epd_flask.core.errors import ClientDisconnected, EventTooLarge, ProxyError
from epd_flask.core.tracing import RequestTrace
from epd_flask.serving.context import RequestContext
from epd_flask.serving.legs import Call
from epd_flask.serving.usage import USAGE_KEY
from epd_flask.upstream.transport import Transport, Upstream

logger = logging.getLogger(__name__)

EVENT_END = b"\n\n"
CLIENT_LEFT = "client disconnected"
#: How long a side leg may still take once decode's answer is complete.
SIDE_LEG_GRACE = 2.0


def end_side_leg(side: Call[Any] | None, completed: bool) -> None:
    if side is not None:
        side.stop(SIDE_LEG_GRACE if completed else 0.0)


class WriteWatch:
    """The total deadline of a relayed answer while the relay is suspended on a write.

    ``writing`` is set around each ``yield``: a timer that fires then closes decode and
    marks the relay expired (``check`` raises the total-timeout error when the relay
    resumes); one that fires while the relay reads does nothing, that read's own timeout
    being bounded by the same deadline. One timer per relay, nothing per event but two
    attribute writes.
    """

    __slots__ = ("_resp", "_timer", "expired", "writing")

    def __init__(self, resp: Upstream) -> None:
        self._resp = resp
        self.writing = False
        self.expired = False
        self._timer: Any = None
        if resp.deadline is not None:
            self._timer = gevent.get_hub().loop.timer(resp.deadline.left())
            self._timer.start(self._fire)

    def _fire(self) -> None:
        if self.writing:
            self.expired = True
            self._resp.abort()

    def check(self, stage: str) -> None:
        """Back from a write: fail if the deadline passed during it."""
        self.writing = False
        if self.expired:
            raise self._resp.total_timeout(stage)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.close()
            self._timer = None


class Relayed:
    """The body iterable handed to the WSGI server. Its ``close()`` (called by the server
    when the response ends or the client leaves) releases the upstream even if the generator
    never started: a generator that was never run skips its own ``finally``."""

    def __init__(self, body: Iterator[bytes], resp: Upstream, ctx: RequestContext,
                 side: Call[Any] | None) -> None:
        self._body = body
        self._resp = resp
        self._ctx = ctx
        self._side = side
        if ctx.trace is not None:
            ctx.trace.relaying()

    def __iter__(self) -> Iterator[bytes]:
        return self._body

    def close(self) -> None:
        try:
            self._body.close()  # type: ignore[attr-defined]
        finally:
            # All no-ops when the generator already ran its own cleanup.
            self._resp.close()
            end_side_leg(self._side, False)
            if not self._ctx.finished:  # the generator ended it itself, unless the client left
                self._ctx.finish(error=ClientDisconnected(CLIENT_LEFT))


def sse(transport: Transport, resp: Upstream, ctx: RequestContext,
        stage: str = "decode", *, chunks: Iterable[bytes] | None = None,
        rewrite: Callable[[bytes], bytes] | None = None,
        side: Call[Any] | None = None,
        max_event: int = default("EPD_MAX_EVENT_BYTES")) -> Relayed:
    """Relay whole SSE events; ``chunks`` continues a body already started, ``rewrite`` edits
    events that carry a usage object (the only ones it is called for), ``side`` is a leg that
    must end with this stream. An event longer than ``max_event`` bytes ends the stream with
    an in-band error and closes the upstream: relaying it would mean holding it whole."""
    if ctx.trace is not None and ctx.trace.recording:
        rewrite = _noting_usage(ctx.trace, rewrite)
    if ctx.admitted is not None:
        rewrite = _noting_admission(ctx.admitted.usage_seen, rewrite)
    return Relayed(_sse(transport, resp, ctx, stage, chunks, rewrite, side, max_event),
                   resp, ctx, side)


def _noting_usage(trace: RequestTrace, rewrite: Callable[[bytes], bytes] | None,
                  ) -> Callable[[bytes], bytes]:
    """``rewrite``, telling the request's trace of the usage it passes on
    (docs/behaviour.md#tracing)."""
    def note(events: bytes) -> bytes:
        trace.answer_usage(events)
        return events if rewrite is None else rewrite(events)
    return note


def _noting_admission(note: Callable[[bytes], bytes], rewrite: Callable[[bytes], bytes] | None,
                      ) -> Callable[[bytes], bytes]:
    """``rewrite``, telling admission the usage it passes on (docs/behaviour.md#admission)."""
    if rewrite is None:
        return note

    def both(events: bytes) -> bytes:
        return rewrite(note(events))
    return both


def raw(transport: Transport, resp: Upstream, ctx: RequestContext,
        stage: str = "decode", *, chunks: Iterable[bytes] | None = None,
        side: Call[Any] | None = None) -> Relayed:
    """Any other body (pass-through), forwarded unframed.

    A failure is re-raised so the server drops the connection without the final chunk: for a
    body with no in-band error format, truncation the client can detect is the honest signal.
    """
    return Relayed(_raw(transport, resp, ctx, stage, chunks, side), resp, ctx, side)


def _sse(transport: Transport, resp: Upstream, ctx: RequestContext, stage: str,
         chunks: Iterable[bytes] | None, rewrite: Callable[[bytes], bytes] | None,
         side: Call[Any] | None, max_event: int) -> Iterator[bytes]:
    # The unfinished event's pieces, kept apart until its end arrives: joining them on every
    # read, and searching the join for an event end, cost quadratic time in a long event
    # (a 20 MB event without a line break held the worker for seconds).
    held: list[bytes] = []
    held_len = 0
    completed = False
    watch = WriteWatch(resp)
    try:
        for chunk in transport.iter_raw(resp, stage) if chunks is None else chunks:
            cut = chunk.rfind(EVENT_END)
            if cut >= 0:
                end = cut + 2
            elif held and chunk[:1] == b"\n" and held[-1][-1:] == b"\n":
                end = 1  # the blank line was split between two reads
            else:
                held.append(chunk)
                held_len += len(chunk)
                if held_len > max_event:
                    raise EventTooLarge(_too_large(stage, max_event), stage=stage,
                                        instance=ctx.instances.get(stage))
                continue
            if held:
                first = chunk.find(EVENT_END) + 2 if end > 1 else 1
                if held_len + first > max_event:
                    raise EventTooLarge(_too_large(stage, max_event), stage=stage,
                                        instance=ctx.instances.get(stage))
                held.append(chunk[:end])
                out = b"".join(held)
                held.clear()
                held_len = 0
            else:
                out = chunk if end == len(chunk) else chunk[:end]
            if end < len(chunk):
                rest = chunk[end:]
                held.append(rest)
                held_len = len(rest)
            if rewrite is not None and USAGE_KEY in out:
                out = rewrite(out)
            ctx.relayed(len(out), out.count(EVENT_END))
            watch.writing = True
            yield out
            watch.check(stage)
        if held:
            rest = b"".join(held)
            ctx.relayed(len(rest), 0)
            yield rest
        completed = True
        ctx.finish()
    except ProxyError as err:
        logger.warning("request %s: %s stream ended early: %s", ctx.request_id, stage, err)
        ctx.finish(error=err)
        yield errors.sse_event(err)
    except GeneratorExit:
        ctx.finish(error=ClientDisconnected(CLIENT_LEFT))
        raise
    finally:
        watch.close()
        resp.close()
        end_side_leg(side, completed)


def _too_large(stage: str, max_event: int) -> str:
    return (f"{stage} sent an event larger than this proxy relays ({max_event} bytes, "
            "EPD_MAX_EVENT_BYTES); the stream was ended")


def _raw(transport: Transport, resp: Upstream, ctx: RequestContext, stage: str,
         chunks: Iterable[bytes] | None, side: Call[Any] | None) -> Iterator[bytes]:
    completed = False
    watch = WriteWatch(resp)
    try:
        for chunk in transport.iter_raw(resp, stage) if chunks is None else chunks:
            ctx.relayed(len(chunk), 0)
            watch.writing = True
            yield chunk
            watch.check(stage)
        completed = True
        ctx.finish()
    except ProxyError as err:
        logger.warning("request %s: %s body ended early: %s", ctx.request_id, stage, err)
        ctx.finish(error=err)
        raise
    except GeneratorExit:
        ctx.finish(error=ClientDisconnected(CLIENT_LEFT))
        raise
    finally:
        watch.close()
        resp.close()
        end_side_leg(side, completed)
