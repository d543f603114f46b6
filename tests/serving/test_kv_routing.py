"""``kv_aware`` routing through real HTTP: simulated prefills whose KV-cache events (a real ZMQ
publisher per instance) say what they hold (docs/behaviour.md#routing-policies)."""

from __future__ import annotations

import logging
import re
from typing import Any

import gevent
import pytest
import requests

from tests.bodies import completion, conversation
from tests.helpers import eventually, scrape
from tests.rosters import roster
from tests.unit.test_kvaware import Publisher, publish_until_ready

PROMPT = list(range(2000, 2000 + 40))  # ten blocks of the test engine's 4 tokens


@pytest.fixture
def publishers() -> Any:
    started: list[Publisher] = []
    yield started
    for p in started:
        p.close()


def kv_fleet(sim, proxy, publishers: list[Publisher], n: int = 3) -> tuple[Any, list[Any]]:
    prefills = [sim("prefill") for _ in range(n)]
    publishers += [Publisher() for _ in range(n)]
    doc = roster([(p, {"kv_events": pub.endpoint})
                  for p, pub in zip(prefills, publishers, strict=True)],
                 [sim("decode")], routing={"prefill": "kv_aware"})
    px = proxy(doc, probes=True)
    kv = px.services.kv_events
    assert eventually(lambda: len(kv.readers) == n
                      and all(r.connected for r in kv.readers.values()))
    return px, prefills


def complete(url: str, prompt: Any) -> dict[str, Any]:
    r = requests.post(url + "/v1/completions", timeout=10,
                      json=completion(prompt, max_tokens=2))
    assert r.status_code == 200, r.text
    return r.json()


def served(prefills: list[Any]) -> list[int]:
    return [p.state.stats()["completions"] for p in prefills]


def decisions(base: str, outcome: str) -> float:
    return sum(v for (name, labels), v in scrape(base).items()
               if name == "epd_routing_decisions_total"
               and ("outcome", outcome) in labels and ("policy", "kv_aware") in labels)


def test_kv_aware_sends_a_prompt_where_the_events_say_it_is_cached(
        sim, proxy, publishers, caplog: pytest.LogCaptureFixture) -> None:
    px, prefills = kv_fleet(sim, proxy, publishers)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        complete(px.url, PROMPT)  # no picture yet: the prefix choice
        first = served(prefills).index(1)
        holder = (first + 1) % 3  # another instance reports the prompt's first 8 blocks
        publish_until_ready(px.services.kv_events, publishers[holder], prefills[holder].url,
                            PROMPT[:32])
        for _ in range(3):
            complete(px.url, PROMPT)
    assert served(prefills)[holder] == 3
    assert decisions(px.url, "kvhit") == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_flask.requests"]
    assert "prefill:kv_aware(noevents," in lines[0]
    assert all("prefill:kv_aware(blocks=8/10,load=0)" in line for line in lines[1:])
    # A prompt held nowhere: the prefix choice, counted as a miss.
    miss = decisions(px.url, "kvmiss")
    complete(px.url, [5] * 40)
    assert decisions(px.url, "kvmiss") == miss + 1


def test_kv_aware_without_tokens_answers_from_the_prefix_choice(
        sim, proxy, publishers, caplog: pytest.LogCaptureFixture) -> None:
    """A prompt the proxy cannot get tokens for (a batch here; a /tokenize that fails or is
    slow alike): the request is served where prefix would send it, never refused."""
    px, prefills = kv_fleet(sim, proxy, publishers, n=2)
    publish_until_ready(px.services.kv_events, publishers[0], prefills[0].url, PROMPT)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        complete(px.url, ["first prompt of a batch", "second"])
    line = next(r.getMessage() for r in caplog.records if r.name == "epd_flask.requests")
    assert "prefill:kv_aware(notokens," in line


SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 20}


def turns(topic: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    turn1 = [SYSTEM, {"role": "user", "content": f"What does a {topic} keep?"}]
    return turn1, [*turn1, {"role": "assistant", "content": "Whatever it was given."},
                   {"role": "user", "content": "And when does it forget?"}]


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = requests.post(url + "/v1/chat/completions", timeout=10,
                      json=conversation(messages, max_tokens=4))
    assert r.status_code == 200, r.text
    return r.json()


def events_endpoint(sim_url: str) -> str:
    """Where the sim bound its publisher, as ``/kv_event_sources`` reports it."""
    sources = requests.get(sim_url + "/kv_event_sources", timeout=5).json()
    return "tcp://127.0.0.1:" + sources["0"]["endpoint"].rsplit(":", 1)[1]


#: As vLLM: a * host binds (the sim binds its own host, 127.0.0.1), port 0 any port.
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
          "topic": "kv"}


