"""What every KV connector shares: the interface, the route one attempt takes, and the
prefill body (docs/behaviour.md#prefill-and-decode).

A connector decides the shape of a P+D request: which prefill (and rank) takes it, what each
leg's body and headers are, and whether the legs run one after the other or at once. The
pipeline does the I/O; connectors are plain functions of dicts, testable with no server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from epd_flask.control.roster import Instance
from epd_flask.serving import fields

Body = dict[str, Any]
Readiness = tuple[bool, str]


def prime_body(body: Body) -> Body:
    """The prefill leg's body (docs/behaviour.md#prefill-and-decode): compute the prompt's KV,
    generate one token, don't stream.

    A new dict is returned; the client's body is never mutated, so a retry starts from it.
    """
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("min_tokens", "min_completion_tokens"):
        value = fields.count(out.get(key))  # "5" and 5.0 are 5 to vLLM too
        if value is not None and value > 1:
            out[key] = 1
    out.pop("stream_options", None)
    return out


@dataclass(frozen=True)
class Placement:
    """Where a prefill leg runs: the instance and, when a connector names one, its DP rank and
    the engine id that rank announced."""

    instance: Instance
    dp_rank: int | None = None
    engine_id: str | None = None


class PickPrefill(Protocol):
    """Chooses the prefill of an attempt: not in ``exclude`` when others exist, serving
    ``model`` on ``base`` (the base model decode runs it on) when given
    (docs/behaviour.md#models)."""

    def __call__(self, exclude: frozenset[str], model: str | None = None,
                 base: str | None = None) -> Placement: ...


@dataclass(frozen=True)
class Route:
    """The instances one attempt of a request runs on."""

    prefill: Placement
    decode: Instance
    request_id: str  # this attempt's upstream id (X-Request-Id): ours, never the client's
    attempt: int = 0  # 0 for the first try, then 1, 2 ... for retries


@dataclass
class LegRequest:
    """What a connector builds for one upstream call of a route: its body, and headers beyond
    the request's common ones. (The open call itself is tracked by ``context.Leg``.)"""

    body: Body
    headers: dict[str, str] = field(default_factory=dict)


class Connector(Protocol):
    """How one KV connector shapes the prefill and decode legs of a P+D request."""

    name: str
    #: Run prefill and decode at once (decode pulls KV as prefill computes it) instead of
    #: draining prefill first.
    concurrent: bool
    #: Decode can serve on its own (recomputing the prompt) when the prefill leg fails.
    recomputes: bool

    def ready(self) -> Readiness:
        """Whether this connector knows enough to route a request (e.g. bootstrap discovery)."""

    def route(self, decode: Instance, request_id: str, attempt: int,
              exclude: frozenset[str], model: str | None = None,
              base: str | None = None) -> Route:
        """Pick the prefill (and rank) for this attempt; ``exclude`` lists URLs that failed,
        ``model`` and ``base`` what the prefill must serve."""

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        """The prefill call."""

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        """The decode call, given prefill's answer (None: not read, failed, or concurrent)."""


class SplitConnector:
    """The common ground: prefill picked by whoever the app wires in, bodies left to subclasses.

    Subclassing is optional; anything that satisfies ``Connector`` will do.
    """

    name: ClassVar[str] = ""
    concurrent: ClassVar[bool] = False
    recomputes: ClassVar[bool] = True
    #: Needs each prefill's Mooncake bootstrap server discovered before it can route.
    bootstrap: ClassVar[bool] = False

    def __init__(self, pick_prefill: PickPrefill,
                 readiness: Callable[[], Readiness] | None = None) -> None:
        self._pick_prefill = pick_prefill
        self._readiness = readiness

    def ready(self) -> Readiness:
        return self._readiness() if self._readiness is not None else (True, "ok")

    def route(self, decode: Instance, request_id: str, attempt: int,
              exclude: frozenset[str], model: str | None = None,
              base: str | None = None) -> Route:
        return Route(self._pick_prefill(exclude, model, base), decode, request_id, attempt)

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        raise NotImplementedError

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        raise NotImplementedError

