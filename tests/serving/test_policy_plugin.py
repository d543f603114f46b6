"""A new routing policy is one class and one line: a policy defined here and declared with one
``POLICIES`` entry is accepted by the roster's check and routes requests through real HTTP,
its decisions in the log line, with nothing else in the proxy changed."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import requests

from epd_flask.control.policyspecs import POLICIES
from epd_flask.control.roster import RosterError, parse
from epd_flask.fleet.policies import Decision, Load, Placement, Policy, RouteRequest
from tests.rosters import roster

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4, "temperature": 0}


class LastListed(Policy):
    """Always the last candidate: easy to tell apart from every shipped policy."""

    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        return Decision(candidates[-1], self.name, "last", f"last-of-{len(candidates)}")


@pytest.fixture
def last_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one line."""
    monkeypatch.setitem(POLICIES, "last_listed", f"{__name__}:LastListed")


def test_an_undeclared_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(RosterError) as info:
        parse({"settings": {"routing": {"decode": "last_listed"}}}, "roster.yaml")
    assert str(info.value) == (
        "roster.yaml: settings field 'routing': Input should be 'round_robin', "
        "'least_loaded', 'prefix', 'session' or 'kv_aware' (for role decode)")


def test_a_policy_declared_in_one_line_routes_and_is_logged(last_listed, sim, proxy,
                                                            caplog) -> None:
    p = sim("prefill")
    d1, d2 = sim("decode"), sim("decode")
    px = proxy(roster([p], [d1, d2], routing={"decode": "last_listed"}))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        for _ in range(3):
            r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert r.status_code == 200, r.text
    assert d1.state.stats()["completions"] == 0 and d2.state.stats()["completions"] == 3
    assert sum("decode:last_listed(last-of-2)" in m for m in caplog.messages) == 3
