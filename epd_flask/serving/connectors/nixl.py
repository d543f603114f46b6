"""NIXL: prefill exports its KV and answers handles; decode pulls with them
(docs/behaviour.md#connector-nixl).

Partial handles are worse than none: real vLLM given ``kv_transfer_params`` without
``remote_request_id`` hangs the request, and its engine dies when the client leaves. So the
handles are checked, and decode gets nothing (it recomputes) unless they are complete.
"""

from __future__ import annotations

import logging
from typing import Any

from epd_flask.serving.connectors.base import Body, LegRequest, Route, SplitConnector, prime_body

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


#: What vLLM's NixlConnector puts in each handle it reads: decode's engine trusts them.
_TEXT_HANDLES = ("remote_engine_id", "remote_request_id", "remote_host")
_COUNT_HANDLES = ("tp_size", "remote_num_tokens", "remote_prefill_cached_tokens")
MAX_PORT = 65535


class BadHandles(ValueError):
    """Prefill answered handles of the wrong shape: a broken or hostile prefill, not a
    missing export, so the request fails instead of decode recomputing."""


def complete_handles(params: Any) -> bool:
    """True when decode can safely pull with these handles."""
    return (
        isinstance(params, dict)
        and params.get("do_remote_prefill") is True
        and all(params.get(k) not in (None, "") for k in REQUIRED_HANDLE_KEYS)
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _block_ids(value: Any) -> bool:
    """A list of block ids, or (vLLM with several KV cache groups) a list of such lists."""
    if not isinstance(value, list):
        return False
    return all(_count(v) for v in value) or all(
        isinstance(group, list) and all(_count(v) for v in group) for group in value)


def check_handle_types(params: dict[str, Any]) -> None:
    """Raise ``BadHandles`` naming the first handle whose type decode would choke on."""
    for key in _TEXT_HANDLES:
        if params.get(key) is not None and not isinstance(params[key], str):
            raise BadHandles(f"{key} is not a string")
    port = params.get("remote_port")
    if port is not None and not (_count(port) and 0 < port <= MAX_PORT):
        raise BadHandles("remote_port is not a port number")
    if params.get("remote_block_ids") is not None and not _block_ids(params["remote_block_ids"]):
        raise BadHandles("remote_block_ids is not a list of block ids")
    for key in _COUNT_HANDLES:
        if params.get(key) is not None and not _count(params[key]):
            raise BadHandles(f"{key} is not a non-negative integer")


class NixlConnector(SplitConnector):
    name = "nixl"

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        out = prime_body(body)
        out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
        return LegRequest(out)

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        request_id = route.request_id
        out = dict(body)
        out.pop("kv_transfer_params", None)
        params = prefill_reply.get("kv_transfer_params") if prefill_reply else None
        if isinstance(params, dict):
            check_handle_types(params)
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
        return LegRequest(out)
