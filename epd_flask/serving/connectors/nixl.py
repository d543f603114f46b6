"""NIXL: prefill exports its KV and answers handles; decode pulls with them
(docs/behaviour.md#connector-nixl).

Decode gets every handle prefill answered, keys this proxy does not know included (a later
vLLM may add some), with the proxy's own fields set. Partial handles are worse than none:
real vLLM given ``kv_transfer_params`` without ``remote_request_id`` hangs the request, and
its engine dies when the client leaves (without block ids it dies at once). So a handle
missing a key today's vLLM needs is neither passed on nor quietly dropped (decode would
compute the prompt again, and nobody would know the KV transfer is broken): the attempt
fails with ``incomplete_kv_handles``, logged and counted.
"""

from __future__ import annotations

import logging
from typing import Any

from epd_flask.core import jsoncodec
from epd_flask.serving.connectors.base import Body, LegRequest, Route, SplitConnector, prime_body

logger = logging.getLogger(__name__)

#: What vLLM's NixlConnector needs to pull, present and not empty: without block ids its
#: scheduler asserts and the engine dies; without any of the others the request waits for
#: KV for ever.
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


#: The proxy's own fields of decode's handles: it asks decode to pull what prefill computed.
DECODE_FIELDS: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
#: The largest handles passed to decode, as JSON (block ids of a ~2M-token prompt).
MAX_HANDLE_BYTES = 1024 * 1024


class BadHandles(ValueError):
    """Prefill answered handles of the wrong shape: a broken or hostile prefill, not a
    missing export, so the request fails instead of decode recomputing."""

    code = "bad_prefill_answer"


class IncompleteHandles(BadHandles):
    """Prefill answered handles without a key today's vLLM needs to pull: passed on, they
    would hang decode; dropped, decode would recompute and hide a broken transfer."""

    code = "incomplete_kv_handles"


def complete_handles(params: Any) -> bool:
    """True when decode can safely pull with these handles."""
    return isinstance(params, dict) and not _missing(params)


def _missing(params: dict[str, Any]) -> list[str]:
    return [k for k in REQUIRED_HANDLE_KEYS if params.get(k) in (None, "", [])]


def decode_handles(params: Any) -> dict[str, Any]:
    """Decode's ``kv_transfer_params`` from the ones prefill answered: all of them, with
    ``DECODE_FIELDS`` set. ``BadHandles`` unless they are a JSON object of at most
    ``MAX_HANDLE_BYTES`` whose known handles have the types decode reads;
    ``IncompleteHandles`` when a key decode needs is missing or empty."""
    if not isinstance(params, dict):
        raise BadHandles(f"kv_transfer_params is a JSON {type(params).__name__}, not an object")
    size = len(jsoncodec.dumps(params))
    if size > MAX_HANDLE_BYTES:
        raise BadHandles(f"kv_transfer_params of {size} bytes (more than {MAX_HANDLE_BYTES})")
    check_handle_types(params)
    missing = _missing(params)
    if missing:
        raise IncompleteHandles(
            f"kv_transfer_params without {', '.join(missing)}, which decode needs to pull the "
            "KV (vLLM would wait for it for ever)")
    return {**params, **DECODE_FIELDS}


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
        out = dict(body)
        out.pop("kv_transfer_params", None)
        params = prefill_reply.get("kv_transfer_params") if prefill_reply else None
        if params is None:
            # No export (a prefill without a connector, or prefill skipped): nothing to pull.
            logger.info("request %s: prefill returned no kv_transfer_params; decode "
                        "recomputes", route.request_id)
            return LegRequest(out)
        try:
            out["kv_transfer_params"] = decode_handles(params)
        except IncompleteHandles as exc:
            logger.error("request %s: prefill %s answered %s (it sent %s); the attempt fails "
                         "instead of hanging decode or recomputing in silence",
                         route.request_id, route.prefill.instance.url, exc,
                         ", ".join(sorted(params)) or "no keys")
            raise
        return LegRequest(out)
