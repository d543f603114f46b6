"""Mooncake: prefill and decode run at once and meet on a transfer id
(docs/behaviour.md#connector-mooncake).

The proxy names everything up front, so neither leg waits for the other's answer: prefill is
told to keep the KV for ``transfer_id`` (on the DP rank in ``X-data-parallel-rank``), decode is
told where to pull it from (the prefill's bootstrap server and the engine id that rank
announced there). Prefill's own answer carries nothing decode needs; it is drained.
"""

from __future__ import annotations

from epd_flask.core.headers import DP_RANK_HEADER
from epd_flask.serving.connectors.base import Body, LegRequest, Route, SplitConnector, prime_body


def transfer_id(route: Route) -> str:
    """``xfer-<upstream id>``: the route's id is ours and new for every attempt (never the
    client's), so no two requests, nor a retry and a failed try, share one transfer."""
    return f"xfer-{route.request_id}"


class MooncakeConnector(SplitConnector):
    name = "mooncake"
    concurrent = True
    # A decode told to pull KV that never comes waits for it: it cannot serve alone.
    recomputes = False
    bootstrap = True

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        out = prime_body(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id(route),
        }
        rank = route.prefill.dp_rank
        return LegRequest(out, {DP_RANK_HEADER: str(rank)} if rank is not None else {})

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        out = dict(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": route.prefill.engine_id,
            "remote_bootstrap_addr": route.prefill.instance.bootstrap_url,
            "transfer_id": transfer_id(route),
        }
        return LegRequest(out)
