"""Engine load signals through real HTTP (docs/behaviour.md#routing-policies): the prober reads
each instance's /metrics, so a proxy sees the queue another proxy (another host) built on an
instance and sends its own requests elsewhere; a worker sees its host's other workers' calls
at once, without a read, and with a shared load store another host's, each call claimed at
once; a read that fails keeps the last values and is logged once."""

from __future__ import annotations

import logging
from typing import Any

import gevent
import requests

from epd_flask.fleet import loadshare
from epd_flask.upstream import redisclient
from epd_flask.web.services import services
from tests.bodies import completion
from tests.fakes import response
from tests.helpers import eventually, sample, scrape
from tests.rosters import roster

#: ~1,000 tokens: 0.5 s of prefill at 2,000 tokens/s.
LONG = "word " * 800
FAST_PROBES = {"probe_interval": 0.1, "engine_metrics_interval": 0.1}


def _post(url: str, prompt: str) -> requests.Response:
    return requests.post(url + "/v1/completions", timeout=30,
                         json=completion(prompt, max_tokens=1))


def test_a_queue_another_host_built_is_seen_and_avoided(sim, proxy) -> None:
    slow = {"prefill_tokens_per_s": 2000.0, "max_model_len": 4096}
    busy, idle, d = sim("prefill", **slow), sim("prefill", **slow), sim("decode", **slow)
    # Host A knows only `busy`; host B both, routing its prefills to the less loaded.
    host_a = proxy(roster([busy], [d], **FAST_PROBES), probes=True)
    host_b = proxy(roster([busy, idle], [d], routing={"prefill": "least_loaded"},
                          **FAST_PROBES), probes=True)
    sent = [gevent.spawn(_post, host_a.url, f"{i} {LONG}") for i in range(4)]
    eventually(lambda: busy.state.engine_gauges()[1] >= 2, what="host A's prefills queued")
    b_registry = services(host_b.app).live.registry
    eventually(lambda: (s := b_registry.get(busy.url)) is not None and s.engine is not None
               and s.engine.queue >= 3, what="host B read the queue on `busy`")
    for i in range(3):
        r = _post(host_b.url, f"b{i} short")
        assert r.status_code == 200, r.text
    assert idle.state.stats()["completions"] == 3  # none joined the queue host A built
    gevent.joinall(sent, timeout=30)
    assert all(g.value.status_code == 200 for g in sent)


def test_without_engine_reads_another_host_queue_is_invisible(sim, proxy) -> None:
    slow = {"prefill_tokens_per_s": 2000.0, "max_model_len": 4096}
    busy, idle, d = sim("prefill", **slow), sim("prefill", **slow), sim("decode", **slow)
    host_a = proxy(roster([busy], [d], probe_interval=0.1), probes=True)
    host_b = proxy(roster([busy, idle], [d], routing={"prefill": "least_loaded"},
                          probe_interval=0.1, engine_metrics_interval=0), probes=True)
    sent = [gevent.spawn(_post, host_a.url, f"{i} {LONG}") for i in range(4)]
    eventually(lambda: busy.state.engine_gauges()[1] >= 2, what="host A's prefills queued")
    for i in range(6):
        assert _post(host_b.url, f"b{i} short").status_code == 200
    # Equal loads as host B counts them: a coin toss each time, so some joined the queue.
    assert busy.state.stats()["completions"] > 4
    gevent.joinall(sent, timeout=30)
    registry = services(host_b.app).live.registry
    assert registry.get(busy.url).engine is None  # never read