def publishing_prefills(sim: Any) -> list[Any]:
    return [sim("prefill", kv_events_config=EVENTS, block_size=32, prompt_tokens_details=True,
                max_model_len=4096) for _ in range(3)]


def kv_aware_proxy(sim: Any, proxy: Any, prefills: list[Any]) -> tuple[Any, Any]:
    """A kv_aware proxy over ``prefills`` and a decode, once its readers are subscribed."""
    doc = roster([(p, {"kv_events": events_endpoint(p.url)}) for p in prefills],
                 [sim("decode", max_model_len=4096)], routing={"prefill": "kv_aware"})
    px = proxy(doc, probes=True)
    kv = px.services.kv_events
    assert eventually(lambda: len(kv.readers) == 3
                      and all(r.connected for r in kv.readers.values()))
    gevent.sleep(0.2)  # the subscriptions travel to the publishers after the connection
    return px, kv


def test_kv_aware_follows_the_simulators_own_events_and_tokenize(sim, proxy) -> None:
    """The sims publish vLLM-format events and answer /tokenize: a conversation whose first
    turn was computed on one prefill (even one the proxy never sent it to) has its second
    turn sent there, and that prefill serves the shared blocks from its cache."""
    prefills = publishing_prefills(sim)
    px, kv = kv_aware_proxy(sim, proxy, prefills)
    for n, topic in enumerate(("prefix cache", "KV block", "radix tree")):
        turn1, turn2 = turns(topic)
        warm = prefills[n]  # the first turn computed there, by a client of its own
        chat(warm.url, turn1)
        assert eventually(lambda w=warm: kv.picture(w.url) is not None)
        before = served(prefills)
        answer = chat(px.url, turn2)
        after = served(prefills)
        assert [a - b for a, b in zip(after, before, strict=True)] == \
            [1 if p is warm else 0 for p in prefills]
        assert (answer["usage"].get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0) >= 160


def test_kv_aware_sees_conversations_over_a_prefix_cached_before_it_subscribed(
        sim, proxy, caplog) -> None:
    """A proxy (or a reload's new worker) that subscribes after a prefill cached a
    conversation's head never hears that head stored; the turns stored on top of it later
    still send the conversation there."""
    prefills = publishing_prefills(sim)
    conversations = []
    for n, topic in enumerate(("prefix cache", "KV block", "radix tree")):
        turn1, _ = turns(topic)
        # Several blocks of its own, so the blocks the next turn repeats are more than the
        # last one (which holds the generation prompt the next turn does not repeat).
        turn2 = [*turn1, {"role": "assistant", "content": f"A {topic} keeps entries. " * 12},
                 {"role": "user", "content": "And when does it forget them? " * 6}]
        chat(prefills[n].url, turn1)  # before any subscriber: its blocks are never heard of
        conversations.append((prefills[n], turn2))
    px, kv = kv_aware_proxy(sim, proxy, prefills)
    for warm, turn2 in conversations:
        chat(warm.url, turn2)  # stored on top of the unheard head
        assert eventually(lambda w=warm: kv.picture(w.url) is not None)
        turn3 = [*turn2, {"role": "assistant", "content": "When it is full."},
                 {"role": "user", "content": "Which entries go first?"}]
        before = served(prefills)
        with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
            chat(px.url, turn3)
        after = served(prefills)
        assert [a - b for a, b in zip(after, before, strict=True)] == \
            [1 if p is warm else 0 for p in prefills]
        line = [r.getMessage() for r in caplog.records if r.name == "epd_flask.requests"][-1]
        assert re.search(r"prefill:kv_aware\(blocks=[1-9]", line), line


@pytest.mark.parametrize("token", [2 ** 32, 2 ** 64], ids=["2^32", "2^64"])
def test_token_ids_no_block_name_can_hold_route_by_prefix_and_reach_vllm(
        sim, proxy, publishers, caplog: pytest.LogCaptureFixture, token: int) -> None:
    """A prompt of token ids past 2^32-1 (no vocabulary has them; negative ones the proxy
    refuses itself): kv_aware cannot name its blocks, so it routes as prefix and the prefill
    judges the ids (vLLM answers 400 for ids outside its vocabulary); never a 5xx."""
    px, prefills = kv_fleet(sim, proxy, publishers, n=2)
    for _ in range(50):
        publishers[0].engine.hashes.clear()
        publishers[0].store(PROMPT)
        if eventually(lambda: px.services.kv_events.picture(prefills[0].url) is not None, 0.1):
            break
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        complete(px.url, [token] * 32)
    line = next(r.getMessage() for r in caplog.records if r.name == "epd_flask.requests")
    assert "prefill:kv_aware(notokens," in line
