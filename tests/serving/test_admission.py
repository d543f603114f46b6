"""Admission control through real HTTP (docs/behaviour.md#admission): a full fleet queues
requests instead of sending them, high priority overtakes low, tenants of one class share by
weight, and a client that leaves the queue never reaches an instance."""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

import gevent
import pytest
import requests

from epd_flask.control.roles import DECODE, PREFILL
from epd_flask.control.roster import Tenant, parse
from epd_flask.fleet import loadboard
from epd_flask.serving.admission import Ticket
from tests.bodies import chat
from tests.helpers import RawStream, eventually
from tests.rosters import roster

TENANTS = {"chat": {"weight": 4, "priority": "high"}, "batch": {"weight": 1, "priority": "low"},
           "a": {"weight": 4}, "b": {"weight": 1}}
ADMISSION = {"tenant_header": "X-Tenant", "queue_timeout": 20}
#: A stream that lasts until its client hangs up (400 tokens 50 ms apart: 20 s at most, which
#: the waits for the requests behind it outlast).
HOLD = chat("hold the only place", stream=True, max_tokens=400)


def one_place(sim: Any, proxy: Any, tenants: dict[str, Any] = TENANTS,
              **admission: Any) -> tuple[Any, Any]:
    """A proxy in front of one prefill_decode instance that takes one request at a time."""
    server = sim("prefill_decode", token_delay=0.05, output_tokens=400)
    doc = roster(combined=[(server, {"max_concurrency": 1})],
                 admission={**ADMISSION, **admission})
    doc["tenants"] = tenants
    return server, proxy(doc)


def post(px: Any, tenant: str, content: str, **fields: Any) -> requests.Response:
    return requests.post(px.url + "/v1/chat/completions", timeout=30,
                         json=chat(content, max_tokens=1, **fields), headers={"X-Tenant": tenant})


def arrivals(server: Any) -> list[str]:
    """The user message of every completion the instance received, in arrival order."""
    return [r["body"]["messages"][0]["content"] for r in server.state.requests()
            if r.get("path") == "/v1/chat/completions"]


def hold_the_place(px: Any) -> RawStream:
    held = RawStream(px.url, "/v1/chat/completions", HOLD)
    held.first_event()
    return held


def queue_in_order(px: Any, sent: list[tuple[str, str]]) -> list[gevent.Greenlet]:
    """Post each (tenant, prompt) of ``sent`` once the one before it waits at the gate, so the
    queue holds them in this order (sent at once, two clients may reach it either way)."""
    gate = px.services.admission
    pending = []
    for tenant, prompt in sent:
        before = gate.waiting
        pending.append(gevent.spawn(post, px, tenant, prompt))
        eventually(lambda n=before: gate.waiting == n + 1, what=f"{prompt!r} waiting")
    return pending


def test_a_full_instance_queues_and_high_priority_overtakes_low(sim, proxy, caplog) -> None:
    server, px = one_place(sim, proxy)
    held = hold_the_place(px)
    pending = queue_in_order(px, [("batch", "batch 0"), ("batch", "batch 1"),
                                  ("chat", "chat 0")])
    assert arrivals(server) == [HOLD["messages"][0]["content"]], "a waiting request went out"
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        held.hang_up()
        answers = [g.get(timeout=40) for g in pending]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert arrivals(server)[1:] == ["chat 0", "batch 0", "batch 1"]
    lines = [r.getMessage() for r in caplog.records if "tenant=chat" in r.getMessage()]
    assert len(lines) == 1 and "queue_ms=" in lines[0] and "first_byte_ms=" in lines[0]
    waited = float(re.search(r" queue_ms=(\S+)", lines[0]).group(1))
    first_byte = float(re.search(r" first_byte_ms=(\S+)", lines[0]).group(1))
    assert 0 < waited <= first_byte, "the wait is part of the time to first byte"


def test_tenants_of_one_class_are_served_in_the_ratio_of_their_weights(sim, proxy) -> None:
    server, px = one_place(sim, proxy)
    gate = px.services.admission
    held = hold_the_place(px)
    flood = [gevent.spawn(post, px, tenant, f"{tenant} {n}")
             for n in range(30) for tenant in ("b", "a")]
    eventually(lambda: gate.waiting == 60, what="both tenants' floods waiting")
    server.state.configure(token_delay=0.0)  # the held stream ends, the flood runs quickly
    held.hang_up()
    answers = [g.get(timeout=30) for g in flood]
    assert all(a.status_code == 200 for a in answers)
    served = Counter(name.split()[0] for name in arrivals(server)[1:26])
    # Both kept requests waiting throughout the first 25: 4:1 within 10 %.
    assert 18 <= served["a"] <= 22 and served["a"] + served["b"] == 25, served


