"""What every KV connector shares: the interface, the route one attempt takes, and the
prefill body (docs/behaviour.md#prefill-and-decode).

A connector decides the shape of a P+D request: which prefill (and rank) takes it, what each
leg's body and headers are, and whether the legs run one after the other or at once. The
pipeline does the I/O; connectors are plain functions of dicts, testable with no server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from epd_flask.control.roster import Instance
from epd_flask.fleet.policies import Placement
from epd_flask.serving import fields

Body = dict[str, Any]


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
    """How one KV connector shapes the prefill and decode legs of a P+D request. The prefill
    (and its rank) is chosen by the router; the connector only says what each leg carries."""

    name: str
    #: Run prefill and decode at once (decode pulls KV as prefill computes it) instead of
    #: draining prefill first.
    concurrent: bool
    #: Decode can serve on its own, computing the prompt itself: when the prefill leg fails
    #: (``prefill_failure: recompute``) and for prompts too short to be worth a prefill.
    recomputes: bool
    #: Prefill candidates come from each prefill's Mooncake bootstrap server (its engine id
    #: per rank) rather than from the roster alone.
    bootstrap: bool

    def route(self, decode: Instance, prefill: Placement, request_id: str,
              attempt: int) -> Route:
        """This attempt's route; ``request_id`` is its upstream id (a connector may derive
        the legs' ids from it)."""

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        """The prefill call."""

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        """The decode call, given prefill's answer (None: not read, failed, or concurrent)."""


class SplitConnector:
    """The common ground: the route as the router placed it, bodies left to subclasses.

    Subclassing is optional; anything that satisfies ``Connector`` will do.
    """

    name: ClassVar[str] = ""
    concurrent: ClassVar[bool] = False
    recomputes: ClassVar[bool] = True
    bootstrap: ClassVar[bool] = False

    def route(self, decode: Instance, prefill: Placement, request_id: str,
              attempt: int) -> Route:
        return Route(prefill, decode, request_id, attempt)

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        raise NotImplementedError

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        raise NotImplementedError
