"""``kv_aware`` routing through real HTTP: simulated prefills whose KV-cache events (a real ZMQ
publisher per instance) say what they hold (docs/behaviour.md#routing-policies)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import requests

from tests.helpers import eventually, scrape
from tests.unit.test_kvaware import Publisher

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
    doc = {"settings": {"routing": {"prefill": "kv_aware"}},
           "instances": [{"role": "prefill", "url": p.url, "kv_events": pub.endpoint}
                         for p, pub in zip(prefills, publishers, strict=True)]
           + [{"role": "decode", "url": sim("decode").url}]}
    px = proxy(doc, probes=True)
    kv = px.services.kv_events
    assert eventually(lambda: len(kv.readers) == n
                      and all(r.connected for r in kv.readers.values()))
    return px, prefills


def complete(url: str, prompt: Any) -> dict[str, Any]:
    r = requests.post(url + "/v1/completions", timeout=10,
                      json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2})
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
        for _ in range(50):
            publishers[holder].engine.hashes.clear()
            publishers[holder].store(PROMPT[:32])
            if eventually(lambda: px.services.kv_events.picture(prefills[holder].url)
                          is not None, 0.1):
                break
        before = decisions(px.url, "kvhit")
        for _ in range(3):
            complete(px.url, PROMPT)
    assert served(prefills)[holder] == 3
    assert decisions(px.url, "kvhit") == before + 3
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
    for _ in range(50):
        publishers[0].engine.hashes.clear()
        publishers[0].store(PROMPT)
        if eventually(lambda: px.services.kv_events.picture(prefills[0].url) is not None, 0.1):
            break
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        complete(px.url, ["first prompt of a batch", "second"])
    line = next(r.getMessage() for r in caplog.records if r.name == "epd_flask.requests")
    assert "prefill:kv_aware(notokens," in line
