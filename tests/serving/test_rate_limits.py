"""Per-tenant rate limits through real HTTP (docs/behaviour.md#admission): OpenAI's 429 and
headers, token charges corrected by the answer's usage, the ``openai`` client retrying after
``Retry-After``, and one limit for several proxy hosts through a real Redis."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import gevent
import openai
import requests

from epd_flask.serving.ratelimit import TOKENS, HostStore, Take
from tests.bodies import chat
from tests.helpers import sample, scrape
from tests.rosters import roster

HEADERS = {"X-Tenant": "limited"}
LIMIT_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                 "x-ratelimit-reset-requests")


def limited_proxy(sim: Any, proxy: Any, store: str = "", **limits: Any) -> Any:
    server = sim("prefill_decode")
    doc = roster(combined=[server], admission={"tenant_header": "X-Tenant", "store": store})
    doc["tenants"] = {"limited": limits}
    return proxy(doc)


def post(px: Any, **fields: Any) -> requests.Response:
    return requests.post(px.url + "/v1/chat/completions", json=chat(**{"max_tokens": 4, **fields}),
                         headers=HEADERS, timeout=10)


def test_past_its_limit_a_tenant_gets_openais_429_with_its_headers(sim, proxy) -> None:
    px = limited_proxy(sim, proxy, requests_per_minute=3)
    answers = [post(px) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]
    for answer in answers:
        assert answer.headers["x-ratelimit-limit-requests"] == "3"
        assert "x-ratelimit-limit-tokens" not in answer.headers  # no token limit set
    refused = answers[3]
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert "requests per min (RPM): Limit 3" in err["message"]
    # One request per 20 s refills: the wait is what is left of it.
    assert 1 <= int(refused.headers["Retry-After"]) <= 20
    assert 0 < int(refused.headers["retry-after-ms"]) <= 20_000
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    # Untouched by the limit: another tenant, and nothing of the refused reached the instance.
    other = requests.post(px.url + "/v1/chat/completions", json=chat(max_tokens=4), timeout=10)
    assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers


def test_the_token_charge_is_corrected_by_the_answers_usage(sim, proxy) -> None:
    limit = 6000  # refills 100 tokens a second: the bounds below allow for the test's time
    px = limited_proxy(sim, proxy, tokens_per_minute=limit)
    started = time.monotonic()
    first = post(px, max_tokens=400)  # reserves its prompt and 400
    used = first.json()["usage"]["total_tokens"]
    remaining = int(first.headers["x-ratelimit-remaining-tokens"])
    refilled = (time.monotonic() - started) * limit / 60 + 1
    assert limit - used <= remaining <= limit - used + refilled, (used, remaining)
    stream = requests.post(px.url + "/v1/chat/completions", headers=HEADERS, timeout=10,
                           json=chat(max_tokens=400, stream=True,
                                     stream_options={"include_usage": True}))
    assert stream.status_code == 200 and '"usage"' in stream.text
    after = post(px, max_tokens=5)
    refilled = (time.monotonic() - started) * limit / 60 + 1
    spent = limit - int(after.headers["x-ratelimit-remaining-tokens"])
    streamed = used  # the sim answers every chat of this prompt with the same usage
    expected = used + streamed + after.json()["usage"]["total_tokens"]
    assert expected - refilled <= spent <= expected, (spent, expected, refilled)


def test_a_request_larger_than_the_token_limit_is_refused_for_good(sim, proxy) -> None:
    px = limited_proxy(sim, proxy, tokens_per_minute=100)
    refused = post(px, max_tokens=400)
    assert refused.status_code == 429
    assert refused.headers["x-should-retry"] == "false"
    assert refused.json()["error"]["type"] == "tokens"


def test_the_openai_client_retries_a_429_after_retry_after(sim, proxy, caplog) -> None:
    px = limited_proxy(sim, proxy, requests_per_minute=30)  # one request per 2 s refills
    for _ in range(40):  # spend the minute's 30, and a refilled one as soon as it is there
        refused = post(px)
        if refused.status_code == 429:
            wait = int(refused.headers["retry-after-ms"]) / 1000
            if wait > 1.0:
                break  # the next request is more than a second away: the client will meet it
            gevent.sleep(wait)
    client = openai.OpenAI(base_url=px.url + "/v1", api_key="unused", max_retries=2,
                           default_headers=HEADERS, timeout=10)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-ratelimit-limit-requests"] == "30"
    statuses = [r.getMessage() for r in caplog.records if "tenant=limited" in r.getMessage()]
    assert ["status=429" in s for s in statuses] == [True, False], statuses


def test_two_hosts_sharing_a_store_admit_one_limit_between_them(sim, proxy, redis_server,
                                                                caplog) -> None:
    hosts = [limited_proxy(sim, proxy, redis_server.url, requests_per_minute=5)
             for _ in range(2)]
    answers = [post(hosts[n % 2]) for n in range(12)]
    statuses = [a.status_code for a in answers]
    # 5 a minute refill one every 12 s: within the test, at most one more than the bucket.
    assert 5 <= statuses.count(200) <= 6 and set(statuses) == {200, 429}, statuses
    assert statuses[:5] == [200] * 5
    assert all(h.services.admission.limiter.up for h in hosts)
    assert all(sample(scrape(h.url), "epd_admission_store_up") == 1 for h in hosts)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="epd_flask.serving.redisstore"):
        after = [post(host) for host in hosts for _ in range(8)]
    # Each host counts on its own now: its bucket, full, admits its own 5.
    per_host = [sum(a.status_code == 200 for a in after[n * 8:(n + 1) * 8]) for n in range(2)]
    assert all(5 <= n <= 6 for n in per_host), per_host
    assert all(h.services.admission.limiter.up is False for h in hosts)
    assert all(sample(scrape(h.url), "epd_admission_store_up") == 0 for h in hosts)
    warnings = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warnings) == 2, "one warning per host, not one per request"


def test_without_a_store_each_host_enforces_its_own_limit(sim, proxy) -> None:
    hosts = [limited_proxy(sim, proxy, requests_per_minute=3) for _ in range(2)]
    statuses = [post(hosts[n % 2]).status_code for n in range(8)]
    assert statuses.count(200) == 6, statuses
    assert math.isclose(statuses.count(429), 2)


def test_a_stopping_worker_applies_the_corrections_it_still_owes(sim, proxy, tmp_path) -> None:
    """The correction an answer owes goes to the store after the answer, from a greenlet;
    a worker that stops before it ran applies it before closing the store."""
    server = sim("prefill_decode")
    doc = roster(combined=[server], admission={"tenant_header": "X-Tenant"})
    doc["tenants"] = {"limited": {"tokens_per_minute": 6000}}
    px = proxy(doc, state_dir=str(tmp_path))
    assert post(px).status_code == 200
    gate = px.services.admission
    gate.correct("limited", [Take(TOKENS, 6000, 3000)])  # what an estimate missed
    gate.stop()  # at once: the correction's greenlet has not run
    store = HostStore(tmp_path / "ratelimit.bin")
    try:
        left = store.apply("limited", [Take(TOKENS, 6000, 0)], give=True).levels[0].remaining
    finally:
        store.close()
    assert left < 3000, left  # the 3,000 were taken (and the request's own charge)
