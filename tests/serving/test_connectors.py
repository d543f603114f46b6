"""Each KV connector through real HTTP against the simulated fleet, in process."""

from __future__ import annotations

import json
import re
import time

import gevent
import pytest
import requests

from epd_flask.sim import SimConfig, SimServer
from tests.bodies import chat, completion, completion_stream
from tests.helpers import RawStream, eventually, free_port
from tests.rosters import roster

CHAT = chat(max_tokens=8, temperature=0)
# Long enough for several 16-token prefix-cache blocks in the simulated prefill.
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 12


def sse_events(resp: requests.Response) -> list[str]:
    text = resp.content.decode("utf-8")
    return [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]



def mooncake_roster(prefills, decodes, **settings) -> dict:
    return roster([(p, {"bootstrap_url": p.bootstrap_url}) for p in prefills], decodes,
                  connector="mooncake", **settings)


def ready(px) -> bool:
    return requests.get(px.url + "/ready", timeout=5).status_code == 200


@pytest.fixture
def mooncake(sim, proxy):
    """A started Mooncake fleet: ``mooncake(prefill_knobs, decode_knobs, **settings)``."""

    def start(p_knobs: dict | None = None, d_knobs: dict | None = None, **settings):
        p = sim("prefill", bootstrap_port=0, **(p_knobs or {}))
        d = sim("decode", **(d_knobs or {}))
        px = proxy(mooncake_roster([p], [d], **settings), probes=True)
        assert eventually(lambda: ready(px))
        return p, d, px

    return start


# -- Mooncake -------------------------------------------------------------------------------


def test_mooncake_readiness_is_503_until_every_prefill_is_discovered(sim, proxy) -> None:
    p1, p2 = sim("prefill", bootstrap_port=0), sim("prefill", bootstrap_port=0)
    d = sim("decode")
    px = proxy(mooncake_roster([p1, p2], [d]))  # services not started: nothing discovered
    px.services.prober.probe_all()  # every instance answered; the bootstraps are unknown
    r = requests.get(px.url + "/ready", timeout=5)
    assert r.status_code == 503 and "Mooncake bootstrap" in r.json()["reason"]
    early = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=5)
    assert early.status_code == 503 and early.json()["error"]["code"] == "no_backend"
    assert d.state.stats()["completions"] == 0
    discovery = px.services.discovery
    discovery.refresh(px.services.registry.get(p1.url).instance)
    assert requests.get(px.url + "/ready", timeout=5).status_code == 503  # p2 still unknown
    px.services.start()
    assert eventually(lambda: ready(px))
    health = requests.get(px.url + "/health", timeout=5).json()
    assert health["bootstrap"] == {"prefills": 2, "engines": 2, "stale": 0}
    assert p2.url not in json.dumps(health)  # counts, never URLs (nginx publishes /health)
    assert discovery.snapshot()[p2.url]["engine_ids"] == [p2.state.engine_id]


@pytest.mark.parametrize("stream", [False, True])
def test_mooncake_round_robins_ranks_and_legs_share_one_transfer(mooncake, stream) -> None:
    p, d, px = mooncake({"dp_size": 2})
    seen = []
    for i in range(4):
        body = {**CHAT, "stream": stream}
        r = requests.post(px.url + "/v1/chat/completions", json=body, timeout=10,
                          headers={"X-Request-Id": f"req-{i}"})
        assert r.status_code == 200, r.text
        if stream:
            assert sse_events(r)[-1] == "[DONE]"
        else:
            assert r.json()["choices"][0]["message"]["content"]
        assert r.headers["X-Request-Id"] == f"req-{i}"
        pre, dec = p.state.requests(1)[0], d.state.requests(1)[0]
        upstream_id = pre["headers"]["x-request-id"]
        assert dec["headers"]["x-request-id"] == upstream_id != f"req-{i}"
        assert pre["body"]["kv_transfer_params"]["transfer_id"] == f"xfer-{upstream_id}"
        params = dec["body"]["kv_transfer_params"]
        assert params["transfer_id"] == f"xfer-{upstream_id}"
        assert params["remote_bootstrap_addr"] == p.bootstrap_url
        rank = int(pre["headers"]["x-data-parallel-rank"])
        assert params["remote_engine_id"] == p.state.rank_engine_ids[rank]
        seen.append(rank)
    assert seen == [0, 1, 0, 1]
    stats = d.state.stats()
    assert stats["kv_handles_mooncake"] == 4 and stats["kv_handles_invalid"] == 0


