"""The fleet benchmark's oracle (tests/bench/oracle.py) through real HTTP: declared as any
policy is, it sends a prompt where it would finish first, knowing the simulators' caches and
queues from the prompts it routed there."""

from __future__ import annotations

import sys
from pathlib import Path

import gevent
import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mooncaketrace
from mooncaketrace import Row

from epd_flask.control.policyspecs import POLICIES
from tests.helpers import eventually
from tests.rosters import roster

PROMPT_A = Row(0.0, 4096, 1, tuple(range(8)))
PROMPT_B = Row(0.0, 4096, 1, tuple(range(100, 108)))


@pytest.fixture
def oracle_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The line gunicorn_bench.conf.py adds for a benchmark run."""
    monkeypatch.setitem(POLICIES, "oracle", "oracle:Oracle")


def test_the_oracle_sends_a_prompt_where_it_would_finish_first(oracle_policy, sim,
                                                               proxy) -> None:
    slow = {"prefill_tokens_per_s": 4096.0, "token_delay": 0.001, "max_model_len": 8192}
    p1, p2 = sim("prefill", **slow), sim("prefill", **slow)
    d = sim("decode", **slow)
    px = proxy(roster([p1, p2], [d], routing={"prefill": "oracle", "decode": "oracle"}))

    def send(row: Row) -> None:
        r = requests.post(px.url + "/v1/completions", timeout=30,
                          json={**mooncaketrace.body(row, "tiny-llama", 1), "stream": False})
        assert r.status_code == 200, r.text

    def served() -> tuple[int, int]:
        return p1.state.stats()["completions"], p2.state.stats()["completions"]

    # A takes its instance ~1 s; B, sent meanwhile, goes where nothing is queued.
    first = gevent.spawn(send, PROMPT_A)
    eventually(lambda: sum(served()) == 1, what="A reaches a prefill")
    holder, other = (p1, p2) if served()[0] else (p2, p1)
    send(PROMPT_B)
    first.get(timeout=30)
    assert other.state.stats()["completions"] == 1
    # Both idle again: A goes back where its blocks are, and only its last block is computed.
    computed = holder.state.stats()["prefix_computed_tokens"]
    send(PROMPT_A)
    assert holder.state.stats()["completions"] == 2
    assert holder.state.stats()["prefix_computed_tokens"] - computed == 16
