"""Routing policies through real HTTP against the simulated fleet
(docs/behaviour.md#routing-policies)."""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor

import requests

from tests import bodies
from tests.helpers import eventually
from tests.rosters import roster

SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 20}
TURN1 = [SYSTEM, {"role": "user", "content": "What does a prefix cache keep?"}]
TURN2 = [*TURN1, {"role": "assistant", "content": "The KV of prompts it has seen."},
         {"role": "user", "content": "And when is it evicted?"}]


def chat(url: str, messages: list[dict[str, str]], **extra: object) -> dict:
    r = requests.post(url + "/v1/chat/completions", timeout=10,
                      json=bodies.conversation(messages, max_tokens=4, **extra))
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def two_turns_three_times(sim, proxy, policy: str) -> tuple[list[int], list[int]]:
    ps = [sim("prefill", prompt_tokens_details=True, max_model_len=4096) for _ in range(3)]
    ds = [sim("decode", max_model_len=4096)]
    px = proxy(roster(ps, ds, routing={"prefill": policy}))
    hits = []
    for _ in range(3):
        hits.append(cached(chat(px.url, TURN1)))
        hits.append(cached(chat(px.url, TURN2)))
    return hits, [p.state.stats()["completions"] for p in ps]


def test_prefix_keeps_a_conversation_on_one_prefill_and_it_reports_cached_tokens(
        sim, proxy) -> None:
    hits, per_prefill = two_turns_three_times(sim, proxy, "prefix")
    assert sorted(per_prefill) == [0, 0, 6]
    assert hits[0] == 0 and all(h >= 160 for h in hits[1:]), hits
    rr_hits, rr_per_prefill = two_turns_three_times(sim, proxy, "round_robin")
    assert rr_per_prefill == [2, 2, 2]
    assert sum(rr_hits) < sum(hits) and rr_hits[1] == 0, (rr_hits, hits)


def test_session_keeps_a_user_on_one_decode(sim, proxy) -> None:
    ds = [sim("decode") for _ in range(3)]
    px = proxy(roster([sim("prefill")], ds, routing={"decode": "session"}))
    for i in range(4):
        chat(px.url, [{"role": "user", "content": f"question {i}"}], user="alice")
    assert sorted(d.state.stats()["completions"] for d in ds) == [0, 0, 4]


def test_session_header_keys_session_affinity_before_user(sim, proxy) -> None:
    ds = [sim("decode") for _ in range(4)]
    px = proxy(roster([sim("prefill")], ds, routing={"decode": "session"},
                         session_header="X-Session-Id"))
    for i in range(6):  # a different user each time, one session header
        r = requests.post(px.url + "/v1/chat/completions", timeout=10, headers={
            "X-Session-Id": "s-42"}, json=bodies.chat(f"q{i}", max_tokens=2, user=f"u{i}"))
        assert r.status_code == 200
    assert sorted(d.state.stats()["completions"] for d in ds) == [0, 0, 0, 6]


def test_short_prompts_skip_prefill_and_long_ones_do_not(sim, proxy, caplog) -> None:
    p, d = sim("prefill", max_model_len=4096), sim("decode", max_model_len=4096)
    px = proxy(roster([p], [d], disaggregate_min_prompt_tokens=64))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        chat(px.url, [{"role": "user", "content": "hi"}])
    assert p.state.stats()["completions"] == 0 and d.state.stats()["completions"] == 1
    assert "kv_transfer_params" not in d.state.requests(1)[0]["body"]
    assert "prefill:disaggregate(short)" in caplog.text
    chat(px.url, TURN1)  # ~170 estimated tokens
    assert p.state.stats()["completions"] == 1 and d.state.stats()["completions"] == 2


def test_decisions_are_logged_and_counted(sim, proxy, caplog) -> None:
    ps = [sim("prefill"), sim("prefill")]
    px = proxy(roster(ps, [sim("decode"), sim("decode")],
                         routing={"prefill": "prefix", "decode": "least_loaded"}))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        chat(px.url, TURN1)
    line = [r.getMessage() for r in caplog.records if r.name == "epd_flask.requests"][-1]
    assert "routing=decode:least_loaded(tie:0),prefill:prefix(hit)" in line
    text = requests.get(px.url + "/metrics", timeout=5).text
    hit = [ln for ln in text.splitlines() if ln.startswith("epd_routing_decisions_total{")
           and 'policy="prefix"' in ln and 'outcome="hit"' in ln]
    assert hit and float(hit[0].rsplit(" ", 1)[1]) >= 1
    status = requests.get(px.url + "/status", timeout=5).text
    assert "Routing decisions" in status and "prefill prefix hit" in status


def test_least_loaded_prefill_counts_the_prompt_tokens_in_flight(sim, proxy, caplog) -> None:
    """A prefill's load is the estimated tokens it is computing, not its count of calls:
    one long prompt in flight makes its instance the busier one for the next request."""
    ps = [sim("prefill", ttft=1.0, max_model_len=4096) for _ in range(2)]
    px = proxy(roster(ps, [sim("decode", max_model_len=4096)],
                         routing={"prefill": "least_loaded"}))
    long_prompt = [{"role": "user", "content": "Summarise this. " + "word " * 600}]
    pool = ThreadPoolExecutor(1)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        first = pool.submit(chat, px.url, long_prompt)
        eventually(lambda: sum(p.state.stats()["in_flight"] for p in ps) == 1)
        chat(px.url, [{"role": "user", "content": "Short?"}])
        first.result(timeout=10)
    pool.shutdown()
    why = re.search(r"prefill:least_loaded\((\d+)<(\d+)\)", caplog.text)
    assert why is not None, caplog.text
    assert int(why.group(1)) == 0 and int(why.group(2)) > 100, caplog.text