def test_a_tenant_alone_may_use_the_whole_fleet(sim, proxy) -> None:
    server = sim("prefill_decode", token_delay=0.05, output_tokens=400)
    doc = roster(combined=[(server, {"max_concurrency": 3})], admission=ADMISSION)
    doc["tenants"] = TENANTS
    px = proxy(doc)
    streams = [RawStream(px.url, "/v1/chat/completions", {**HOLD, "user": str(n)})
               for n in range(3)]
    for stream in streams:
        stream.first_event()  # all three run at once: a weight is a share of what is short
    assert px.services.admission.waiting == 0
    blocked = gevent.spawn(post, px, "b", "the fourth")
    eventually(lambda: px.services.admission.waiting == 1, what="the fourth waiting")
    streams[0].hang_up()
    assert blocked.get(timeout=40).status_code == 200
    for stream in streams[1:]:
        stream.hang_up()


def test_a_client_that_leaves_the_queue_never_reaches_an_instance(sim, proxy, caplog) -> None:
    server, px = one_place(sim, proxy)
    gate = px.services.admission
    held = hold_the_place(px)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        leaving = RawStream(px.url, "/v1/chat/completions", chat("leaving", max_tokens=1))
        eventually(lambda: gate.waiting == 1, what="the request waiting")
        leaving.hang_up()
        eventually(lambda: gate.waiting == 0, what="the departed request out of the queue")
        held.hang_up()
        after = post(px, "a", "after")
    assert after.status_code == 200
    assert "leaving" not in arrivals(server)
    assert any("status=499" in r.getMessage() and "queue_ms=" not in r.getMessage()
               for r in caplog.records)


def test_a_request_waits_no_longer_than_queue_timeout(sim, proxy) -> None:
    server, px = one_place(sim, proxy, queue_timeout=0.3)
    held = hold_the_place(px)
    refused = post(px, "a", "too late")
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert "too late" not in arrivals(server)
    assert px.services.admission.snapshot()["tenants"]["a"]["rejected"] == {"queue_timeout": 1}
    held.hang_up()


def test_past_max_queue_a_request_is_refused_at_once(sim, proxy) -> None:
    server, px = one_place(sim, proxy, max_queue=1)
    gate = px.services.admission
    held = hold_the_place(px)
    waiting = gevent.spawn(post, px, "a", "waits")
    eventually(lambda: gate.waiting == 1, what="one request waiting")
    refused = post(px, "b", "refused")
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    held.hang_up()
    assert waiting.get(timeout=40).status_code == 200
    assert "refused" not in arrivals(server)


def test_forward_priority_gives_vllm_the_tenants_class(sim, proxy) -> None:
    server, px = one_place(sim, proxy, forward_priority=True)
    for tenant in ("chat", "a", "batch"):
        assert post(px, tenant, f"from {tenant}", priority=7).status_code == 200
    sent = {r["body"]["messages"][0]["content"]: r["body"]["priority"]
            for r in server.state.requests() if r.get("path") == "/v1/chat/completions"}
    assert sent == {"from chat": -1, "from a": 0, "from batch": 1}


def test_without_forward_priority_the_clients_priority_passes(sim, proxy) -> None:
    server, px = one_place(sim, proxy)
    assert post(px, "chat", "mine", priority=3).status_code == 200
    assert server.state.requests(1)[0]["body"]["priority"] == 3


def test_an_engine_that_reports_a_queue_is_full_for_every_host(sim, proxy) -> None:
    """Another host's requests fill the engine (sent to it directly here): the prober reads
    its waiting queue, and this proxy holds its own request back until the queue is gone."""
    server = sim("prefill_decode", token_delay=0.05, output_tokens=400, max_num_seqs=1)
    doc = roster(combined=[server], admission=ADMISSION, probe_interval=0.1,
                 engine_metrics_interval=0.1)
    doc["tenants"] = TENANTS
    px = proxy(doc, probes=True)
    gate = px.services.admission
    others = [RawStream(server.url, "/v1/chat/completions", {**HOLD, "user": str(n)})
              for n in range(5)]
    others[0].first_event()  # one runs, four wait in the engine
    eventually(lambda: gate.capacity.full(px.services.live.view.instances[0]),
               what="the prober reading the engine's queue")
    waiting = gevent.spawn(post, px, "a", "from this host")
    eventually(lambda: gate.waiting == 1, what="this host's request waiting in the proxy")
    assert "from this host" not in arrivals(server)
    for other in others:
        other.hang_up()
    assert waiting.get(timeout=40).status_code == 200
    assert "from this host" in arrivals(server)


