"""The simulator's batch (epd_flask/sim/batch.py): ``max_num_seqs`` requests run at once, the
others wait in vLLM's order (first come, or by ``priority``), and ``/metrics`` counts both as
vLLM does."""

from __future__ import annotations

import re
from typing import Any

import gevent
import requests

from tests.bodies import chat
from tests.helpers import RawStream, eventually


def gauges(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=5).text
    return {m[0]: float(m[1]) for m in
            re.findall(r'^(vllm:num_requests_\w+)\{[^}]*\} (\S+)$', text, re.M)}


def ask(url: str, content: str, **fields: Any) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=20,
                         json=chat(content, **{"max_tokens": 1, **fields}))


def order(server: Any, *, policy: str) -> list[str]:
    """Hold the one place with a stream, queue three requests, let them run; the order they
    ran in (each answers when it ran)."""
    server.state.configure(max_num_seqs=1, scheduling_policy=policy)
    held = RawStream(server.url, "/v1/chat/completions",
                     chat("hold", stream=True, max_tokens=400))
    held.first_event()
    done: list[str] = []

    def one(name: str, priority: int) -> None:
        # Three tokens 50 ms apart: each holds the place for 100 ms, so they end in the order
        # they ran.
        assert ask(server.url, name, priority=priority, max_tokens=3).status_code == 200
        done.append(name)

    jobs = []
    for count, (name, priority) in enumerate([("first", 5), ("second", 0), ("third", -3)], 1):
        jobs.append(gevent.spawn(one, name, priority))
        eventually(lambda n=count: gauges(server.url).get("vllm:num_requests_waiting") == n,
                   what=f"{count} requests waiting")
    assert gauges(server.url) == {"vllm:num_requests_running": 1.0,
                                  "vllm:num_requests_waiting": 3.0}
    held.hang_up()
    gevent.joinall(jobs, raise_error=True, timeout=20)
    return done


def test_without_a_bound_every_request_runs_at_once(start_sim) -> None:
    server = start_sim(role="prefill_decode", token_delay=0.05, output_tokens=400)
    streams = [RawStream(server.url, "/v1/chat/completions",
                         chat(str(n), stream=True, max_tokens=400)) for n in range(3)]
    for stream in streams:
        stream.first_event()
    assert gauges(server.url) == {"vllm:num_requests_running": 3.0,
                                  "vllm:num_requests_waiting": 0.0}
    for stream in streams:
        stream.hang_up()


def test_waiting_requests_run_first_come_first_served(start_sim) -> None:
    server = start_sim(role="prefill_decode", token_delay=0.05, output_tokens=400)
    assert order(server, policy="fcfs") == ["first", "second", "third"]


def test_under_the_priority_policy_the_lowest_priority_runs_first(start_sim) -> None:
    server = start_sim(role="prefill_decode", token_delay=0.05, output_tokens=400)
    assert order(server, policy="priority") == ["third", "second", "first"]


def test_a_client_that_leaves_while_waiting_never_runs(start_sim) -> None:
    server = start_sim(role="prefill_decode", token_delay=0.05, output_tokens=400,
                       max_num_seqs=1)
    held = RawStream(server.url, "/v1/chat/completions", chat("hold", stream=True,
                                                                max_tokens=400))
    held.first_event()
    leaving = RawStream(server.url, "/v1/chat/completions", chat("leaving", max_tokens=1))
    eventually(lambda: gauges(server.url).get("vllm:num_requests_waiting") == 1,
               what="the request waiting")
    leaving.hang_up()
    eventually(lambda: gauges(server.url).get("vllm:num_requests_waiting") == 0,
               what="the departed request out of the queue")
    held.hang_up()
    assert ask(server.url, "after").status_code == 200
    assert server.state.stats()["requests_aborted"] == 1
    assert gauges(server.url) == {"vllm:num_requests_running": 0.0,
                                  "vllm:num_requests_waiting": 0.0}


def computed(server: Any) -> list[str]:
    """Queue three prompts of priority 1 for the engine's prefill, then one of -1; the order
    they answered in (one token each: they answer when their prefill is done)."""
    done: list[str] = []

    def one(name: str, priority: int) -> None:
        assert ask(server.url, name + " " + "word " * 400, priority=priority) \
            .status_code == 200
        done.append(name)

    jobs = []
    for n in range(3):  # ~500 tokens each: ~0.25 s of prefill apiece
        jobs.append(gevent.spawn(one, str(n), 1))
        eventually(lambda n=n: gauges(server.url).get("vllm:num_requests_waiting") == n,
                   what=f"{n} prefills queued behind the first")
    jobs.append(gevent.spawn(one, "urgent", -1))
    eventually(lambda: gauges(server.url).get("vllm:num_requests_waiting") == 3,
               what="the urgent prompt queued")
    gevent.joinall(jobs, raise_error=True, timeout=20)
    return done


def test_under_the_priority_policy_an_urgent_prompt_is_computed_before_waiting_ones(
        start_sim) -> None:
    """With the cost model, prompts queue for the engine's prefill: an urgent one sent last
    answers right after the one computing, before the less urgent ones queued before it;
    first come, first served under ``fcfs``."""
    for policy, expected in (("priority", ["0", "urgent", "1", "2"]),
                             ("fcfs", ["0", "1", "2", "urgent"])):
        server = start_sim(role="prefill_decode", prefill_tokens_per_s=2000.0,
                           max_model_len=4096, scheduling_policy=policy)
        assert computed(server) == expected, policy