def test_mooncake_first_token_waits_for_the_slower_leg_not_both(mooncake) -> None:
    delay = 0.4
    p, d, px = mooncake({"ttft": delay}, {"ttft": delay})
    both_in_flight = []

    def watch() -> None:
        while True:
            if p.state.stats()["in_flight"] and d.state.stats()["in_flight"]:
                both_in_flight.append(time.monotonic())
            gevent.sleep(0.01)

    watcher = gevent.spawn(watch)
    started = time.monotonic()
    with requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                       stream=True, timeout=10) as r:
        first = next(line for line in r.iter_lines() if line.startswith(b"data: "))
        ttft = time.monotonic() - started
        assert json.loads(first[6:])["choices"]
    watcher.kill()
    print(f"\nmooncake TTFT {ttft * 1000:.0f} ms with prefill {delay * 1000:.0f} ms and decode "
          f"{delay * 1000:.0f} ms; both legs seen in flight {len(both_in_flight)} times")
    assert both_in_flight
    assert delay <= ttft < 2 * delay


def test_mooncake_prefill_restarted_with_new_engine_ids_is_rediscovered(sim, proxy) -> None:
    port, bport = free_port(), free_port()
    p = sim("prefill", port=port, bootstrap_port=bport)
    d = sim("decode")
    px = proxy(mooncake_roster([p], [d], probe_interval=0.2, fail_threshold=1), probes=True)
    assert eventually(lambda: ready(px))
    assert requests.post(px.url + "/v1/completions", json={**CHAT, "prompt": "a"}, timeout=10).ok
    old_engine = p.state.engine_id
    p.stop()
    restarted = SimServer(SimConfig(role="prefill", port=port, bootstrap_port=bport)).start()
    try:
        assert restarted.state.engine_id != old_engine

        def rediscovered() -> bool:
            doc = px.services.discovery.snapshot()
            return doc[p.url]["engine_ids"] == [restarted.state.engine_id]

        assert eventually(rediscovered)
        r = requests.post(px.url + "/v1/completions", json={**CHAT, "prompt": "b"}, timeout=10)
        assert r.status_code == 200
        sent = d.state.requests(1)[0]["body"]["kv_transfer_params"]["remote_engine_id"]
        assert sent == restarted.state.engine_id
        assert d.state.stats()["kv_handles_mooncake"] == 2
        assert d.state.stats()["kv_handles_invalid"] == 0
    finally:
        restarted.stop()


def test_mooncake_failed_prefill_closes_decode_and_is_retried(mooncake) -> None:
    p, d, px = mooncake(d_knobs={"kv_timeout": 5.0}, decode_retries=1)
    p.state.inject(fail_next=1)
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200, r.text
    assert eventually(lambda: d.state.stats()["requests_aborted"] == 1)
    stats = d.state.stats()
    assert stats["kv_handles_mooncake"] == 1 and stats["kv_transfers_timed_out"] == 0
    ids = [e["body"]["kv_transfer_params"]["transfer_id"] for e in d.state.requests()]
    assert ids[0] != ids[1] and ids[1].endswith("-retry1")
    assert px.services.pipeline.counters["prefill_failures"] == 1


def test_mooncake_failed_prefill_without_retries_fails_fast(mooncake) -> None:
    kv_timeout = 5.0
    p, d, px = mooncake(d_knobs={"kv_timeout": kv_timeout}, decode_retries=0)
    p.state.inject(fail_next=1, fail_status=503)
    started = time.monotonic()
    r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=10)
    elapsed = time.monotonic() - started
    assert r.status_code == 503 and set(r.json()["error"]) >= {"message", "type", "code"}
    assert elapsed < kv_timeout  # nobody waited for KV that was never coming
    assert eventually(lambda: d.state.stats()["requests_aborted"] == 1)


def test_mooncake_decode_failing_first_closes_prefill(mooncake) -> None:
    prefill_delay = 3.0
    p, d, px = mooncake({"ttft": prefill_delay}, decode_retries=0)
    d.state.inject(fail_next=1)
    started = time.monotonic()
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 500
    assert time.monotonic() - started < prefill_delay
    assert eventually(lambda: p.state.stats()["requests_aborted"] == 1)


def test_mooncake_decode_timeout_is_a_clean_error(mooncake) -> None:
    p, d, px = mooncake({"ttft": 3.0}, decode_timeout=0.5, decode_retries=0)
    r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert eventually(lambda: p.state.stats()["requests_aborted"] == 1)
    # decode stops waiting too (the proxy hung up, or the prefill it waited on was aborted)
    assert eventually(lambda: d.state.stats()["in_flight"] == 0)
    assert d.state.stats()["streams_started"] == 0