def test_a_full_queue_refuses_the_request_that_would_go_last(sim, proxy) -> None:
    server, px = one_place(sim, proxy, max_queue=1)
    gate = px.services.admission
    held = hold_the_place(px)
    low = gevent.spawn(post, px, "batch", "low waits")
    eventually(lambda: gate.waiting == 1, what="the low-priority request waiting")
    high = gevent.spawn(post, px, "chat", "high arrives")
    pushed = low.get(timeout=10)  # refused at once: the high one goes before it
    assert pushed.status_code == 503 and pushed.headers["Retry-After"] == "1"
    assert gate.waiting == 1
    held.hang_up()
    assert high.get(timeout=40).status_code == 200
    assert "low waits" not in arrivals(server)
    assert gate.snapshot()["tenants"]["batch"]["rejected"] == {"queue_full": 1}


def test_without_admission_nothing_is_counted_until_a_roster_turns_it_on(sim, proxy,
                                                                          tmp_path) -> None:
    """A roster without admission serves as before it existed: no completion counted against
    a bound, no bucket file; the worker's load file carries only routing's open calls."""
    server = sim("prefill_decode", ttft=0.3)
    px = proxy(roster(combined=[server]), probes=True, state_dir=str(tmp_path))
    board = px.services.registry.board
    running = []
    slow = gevent.spawn(post, px, "a", "no admission")
    eventually(lambda: board.count(server.url, loadboard.CALLS) == 1, what="the call open")
    running.append(board.count(server.url))
    assert slow.get(timeout=30).status_code == 200
    assert "x-ratelimit-limit-requests" not in post(px, "a", "again").headers
    assert running == [0]

    def files() -> list[str]:
        return sorted(p.name.split("-")[0] for p in tmp_path.iterdir()
                      if p.name.startswith(("load-", "ratelimit")))
    assert files() == ["load"]
    doc = roster(combined=[(server, {"max_concurrency": 1})], admission=ADMISSION)
    doc["tenants"] = {"a": {"requests_per_minute": 100}}
    px.services.live.adopt(parse(doc, "test roster"), 2)
    assert post(px, "a", "with admission").headers["x-ratelimit-limit-requests"] == "100"
    assert files() == ["load", "ratelimit.bin"]


def test_a_role_routed_beyond_the_admitted_ones_holds_its_place_while_it_runs(sim,
                                                                            proxy) -> None:
    """A short prompt is let through for decode alone; when decode's cache picture then shows
    more of it to compute, prefill runs too, and its place there counts until the end."""
    prefill, decode = sim("prefill"), sim("decode")
    px = proxy(roster([(prefill, {"max_concurrency": 1})], [decode],
                      admission=ADMISSION))
    gate = px.services.admission
    ticket = Ticket(gate, "a", Tenant(), (None, (DECODE,)), 10, 10, False)
    ticket.routed(DECODE, decode.url)
    ticket.routed(PREFILL, prefill.url)
    assert gate.capacity.full(px.services.live.view.instances[0])
    assert not gate.capacity.room(PREFILL, None)
    ticket.retried()
    assert gate.capacity.room(PREFILL, None)


def test_a_retry_leaves_the_failed_decode_for_a_full_one(sim, proxy) -> None:
    """Exclusions come before roominess: a decode that failed is not chosen again because the
    only other one is full; the retry goes there, as it would without admission."""
    prefill = sim("prefill")
    decodes = [sim("decode", token_delay=0.05, output_tokens=400) for _ in range(2)]
    px = proxy(roster([prefill], [(d, {"max_concurrency": 1}) for d in decodes],
                      admission=ADMISSION, decode_retries=1))
    first = hold_the_place(px)
    failing = next(d for d in decodes if d.state.stats()["completions"] == 1)
    full = next(d for d in decodes if d is not failing)
    second = hold_the_place(px)
    assert full.state.stats()["completions"] == 1, "the second stream takes the other place"
    first.hang_up()
    gate = px.services.admission
    eventually(lambda: gate.capacity.room(DECODE, None), what="the first stream's place freed")
    failing.state.inject(fail_next=2)
    r = post(px, "a", "retried elsewhere")
    assert r.status_code == 200, r.text
    assert failing.state.stats()["failed_injected"] == 1
    assert full.state.stats()["completions"] == 2
    second.hang_up()


def test_a_lower_class_leaves_the_reserve_free_while_a_better_one_is_active(sim,
                                                                            proxy) -> None:
    """``reserve``: after a ``high`` request, a ``normal`` one waits for the instance's last
    place although it is free, and the next ``high`` request takes it at once."""
    server = sim("prefill_decode", token_delay=0.05, output_tokens=400)
    doc = roster(combined=[(server, {"max_concurrency": 2})],
                 admission={**ADMISSION, "reserve": 1})
    doc["tenants"] = TENANTS
    px = proxy(doc)
    gate = px.services.admission
    assert post(px, "chat", "chat first").status_code == 200
    held = hold_the_place(px)  # the default tenant, normal: the first place
    waiting = gevent.spawn(post, px, "a", "normal waits")
    eventually(lambda: gate.waiting == 1, what="the normal request waiting beside a free place")
    assert post(px, "chat", "chat again").status_code == 200, "the reserve is high's at once"
    assert gate.waiting == 1 and "normal waits" not in arrivals(server)
    held.hang_up()
    assert waiting.get(timeout=30).status_code == 200
    assert arrivals(server)[-1] == "normal waits"


