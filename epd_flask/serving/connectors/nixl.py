"""NIXL: prefill exports its KV and answers handles; decode pulls with them
(docs/behaviour.md#connector-nixl).

Partial handles are worse than none: real vLLM given ``kv_transfer_params`` without
``remote_request_id`` hangs the request, and its engine dies when the client leaves. So the
handles are checked, and decode gets nothing (it recomputes) unless they are complete.
"""

from __future__ import annotations

import logging
from typing import Any

from epd_flask.serving.connectors.base import Body, Leg, Route, SplitConnector, prime_body

logger = logging.getLogger(__name__)

REQUIRED_HANDLE_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def complete_handles(params: Any) -> bool:
    """True when decode can safely pull with these handles."""
    return (
        isinstance(params, dict)
        and params.get("do_remote_prefill") is True
        and all(params.get(k) not in (None, "") for k in REQUIRED_HANDLE_KEYS)
    )


class NixlConnector(SplitConnector):
    name = "nixl"

    def prefill_leg(self, body: Body, route: Route) -> Leg:
        out = prime_body(body)
        out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
        return Leg(out)

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> Leg:
        request_id = route.request_id
        out = dict(body)
        out.pop("kv_transfer_params", None)
        params = prefill_reply.get("kv_transfer_params") if prefill_reply else None
        if complete_handles(params):
            out["kv_transfer_params"] = params
        elif params is not None:
            missing = [k for k in REQUIRED_HANDLE_KEYS if not isinstance(params, dict)
                       or params.get(k) in (None, "")]
            logger.warning(
                "request %s: prefill returned incomplete kv_transfer_params (missing %s); "
                "decode will recompute the prompt", request_id, ", ".join(missing) or "flags",
            )
        else:
            logger.info("request %s: prefill returned no kv_transfer_params; decode recomputes",
                        request_id)
        return Leg(out)
