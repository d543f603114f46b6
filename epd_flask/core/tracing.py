"""What the serving path tells a request's trace, as protocols (docs/behaviour.md#tracing).

A request carries a ``RequestTrace`` only while tracing is on; observe/tracing.py makes it
with the OpenTelemetry SDK. The serving path checks for None and calls these methods, so it
never imports the SDK, and with tracing off each place costs one comparison.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from epd_flask.core.errors import ProxyError


class CallTrace(Protocol):
    """One upstream call's span, open from the send until the answer is consumed."""

    #: What the call carries so the instance's spans nest under this one: ``traceparent``
    #: naming this span (its sampled flag the request's), and the client's ``tracestate``.
    headers: Mapping[str, str]

    def first_byte(self) -> None:
        """The answer's first body bytes arrived."""

    def end(self, status: int | None, error: ProxyError | None) -> None:
        """The call is over: the instance's status, or the error it failed with."""


class RequestTrace(Protocol):
    """One client request's trace: its server span and everything under it."""

    #: The trace's id, 32 hex digits: the request's log line carries it.
    trace_id: str
    #: Whether its spans are exported (the sampler said so); attributes that cost something
    #: to compute are worked out only then.
    recording: bool

    def call(self, stage: str, role: str, url: str) -> CallTrace:
        """A span for one upstream call of ``stage`` to the instance at ``url``."""

    def decided(self, role: str, policy: str, outcome: str, url: str) -> None:
        """A routing decision (docs/behaviour.md#routing-policies)."""

    def retried(self, stage: str, code: str) -> None:
        """An attempt failed at ``stage`` with ``code`` and the request runs again."""

    def waited(self, name: str, started_ns: int, ended_ns: int) -> None:
        """A wait before the request ran (``admission``), wall-clock nanoseconds."""

    def relaying(self) -> None:
        """The answer's status line is out; the relay to the client starts."""

    def answer_usage(self, data: bytes) -> None:
        """A piece of decode's answer that carries a usage object (a whole JSON body, or
        whole SSE events)."""

    def prefill_usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        """What prefill reported it computed and found in its prefix cache."""

    def finish(self, ctx: Any, failure: ProxyError | None) -> None:
        """The request ended (``ctx``: its finished ``RequestContext``, typed loosely so this
        module stays at the bottom of the import map); ``failure``: the error the client got,
        when there is one."""
