"""P2P NCCL: no handles in the bodies; the request id names both KV endpoints.

vLLM's P2pNcclConnector parses the peer's address out of the request id, so prefill and decode
get the same ``X-Request-Id``: ``___prefill_addr_<P>___decode_addr_<D>_<hex>``. Prefill pushes
the KV to decode as it computes, so it is drained first. A decode whose KV never comes waits
silently, so there is no falling back to decode alone.
"""

from __future__ import annotations

import uuid

from epd_flask.control.roster import Instance
from epd_flask.core.headers import REQUEST_ID_HEADER
from epd_flask.fleet.policies import Placement
from epd_flask.serving.connectors.base import Body, LegRequest, Route, SplitConnector, prime_body


def pair_request_id(prefill_addr: str, decode_addr: str, suffix: str | None = None) -> str:
    return (f"___prefill_addr_{prefill_addr}___decode_addr_{decode_addr}_"
            f"{suffix or uuid.uuid4().hex}")


class P2pNcclConnector(SplitConnector):
    name = "p2p_nccl"
    recomputes = False

    def route(self, decode: Instance, prefill: Placement, request_id: str,
              attempt: int) -> Route:
        # One id per attempt: a retry must not collide with tensors a failed try left behind.
        leg_id = pair_request_id(prefill.instance.kv_zmq_addr or "", decode.kv_zmq_addr or "")
        return Route(prefill, decode, leg_id, attempt)

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        out = prime_body(body)
        out.pop("kv_transfer_params", None)
        return LegRequest(out, {REQUEST_ID_HEADER: route.request_id})

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        out = dict(body)
        out.pop("kv_transfer_params", None)
        return LegRequest(out, {REQUEST_ID_HEADER: route.request_id})
