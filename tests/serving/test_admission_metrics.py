"""What an operator sees of admission (docs/behaviour.md#admission), through real HTTP: queue
depth per tenant and class on ``/metrics`` while a full fleet holds requests back, the wait
of those that waited, tokens from the answers' usage, every refusal counted by tenant and
reason, the tenant table of ``/status``, the gate on ``/debug/worker``; and a proxy without
admission exposes no admission series at all."""

from __future__ import annotations

import re
from typing import Any

import gevent
import requests

from tests.bodies import chat
from tests.helpers import RawStream, eventually, sample, scrape
from tests.rosters import roster
from tests.serving.test_admission import arrivals, hold_the_place, one_place, post, queue_in_order

REASONS = ("queue_full", "queue_timeout", "client_gone", "rate_limit_requests",
           "rate_limit_tokens", "too_large")


def text(page: requests.Response) -> str:
    """An HTML page's words, one space apart."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.text))


def test_queue_depth_waits_and_tokens_per_tenant(sim, proxy) -> None:
    server, px = one_place(sim, proxy)
    first = scrape(px.url)
    # Every tenant of the roster is there from the start, at 0: an alert's increase() sees
    # the first refusal.
    for tenant in ("chat", "batch", "a", "b", "default"):
        for reason in REASONS:
            assert (("epd_admission_rejected_total",
                     frozenset({("tenant", tenant), ("reason", reason)})) in first)
    assert sample(first, "epd_admission_queue_depth", tenant="batch", priority="low") == 0
    held = hold_the_place(px)
    pending = queue_in_order(px, [("batch", "batch 0"), ("batch", "batch 1"),
                                  ("chat", "chat 0")])
    waiting = scrape(px.url)
    assert sample(waiting, "epd_admission_queue_depth", tenant="batch", priority="low") == 2
    assert sample(waiting, "epd_admission_queue_depth", tenant="chat", priority="high") == 1
    assert sample(waiting, "epd_admission_admitted_total", tenant="default") == 1  # the held
    held.hang_up()
    answers = [g.get(timeout=20) for g in pending]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert arrivals(server)[1:] == ["chat 0", "batch 0", "batch 1"]
    after = scrape(px.url)
    for tenant, priority in (("batch", "low"), ("chat", "high")):
        assert sample(after, "epd_admission_queue_depth", tenant=tenant, priority=priority) == 0
    assert sample(after, "epd_admission_admitted_total", tenant="batch") == 2
    assert sample(after, "epd_admission_admitted_total", tenant="chat") == 1
    counts = {t: sample(after, "epd_admission_wait_seconds_count", tenant=t, priority=p)
              for t, p in (("batch", "low"), ("chat", "high"))}
    assert counts == {"batch": 2, "chat": 1}
    # Both batch requests came before the chat request and went after it: each waited longer.
    waited = {t: sample(after, "epd_admission_wait_seconds_sum", tenant=t, priority=p)
              for t, p in (("batch", "low"), ("chat", "high"))}
    assert waited["batch"] > 2 * waited["chat"] > 0
    used = {"batch": sum(a.json()["usage"]["total_tokens"] for a in answers[:2]),
            "chat": answers[2].json()["usage"]["total_tokens"]}
    for tenant, tokens in used.items():
        assert sample(after, "epd_admission_tokens_total", tenant=tenant) == tokens > 0


def test_every_refusal_is_counted_by_tenant_and_reason(sim, proxy) -> None:
    server, px = one_place(sim, proxy, queue_timeout=1, max_queue=1)
    gate = px.services.admission
    held = hold_the_place(px)
    timing_out = gevent.spawn(post, px, "b", "waits until its time is up")
    eventually(lambda: gate.waiting == 1, what="one request waiting")
    full = post(px, "b", "one too many")  # same tenant and class: it would not go first
    assert full.status_code == 503 and full.json()["error"]["code"] == "overloaded"
    assert timing_out.get(timeout=10).status_code == 503
    leaving = RawStream(px.url, "/v1/chat/completions", chat("leaving", max_tokens=1))
    eventually(lambda: gate.waiting == 1, what="the leaving request waiting")
    leaving.hang_up()
    eventually(lambda: gate.waiting == 0, what="the departed request out of the queue")
    held.hang_up()
    assert not {"one too many", "waits until its time is up", "leaving"} & set(arrivals(server))
    counted = scrape(px.url)
    assert sample(counted, "epd_admission_rejected_total", tenant="b",
                  reason="queue_full") == 1
    assert sample(counted, "epd_admission_rejected_total", tenant="b",
                  reason="queue_timeout") == 1
    assert sample(counted, "epd_admission_rejected_total", tenant="default",
                  reason="client_gone") == 1
    assert sum(v for (name, _), v in counted.items()
               if name == "epd_admission_rejected_total") == 3
    assert sample(counted, "epd_admission_wait_seconds_count", tenant="b", priority="normal") == 0


def limited(sim: Any, proxy: Any, **config: Any) -> Any:
    server = sim("prefill_decode")
    doc = roster(combined=[server], admission={"tenant_header": "X-Tenant"})
    doc["tenants"] = {"limited": {"requests_per_minute": 2, "tokens_per_minute": 1000,
                                  "priority": "low", "weight": 3}}
    return proxy(doc, **config)


def test_rate_limit_refusals_the_tenant_table_and_the_workers_gate(sim, proxy) -> None:
    px = limited(sim, proxy, debug_endpoints=True)

    def ask(**fields: Any) -> requests.Response:
        return requests.post(px.url + "/v1/chat/completions", timeout=10,
                             json=chat(**{"max_tokens": 4, **fields}),
                             headers={"X-Tenant": "limited"})

    statuses = [ask().status_code, ask(max_tokens=5000).status_code, ask().status_code,
                ask().status_code]
    assert statuses == [200, 429, 200, 429]
    counted = scrape(px.url)
    assert sample(counted, "epd_admission_rejected_total", tenant="limited",
                  reason="too_large") == 1
    assert sample(counted, "epd_admission_rejected_total", tenant="limited",
                  reason="rate_limit_requests") == 1
    assert sample(counted, "epd_admission_admitted_total", tenant="limited") == 2
    tokens = sample(counted, "epd_admission_tokens_total", tenant="limited")
    assert tokens > 0
    # No shared store configured: nothing can be down, and no series says otherwise.
    assert not any(name == "epd_admission_store_up" for name, _ in counted)

    page = requests.get(px.url + "/status", timeout=10)
    assert page.status_code == 200
    words = text(page)
    assert "Rate-limit store: none" in words
    row = re.search(r" limited (low) (\S+) (\d+) (\d+) \S+ (\d+) \S+ \S+ \S+ \S+ "
                    r"(?:\S+ \d+, )?\S+ \d+ (\d+) (\d+) \((\d+)\) (\d+) \((\d+)\)", words)
    assert row, words
    priority, weight, waiting, admitted, waited = row.group(1, 2, 3, 4, 5)
    assert (priority, weight, waiting, admitted, waited) == ("low", "3", "0", "2", "0")
    assert "rate_limit_requests 1" in words and "too_large 1" in words
    assert int(row.group(6)) == tokens
    assert (row.group(7), row.group(8)) == ("2", "0")  # requests/min: its limit, none left
    left = int(row.group(10))
    assert row.group(9) == "1000" and 1000 - tokens <= left < 1000  # refilling since

    worker = requests.get(px.url + "/debug/worker", timeout=10).json()
    mine = worker["admission"]["tenants"]["limited"]
    assert mine["admitted"] == 2 and mine["tokens"] == tokens
    assert mine["rejected"] == {"too_large": 1, "rate_limit_requests": 1}
    assert mine["limits"]["requests"]["limit"] == 2 and mine["limits"]["requests"]["remaining"] < 1


def test_without_admission_no_admission_series_and_no_tenant_table(sim, proxy) -> None:
    px = proxy(roster([sim("prefill")], [sim("decode")]), debug_endpoints=True)
    assert requests.post(px.url + "/v1/chat/completions", json=chat(max_tokens=2),
                         timeout=10).status_code == 200
    exposition = requests.get(px.url + "/metrics", timeout=10).text
    assert "epd_requests_total" in exposition and "epd_admission" not in exposition
    assert "Tenants" not in requests.get(px.url + "/status", timeout=10).text
    assert "admission" not in requests.get(px.url + "/debug/worker", timeout=10).json()
