"""A new connector is one module and one line: a connector defined here and declared with one
``CONNECTORS`` entry is refused by the roster's check without the field it needs, then serves
requests through real HTTP, with nothing else in the proxy changed."""

from __future__ import annotations

import pytest
import requests

from epd_flask.control.connectorspecs import CONNECTORS, ConnectorSpec, Need
from epd_flask.control.roster import RosterError, parse
from epd_flask.serving.connectors import Body, LegRequest, Route, SplitConnector, prime_body
from tests.bodies import chat
from tests.rosters import roster

CHAT = chat("hello", max_tokens=4, temperature=0)
NEEDS_MESSAGE = "the tagging connector needs kv_zmq_addr on every decode"


class TaggingConnector(SplitConnector):
    """Primes prefill first (like ``none``) and tells each leg who it is and where decode is."""

    name = "tagging"

    def prefill_leg(self, body: Body, route: Route) -> LegRequest:
        return LegRequest(prime_body(body), {"X-Tagging-Leg": "prefill"})

    def decode_leg(self, body: Body, route: Route, prefill_reply: Body | None) -> LegRequest:
        return LegRequest(dict(body), {"X-Tagging-Leg": f"decode@{route.decode.kv_zmq_addr}"})


@pytest.fixture
def tagging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one line."""
    monkeypatch.setitem(CONNECTORS, "tagging", ConnectorSpec(
        f"{__name__}:TaggingConnector",
        needs=(Need("kv_zmq_addr", ("decode",), NEEDS_MESSAGE),)))


def tagged(p, d, decode_fields: dict) -> dict:
    return roster([p], [(d, decode_fields)], connector="tagging")


def test_an_undeclared_connector_is_refused_with_the_choices() -> None:
    with pytest.raises(RosterError) as info:
        parse({"settings": {"connector": "tagging"}}, "roster.yaml")
    assert str(info.value) == ("roster.yaml: settings field 'connector': Input should be "
                               "'nixl', 'none', 'mooncake' or 'p2p_nccl'")


def test_a_connector_declared_in_one_line_is_checked_and_serves(tagging, sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    with pytest.raises(RosterError) as info:
        parse(tagged(p, d, {}), "roster.yaml")
    assert str(info.value) == f"roster.yaml: instance {d.url}: {NEEDS_MESSAGE}"

    px = proxy(tagged(p, d, {"kv_zmq_addr": "10.0.0.2:14579"}))
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    pre, dec = p.state.requests(1)[0], d.state.requests(1)[0]
    assert pre["headers"]["x-tagging-leg"] == "prefill" and pre["body"]["max_tokens"] == 1
    assert dec["headers"]["x-tagging-leg"] == "decode@10.0.0.2:14579"
    assert dec["body"]["max_tokens"] == CHAT["max_tokens"]
