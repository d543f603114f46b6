"""No handles at all: the connector (shared storage, LMCache) matches KV by prompt.

Prefill is still primed first so the KV exists before decode looks for it.
"""

from __future__ import annotations

from epd_flask.connectors.base import Body, prime_body


class NoneConnector:
    name = "none"

    def prefill_body(self, body: Body, request_id: str) -> Body:
        out = prime_body(body)
        out.pop("kv_transfer_params", None)
        return out

    def decode_body(self, body: Body, prefill_reply: Body | None, request_id: str) -> Body:
        out = dict(body)
        out.pop("kv_transfer_params", None)
        return out