def test_mooncake_client_leaving_mid_stream_closes_decode(mooncake) -> None:
    p, d, px = mooncake(d_knobs={"token_delay": 0.05, "output_tokens": 200})
    client = RawStream(px.url, "/v1/chat/completions", {**CHAT, "max_tokens": 200,
                                                        "stream": True})
    client.first_event()
    client.hang_up()
    assert eventually(lambda: d.state.stats()["streams_aborted"] == 1)
    assert d.state.stats()["streams_completed"] == 0
    assert p.state.stats()["in_flight"] == 0


# -- P2P NCCL -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_p2p_nccl_request_id_names_the_pair_and_prefill_runs_first(sim, proxy, stream) -> None:
    p, d = sim("prefill", ttft=0.05), sim("decode")
    px = proxy(roster([(p, {"kv_zmq_addr": "127.0.0.1:21001"})],
                      [(d, {"kv_zmq_addr": "127.0.0.1:22001"})], connector="p2p_nccl"))
    r = requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                      headers={"X-Request-Id": "client-1"}, timeout=10)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "client-1"
    pre, dec = p.state.requests(1)[0], d.state.requests(1)[0]
    rid = pre["headers"]["x-request-id"]
    assert re.fullmatch(r"___prefill_addr_127\.0\.0\.1:21001___decode_addr_127\.0\.0\.1:22001_"
                        r"[0-9a-f]{32}", rid)
    assert dec["headers"]["x-request-id"] == rid
    assert "kv_transfer_params" not in pre["body"] and "kv_transfer_params" not in dec["body"]
    assert pre["body"]["max_tokens"] == 1 and dec["body"]["max_tokens"] == 8
    assert pre["time"] + 0.05 <= dec["time"]  # decode opened only after prefill answered


def test_p2p_nccl_roster_needs_kv_addresses(proxy, sim) -> None:
    from epd_flask.control.roster import RosterError, parse

    p, d = sim("prefill"), sim("decode")
    with pytest.raises(RosterError, match="kv_zmq_addr"):
        parse({"settings": {"connector": "p2p_nccl"}, "instances": [
            {"role": "prefill", "url": p.url, "kv_zmq_addr": "h:1"},
            {"role": "decode", "url": d.url}]})
    with pytest.raises(RosterError, match="bootstrap_url"):
        parse({"settings": {"connector": "mooncake"}, "instances": [
            {"role": "prefill", "url": p.url}, {"role": "decode", "url": d.url}]})


# -- usage: prefill's prefix-cache hits reach the client ------------------------------------


@pytest.mark.parametrize("connector", ["nixl", "none"])
@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_prefill_prefix_cache_hits(sim, proxy, connector, stream) -> None:
    # vLLM reports prefix-cache hits in usage only with --enable-prompt-tokens-details.
    p, d = sim("prefill", prompt_tokens_details=True), sim("decode", prompt_tokens_details=True)
    px = proxy(roster([p], [d], connector=connector))
    body = completion_stream(LONG_PROMPT, max_tokens=4, stream_options={"include_usage": True}) \
        if stream else completion(LONG_PROMPT, max_tokens=4)

    def usage_of(r: requests.Response) -> dict:
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["usage"]
        chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
        assert sum("usage" in c for c in chunks) == 1
        return chunks[-1]["usage"]

    cold = usage_of(requests.post(px.url + "/v1/completions", json=body, timeout=10))
    assert not (cold.get("prompt_tokens_details") or {}).get("cached_tokens")
    warm = usage_of(requests.post(px.url + "/v1/completions", json=body, timeout=10))
    prefill_saw = p.state.stats()["prefix_cached_tokens"]
    assert prefill_saw > 0
    assert warm["prompt_tokens_details"]["cached_tokens"] == prefill_saw
    assert warm["completion_tokens"] == 4 and warm["prompt_tokens"] == cold["prompt_tokens"]
    direct = requests.post(d.url + "/v1/completions", json=body, timeout=10)
    assert not (usage_of(direct).get("prompt_tokens_details") or {}).get("cached_tokens")