def test_without_a_better_class_the_reserve_is_anyones(sim, proxy) -> None:
    server = sim("prefill_decode", token_delay=0.05, output_tokens=400)
    doc = roster(combined=[(server, {"max_concurrency": 2})],
                 admission={**ADMISSION, "reserve": 1})
    doc["tenants"] = TENANTS
    px = proxy(doc)
    held = hold_the_place(px)
    assert post(px, "a", "normal takes the last place").status_code == 200
    held.hang_up()


def where_each_went(servers: list[Any]) -> dict[str, int]:
    """Which of ``servers`` (by index) received each user message."""
    return {content: n for n, server in enumerate(servers) for content in arrivals(server)}


def unanswered(px: Any, server: Any) -> int:
    counts = px.services.admission.capacity.board.counts(server.url)
    return sum(counts[field] for field in loadboard.UNANSWERED)


@pytest.mark.parametrize("forward_priority", [True, False])
def test_a_better_class_goes_where_none_of_its_prompts_is_unanswered(
        sim, proxy, forward_priority: bool) -> None:
    """With the engines computing ``high`` first, a ``high`` request waits there only for
    the ``high`` prompts not yet answered: the second goes to the engine without one even
    where round-robin (its turn moved on by a ``low`` request) would send it to the first's.
    Without ``forward_priority`` the engines are first come, first served: round-robin
    decides as always."""
    servers = [sim("prefill_decode", ttft=1.0, output_tokens=2) for _ in range(2)]
    doc = roster(combined=servers, routing={"decode": "round_robin"},
                 admission={**ADMISSION, "forward_priority": forward_priority})
    doc["tenants"] = TENANTS
    px = proxy(doc)
    sent = [gevent.spawn(post, px, "chat", "chat first")]
    eventually(lambda: "chat first" in where_each_went(servers), what="the first chat sent")
    sent.append(gevent.spawn(post, px, "batch", "batch between"))
    eventually(lambda: "batch between" in where_each_went(servers), what="the batch sent")
    sent.append(gevent.spawn(post, px, "chat", "chat second"))
    eventually(lambda: "chat second" in where_each_went(servers), what="the second chat sent")
    went = where_each_went(servers)
    assert went["batch between"] != went["chat first"], "round-robin alternates"
    if forward_priority:
        assert went["chat second"] == went["batch between"], "kept apart from the first chat"
        assert unanswered(px, servers[went["chat first"]]) > 0
    else:
        assert went["chat second"] == went["chat first"], "round-robin's turn"
    assert [g.get(timeout=30).status_code for g in sent] == [200, 200, 200]
    assert [unanswered(px, s) for s in servers] == [0, 0], "an answered prompt is not ahead"


def test_between_engines_as_far_behind_a_better_class_goes_where_its_prompts_began_first(
        sim, proxy) -> None:
    """Two engines each computing one ``high`` prompt not yet answered: the next ``high``
    request goes to the engine whose prompt was routed first (it is done sooner there), even
    where round-robin's turn (moved on by a ``low`` request) is the other's."""
    servers = [sim("prefill_decode", ttft=1.0, output_tokens=2) for _ in range(2)]
    doc = roster(combined=servers, routing={"decode": "round_robin"},
                 admission={**ADMISSION, "forward_priority": True})
    doc["tenants"] = TENANTS
    px = proxy(doc)
    sent = []
    for tenant, content in [("chat", "chat A"), ("batch", "batch"), ("chat", "chat B")]:
        sent.append(gevent.spawn(post, px, tenant, content))
        eventually(lambda c=content: c in where_each_went(servers), what=f"{content} sent")
        gevent.sleep(0.01)  # routed in another millisecond than the next
    went = where_each_went(servers)
    assert went["batch"] == went["chat B"] != went["chat A"], \
        "kept apart from chat A; round-robin's next turn is chat B's engine"
    sent.append(gevent.spawn(post, px, "chat", "chat C"))
    eventually(lambda: "chat C" in where_each_went(servers), what="chat C sent")
    assert where_each_went(servers)["chat C"] == went["chat A"], "behind the older prompt"
    assert [g.get(timeout=30).status_code for g in sent] == [200] * 4