def test_a_sibling_worker_calls_are_seen_at_once_without_a_read(sim, proxy, tmp_path) -> None:
    slow = {"prefill_tokens_per_s": 2000.0, "max_model_len": 4096}
    busy, idle, d = sim("prefill", **slow), sim("prefill", **slow), sim("decode", **slow)
    # Two workers of one host (one state directory), neither reading any engine: worker A
    # knows only `busy`; worker B both, routing its prefills to the less loaded.
    worker_a = proxy(roster([busy], [d], probe_interval=0.1, engine_metrics_interval=0),
                     probes=True, state_dir=str(tmp_path))
    worker_b = proxy(roster([busy, idle], [d], routing={"prefill": "least_loaded"},
                            probe_interval=0.1, engine_metrics_interval=0),
                     probes=True, state_dir=str(tmp_path))
    sent = [gevent.spawn(_post, worker_a.url, f"{i} {LONG}") for i in range(4)]
    eventually(lambda: busy.state.engine_gauges()[1] >= 2, what="worker A's prefills queued")
    for i in range(6):
        assert _post(worker_b.url, f"b{i} short").status_code == 200
    # Against the coin tosses of the test above: worker A's open calls weigh on `busy`.
    assert idle.state.stats()["completions"] == 6
    gevent.joinall(sent, timeout=30)
    assert all(g.value.status_code == 200 for g in sent)
    assert services(worker_b.app).live.registry.get(busy.url).engine is None  # never read


def _two_hosts(sim, proxy, tmp_path,
               store: str) -> tuple[Any, Any, Any, dict[str, Any], Any, Any]:
    """Two hosts (two state directories) sharing the load store at ``store``, neither reading
    any engine: host A knows only `busy`, host B `busy` and `idle` and routes its prefills to
    the less loaded. Returns the sims, the roster settings they share and the two proxies."""
    slow = {"prefill_tokens_per_s": 2000.0, "max_model_len": 4096}
    busy, idle, d = sim("prefill", **slow), sim("prefill", **slow), sim("decode", **slow)
    shared = {"probe_interval": 0.1, "engine_metrics_interval": 0, "load_store": store}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    host_a = proxy(roster([busy], [d], **shared), probes=True, state_dir=str(tmp_path / "a"))
    host_b = proxy(roster([busy, idle], [d], routing={"prefill": "least_loaded"}, **shared),
                   probes=True, state_dir=str(tmp_path / "b"))
    return busy, idle, d, shared, host_a, host_b


def test_another_host_calls_are_seen_through_the_load_store_and_redis_down_routes_on(
        sim, proxy, tmp_path, redis_server, caplog) -> None:
    """Two hosts (two state directories) sharing ``load_store``, neither reading any engine:
    host B sees host A's open calls on `busy` in its snapshot and sends its own elsewhere;
    with Redis stopped, B routes on without it (docs/behaviour.md#routing-policies 2). Host B
    has two workers: one talks to Redis, the other reads its snapshot."""
    busy, idle, d, shared, host_a, host_b = _two_hosts(sim, proxy, tmp_path, redis_server.url)
    sibling = proxy(roster([busy, idle], [d], **shared), probes=True,
                    state_dir=str(tmp_path / "b"))
    share_b = services(host_b.app).live.registry.share
    share_b2 = services(sibling.app).live.registry.share
    share_a = services(host_a.app).live.registry.share
    assert share_a is not None and share_b is not None and share_b.host != share_a.host
    assert share_b2 is not None and share_b2.host == share_b.host
    eventually(lambda: share_b.leading != share_b2.leading, what="one of host B's workers "
               "exchanging")
    sent = [gevent.spawn(_post, host_a.url, f"{i} {LONG}") for i in range(4)]
    eventually(lambda: busy.state.engine_gauges()[1] >= 2, what="host A's prefills queued")
    eventually(lambda: share_b.counts(busy.url)[0] >= 2, what="host B heard host A's calls")
    assert share_b2.counts(busy.url) == share_b.counts(busy.url)
    asker = redisclient.connect(redis_server.url)
    clients = asker.client_list()
    asker.close()
    # One subscription to the other hosts' claims per host: its exchanging worker's, not
    # host B's other worker's (which reads the snapshot; tests/unit/test_loadshare.py).
    assert sum(c["sub"] != "0" for c in clients) == 2
    assert share_b.counts(busy.url)[1] > 1000  # with their estimated prompt tokens
    assert share_b.counts(idle.url) == (0, 0)
    for i in range(6):
        assert _post(host_b.url, f"b{i} short").status_code == 200
    # Against the coin tosses without a store: host A's open calls weigh on `busy`.
    assert idle.state.stats()["completions"] == 6
    assert sample(scrape(host_b.url), "epd_load_store_up") == 1
    gevent.joinall(sent, timeout=30)
    assert all(g.value.status_code == 200 for g in sent)

    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.loadshare"):
        eventually(lambda: not (share_a.up or share_b.up or share_b2.up),
                   what="every host's exchange failed")
        answers = [_post(host_b.url, f"c{i} short") for i in range(4)]
    assert all(a.status_code == 200 for a in answers)
    assert share_b.counts(busy.url) == (0, 0)
    assert sample(scrape(host_b.url), "epd_load_store_up") == 0
    warnings = [r for r in caplog.records if "does not answer" in r.getMessage()
                and r.name == "epd_flask.fleet.loadshare"]
    assert len(warnings) == 2, "one per host, not one per worker, exchange or request"