@pytest.mark.parametrize("spelling", ["false", "0", "no", 0])
def test_stream_is_read_as_vllm_reads_it(sim, proxy, spelling) -> None:
    """``"stream": "false"`` is False to vLLM, so decode answers one JSON body: the proxy
    treats it as one too (reads it whole and writes prefill's cache hits into its usage)
    rather than relaying it as a stream because the string is truthy."""
    p, d = sim("prefill", prompt_tokens_details=True), sim("decode", prompt_tokens_details=True)
    px = proxy(roster([p], [d], connector="none"))
    body = completion(LONG_PROMPT, max_tokens=4, stream=spelling)
    for _ in range(2):
        r = requests.post(px.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    assert d.state.requests(1)[0]["body"]["stream"] == spelling
    assert p.state.stats()["prefix_cached_tokens"] > 0
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        p.state.stats()["prefix_cached_tokens"]


# -- prefill-failure policy and the backend key ---------------------------------------------


def test_prefill_failure_recompute_lets_decode_serve_alone(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], prefill_failure="recompute", decode_retries=0))
    p.state.inject(fail_next=1)
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert d.state.stats()["kv_handles_absent"] == 1
    assert px.services.pipeline.counters["prefill_recomputed"] == 1
    p.state.inject(fail_next=1, fail_status=400)  # the request's own fault: never recomputed
    bad = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert bad.status_code == 400 and d.state.stats()["completions"] == 1


def test_prefill_failure_fail_is_the_default(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], decode_retries=0))
    p.state.inject(fail_next=1)
    r = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 500 and d.state.stats()["completions"] == 0


@pytest.mark.parametrize("spelling", ["Authorization", "authorization", "AUTHORIZATION"])
def test_backend_key_replaces_the_clients_bearer_on_every_leg(sim, proxy, spelling) -> None:
    p, d = sim("prefill"), sim("decode")
    doc = roster([p], [d])
    keyed = proxy(doc, backend_api_key="sk-fleet")
    requests.post(keyed.url + "/v1/chat/completions", json=CHAT, timeout=10,
                  headers={spelling: "Bearer sk-client"})
    for server in (p, d):
        assert server.state.requests(1)[0]["headers"]["authorization"] == "Bearer sk-fleet"
    plain = proxy(doc)
    requests.post(plain.url + "/v1/chat/completions", json=CHAT, timeout=10,
                  headers={spelling: "Bearer sk-client"})
    for server in (p, d):
        assert server.state.requests(1)[0]["headers"]["authorization"] == "Bearer sk-client"


def conversation(px, turns: int) -> list[str]:
    """``turns`` turns of one chat conversation; each turn's request id."""
    messages = [{"role": "system", "content": LONG_PROMPT},
                {"role": "user", "content": "what is a fox?"}]
    ids = []
    for turn in range(turns):
        r = requests.post(px.url + "/v1/chat/completions", timeout=10,
                          json={**CHAT, "messages": messages},
                          headers={"X-Request-Id": f"turn-{turn}"})
        assert r.status_code == 200, r.text
        ids.append(r.headers["X-Request-Id"])
        messages = [*messages, r.json()["choices"][0]["message"],
                    {"role": "user", "content": f"and then {turn}?"}]
    return ids


@pytest.mark.parametrize("dp_size", [1, 2])
def test_mooncake_prefill_follows_the_routing_policy(sim, proxy, caplog, dp_size) -> None:
    """``routing: {prefill: prefix}`` keeps a conversation on one Mooncake prefill (and rank),
    where its earlier turns left their KV; each pair decision is in the request's log line."""
    ps = [sim("prefill", bootstrap_port=0, dp_size=dp_size) for _ in range(2)]
    d = sim("decode")
    px = proxy(mooncake_roster(ps, [d], routing={"prefill": "prefix"}), probes=True)
    assert eventually(lambda: ready(px))
    with caplog.at_level("INFO", logger="epd_flask.requests"):
        conversation(px, 4)
    served = [p.state.stats()["completions"] for p in ps]
    assert sorted(served) == [0, 4]
    home = ps[served.index(4)]
    assert home.state.stats()["prefix_cached_tokens"] > 0  # turns 2-4 met turn 1's KV
    ranks = {r["headers"]["x-data-parallel-rank"] for r in home.state.requests()
             if r["path"] == "/v1/chat/completions"}
    assert len(ranks) == 1
    assert [line.count("prefill:prefix(hit)") for line in caplog.messages
            if "request_id=turn-" in line] == [1, 1, 1, 1]


def test_mooncake_round_robin_still_alternates_prefills(sim, proxy) -> None:
    """The default policy spreads a conversation's turns: the contrast with the above."""
    ps = [sim("prefill", bootstrap_port=0) for _ in range(2)]
    d = sim("decode")
    px = proxy(mooncake_roster(ps, [d]), probes=True)
    assert eventually(lambda: ready(px))
    conversation(px, 4)
    assert [p.state.stats()["completions"] for p in ps] == [2, 2]
