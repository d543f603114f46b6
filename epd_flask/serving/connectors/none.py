"""No handles at all: the connector (shared storage, LMCache) matches KV by prompt.

Prefill is still primed first so the KV exists before decode looks for it; a decode that finds
none recomputes, so a failed prefill may fall back to decode alone.
"""

from __future__ import annotations

from epd_flask.serving.connectors.base import Body, LegRequest, Route, SplitConnector, prime_body


class NoneConnector(SplitConnector):
    name = "none"

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        out = prime_body(body)
        out.pop("kv_transfer_params", None)
        return LegRequest(out)

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        out = dict(body)
        out.pop("kv_transfer_params", None)
        return LegRequest(out)