def test_a_call_another_host_just_opened_counts_before_the_hosts_exchange_again(
        sim, proxy, tmp_path, redis_server, monkeypatch) -> None:
    """Between two exchanges of the load store (here one at start and none after) a host still
    hears of each call another host opens, claimed on the store at once
    (docs/behaviour.md#routing-policies 2): host B sends its prompts away from the prefill
    host A just sent one to, with no engine read and no exchange since."""
    monkeypatch.setattr(loadshare, "INTERVAL", 600.0)
    monkeypatch.setattr(loadshare, "STALE", 600.0)
    monkeypatch.setattr(loadshare, "CLAIM_SECONDS", 600.0)
    busy, idle, _, _, host_a, host_b = _two_hosts(sim, proxy, tmp_path, redis_server.url)
    share_b = services(host_b.app).live.registry.share
    assert share_b is not None
    asker = redisclient.connect(redis_server.url)
    try:
        eventually(lambda: asker.pubsub_numsub(loadshare.CLAIMS)[0][1] == 2,
                   what="each host listening for the other's claims")
    finally:
        asker.close()
    sent = gevent.spawn(_post, host_a.url, f"a {LONG}")
    eventually(lambda: share_b.counts(busy.url)[0] == 1, what="host B heard host A's call")
    assert share_b.counts(busy.url)[1] > 500  # with its estimated prompt tokens
    for i in range(8):
        assert _post(host_b.url, f"b{i} short").status_code == 200
    # Against eight coin tosses without the claim: host A's call weighs on `busy`.
    assert idle.state.stats()["completions"] == 8
    assert sent.get(timeout=30).status_code == 200


def test_a_failing_metrics_page_keeps_the_last_values_and_warns_once(fake, sim, proxy,
                                                                      caplog) -> None:
    answers = {"metrics": response(body=b"vllm:num_requests_waiting 3\n"
                                        b"vllm:num_requests_running 2\n",
                                   content_type="text/plain")}

    def handler(conn, request: bytes) -> None:
        path = request.split(b" ", 2)[1]
        if path == b"/metrics":
            conn.sendall(answers["metrics"])
        else:  # /health, /v1/models
            conn.sendall(response(body=b'{"object":"list","data":[]}'))

    upstream = fake(handler)
    d = sim("decode")
    px = proxy(roster([upstream.url], [d], **FAST_PROBES), probes=True)
    registry = services(px.app).live.registry
    eventually(lambda: registry.get(upstream.url).engine is not None, what="a first read")
    with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.registry"):
        answers["metrics"] = response("500 Internal Server Error", b"{}")
        reads = len(upstream.requests)
        eventually(lambda: len(upstream.requests) > reads + 12, what="several failed reads")
    warnings = [r.getMessage() for r in caplog.records if "engine's queue" in r.getMessage()]
    assert len(warnings) == 1 and "answered 500" in warnings[0], warnings
    state = registry.get(upstream.url)
    assert state.engine.queue == 5 and state.live  # kept, and not a health failure
