"""KV handles between a simulated prefill and decode: how a prefill signs what it issues and how
a decode judges what it receives, with no state shared between the two processes.

The signature is an HMAC with the fleet secret over the engine id, the request id and the prompt
length, carried as the 8-hex suffix real vLLM puts on ``remote_request_id``. A proxy that edits,
mixes up or invents handles therefore produces ``invalid`` ones a test can count.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import uuid
from typing import Any

BLOCK_TOKENS = 16
SIGNATURE_HEX = 8
#: The keys NixlConnector requires present (``in params``) once ``remote_block_ids`` is
#: non-empty; one missing hangs the request, and its EngineCore dies when the client leaves.
NIXL_REQUIRED_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
MOONCAKE_REQUIRED_KEYS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")

ABSENT = "absent"
VALID = "valid"
INVALID = "invalid"
INCOMPLETE = "incomplete"
NO_BLOCKS = "no_blocks"
MOONCAKE = "mooncake"

_SIGNED_ID = re.compile(rf"^(?P<base>.+)-(?P<sig>[0-9a-f]{{{SIGNATURE_HEX}}})$")


def sign(secret: str, engine_id: str, base_id: str, num_tokens: int) -> str:
    message = f"{engine_id}\n{base_id}\n{num_tokens}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()[:SIGNATURE_HEX]


def remote_request_id(
    secret: str, engine_id: str, request_id: str, chat: bool, num_tokens: int
) -> str:
    """vLLM's shapes: ``cmpl-<hex>-0-<sig>`` for completions, ``chatcmpl-<hex>-<sig>`` for chat."""
    base = request_id if chat else f"{request_id}-0"
    return f"{base}-{sign(secret, engine_id, base, num_tokens)}"


def nixl_params(
    *,
    secret: str,
    engine_id: str,
    request_id: str,
    chat: bool,
    num_tokens: int,
    block_ids: list[int],
    cached_tokens: int | None,
    host: str,
    side_channel_port: int,
    computed_tokens: int | None = None,
) -> dict[str, Any]:
    """What a NIXL prefill returns for the decode, key for key in the captured order.

    ``num_tokens`` is the prompt's length (what the signature covers); ``computed_tokens``
    what vLLM reports as ``remote_num_tokens``: the prompt, plus all but the last generated
    token when the prefill was allowed more than one. vLLM adds
    ``remote_prefill_cached_tokens`` only when the request ended in its prefill step, so
    ``cached_tokens`` None leaves it out.
    """
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": remote_request_id(secret, engine_id, request_id, chat, num_tokens),
        "remote_host": host,
        "remote_port": side_channel_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens if computed_tokens is None else computed_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }
    if cached_tokens is not None:
        params["remote_prefill_cached_tokens"] = cached_tokens
    return params


def blocks_for(num_tokens: int) -> int:
    return max(1, math.ceil(num_tokens / BLOCK_TOKENS))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """A prefill request: the proxy asks this server to keep the KV for a remote decode."""
    return bool(params) and params.get("do_remote_decode") is True


def _is_uuid(value: Any) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def classify(secret: str, params: dict[str, Any] | None, own_num_tokens: int) -> str:
    """What a decode makes of the ``kv_transfer_params`` it got (one of the module constants),
    checked as vLLM 0.32's NixlConnector checks them: ``do_remote_prefill`` truthy, then a
    non-empty ``remote_block_ids`` (else ``NO_BLOCKS``: its scheduler asserts and dies), then
    the four other keys present, whatever their values (else ``INCOMPLETE``: it hangs). A
    handle that passes but names nothing this fleet issued (a null host, another prompt, a
    forged id) fails its transfer, and vLLM computes the prompt itself (``INVALID``)."""
    if not params or not params.get("do_remote_prefill"):
        return ABSENT
    if "remote_bootstrap_addr" in params or "transfer_id" in params:
        if any(params.get(k) is None for k in MOONCAKE_REQUIRED_KEYS):
            return INCOMPLETE
        return MOONCAKE if _is_uuid(params["remote_engine_id"]) else INVALID
    if not params.get("remote_block_ids"):
        return NO_BLOCKS
    if any(k not in params for k in NIXL_REQUIRED_KEYS):
        return INCOMPLETE
    if any(params[k] is None for k in NIXL_REQUIRED_KEYS):
        return INVALID
    match = _SIGNED_ID.match(str(params["remote_request_id"]))
    num_tokens = params.get("remote_num_tokens")
    # vLLM reads min(remote_num_tokens, its prompt): more than the prompt is fine (a prefill
    # that generated several tokens), fewer means the handle is for another prompt.
    if match is None or not isinstance(num_tokens, int) or num_tokens < own_num_tokens:
        return INVALID
    expected = sign(secret, str(params["remote_engine_id"]), match["base"], own_num_tokens)
    return VALID if hmac.compare_digest(expected, match["sig"]) else INVALID
