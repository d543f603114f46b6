"""Engine load signals (docs/behaviour.md#routing-policies): vLLM's scheduler gauges parsed from
a /metrics page, and the load routing makes of a read and this worker's calls since."""

from __future__ import annotations

import pytest

from epd_flask.control.roster import Instance, Roster, Settings
from epd_flask.fleet import routing
from epd_flask.fleet.enginemetrics import EngineLoad, MetricsError, parse
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.loadboard import LoadBoard
from epd_flask.fleet.registry import Registry

#: As vLLM 0.32 writes it (prometheus_client), two engines (data-parallel ranks), with the
#: gauges' neighbours that share a prefix.
PAGE = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.25
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 12345.0
"""


def test_the_queue_is_summed_over_engines_and_neighbours_are_ignored() -> None:
    load = parse(PAGE)
    assert load == EngineLoad(waiting=2, running=4, kv_usage=0.375)
    assert load.queue == 6


def test_samples_without_labels_or_with_timestamps_are_read() -> None:
    page = b"vllm:num_requests_waiting 4 1700000000000\nvllm:num_requests_running 1\n"
    assert parse(page) == EngineLoad(waiting=4, running=1, kv_usage=None)


@pytest.mark.parametrize("page", [
    b"",
    b"<html>not metrics</html>",
    b"vllm:num_requests_running 1\n",  # no waiting gauge
    b"vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n",
])
def test_a_page_without_a_readable_queue_is_an_error(page: bytes) -> None:
    with pytest.raises(MetricsError):
        parse(page)


URLS = ("http://p1:1", "http://p2:1")


def _router(board: LoadBoard | None = None) -> tuple[routing.Router, LiveFleet]:
    """A worker's router; ``board``: the load board it shares with its host's others."""
    roster = Roster(settings=Settings(probe_interval=1.0, engine_metrics_interval=1.0),
                    instances=tuple(Instance(role="prefill", url=u) for u in URLS))
    live = LiveFleet(roster, 0, Registry(roster.instances, board=board))
    return routing.Router(live, seed=0), live


def test_without_a_read_the_load_is_this_worker_calls() -> None:
    router, live = _router()
    live.registry.track(URLS[0], +1, tokens=100)
    load = router.load("decode")
    assert load.calls(Instance(role="prefill", url=URLS[0])) == 1
    assert load.calls(Instance(role="prefill", url=URLS[1])) == 0


def test_a_read_counts_every_host_and_this_worker_calls_since() -> None:
    router, live = _router()
    registry = live.registry
    one = Instance(role="prefill", url=URLS[0])
    registry.track(URLS[0], +1, tokens=100)  # this worker: 1 call open at the read
    registry.record_engine(URLS[0], EngineLoad(waiting=4, running=1))
    assert router.load("decode").calls(one) == 5
    registry.track(URLS[0], +1, tokens=100)  # one more since: the engine will hold it too
    assert router.load("decode").calls(one) == 6
    registry.track(URLS[0], -1, tokens=100)
    registry.track(URLS[0], -1, tokens=100)  # both done: the engine no longer holds them
    assert router.load("decode").calls(one) == 4
    # Prefill weighs tokens: this worker's calls by theirs, the other hosts' 4 by the mean.
    registry.track(URLS[0], +1, tokens=300)
    mean = registry.mean_tokens
    assert 0 < mean < 300
    assert router.load("prefill").measure(one) == 1 + 300 + round(4 * (1 + mean))


def test_the_workers_of_one_host_see_each_other_calls_at_once(tmp_path) -> None:
    boards = [LoadBoard(tmp_path), LoadBoard(tmp_path)]
    for board in boards:
        board.start()
    try:
        (one_router, one), (two_router, two) = _router(boards[0]), _router(boards[1])
        a, b = (Instance(role="prefill", url=u) for u in URLS[:2])
        one.registry.track(URLS[0], +1, tokens=5000)
        # Worker two has opened nothing yet, and no engine was read: it sees worker one's call
        # and its tokens, and sends a prompt elsewhere.
        assert two_router.load("decode").calls(a) == 1
        assert two_router.load("prefill").measure(a) == 1 + 5000
        assert two_router.load("prefill").measure(b) == 0
        two.registry.track(URLS[0], +1, tokens=300)
        # A read now holds both calls: neither worker counts them twice, nor an other host's.
        for registry in (one.registry, two.registry):
            registry.record_engine(URLS[0], EngineLoad(waiting=1, running=1))
        for router in (one_router, two_router):
            assert router.load("decode").calls(a) == 2
            assert router.load("prefill").measure(a) == 2 + 5300
        one.registry.track(URLS[0], -1, tokens=5000)  # done: gone from both views
        assert two_router.load("decode").calls(a) == 1
        assert two_router.load("prefill").measure(a) == 1 + 300
    finally:
        for board in boards:
            board.stop()


def test_a_call_that_outlives_its_instance_in_the_roster_leaves_no_count(tmp_path) -> None:
    board = LoadBoard(tmp_path)
    board.start()
    try:
        router, live = _router(board)
        a = Instance(role="prefill", url=URLS[0])
        live.registry.track(URLS[0], +1, tokens=400)
        live.registry.replace([Instance(role="prefill", url=URLS[1])])  # dropped meanwhile
        live.registry.track(URLS[0], -1, tokens=400)
        live.registry.replace([Instance(role="prefill", url=u) for u in URLS])  # listed again
        assert live.registry.host(URLS[0]) == (0, 0)
        assert router.load("prefill").measure(a) == 0
    finally:
        board.stop()


def test_a_read_older_than_three_intervals_no_longer_counts() -> None:
    router, live = _router()
    one = Instance(role="prefill", url=URLS[0])
    live.registry.record_engine(URLS[0], EngineLoad(waiting=7, running=1), now=0.0)
    state = live.registry.get(URLS[0])
    assert state is not None
    assert state.queue(now=2.9, max_age=3.0, calls=0) == 8
    assert state.queue(now=3.1, max_age=3.0, calls=0) == 0
    assert router.load("decode").calls(one) == 0  # read "at 0.0" of the monotonic clock


def test_a_failed_read_keeps_the_last_values_and_warns_once(caplog) -> None:
    _, live = _router()
    registry = live.registry
    registry.record_engine(URLS[0], EngineLoad(waiting=2, running=2))
    with caplog.at_level("INFO", logger="epd_flask.fleet.registry"):
        for _ in range(3):
            registry.record_engine_failure(URLS[0], "/metrics answered 500")
        registry.record_engine(URLS[0], EngineLoad(waiting=0, running=1))
        registry.record_engine_failure(URLS[0], "timed out")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "/metrics answered 500" in warnings[0]
    assert any("read again" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
    state = registry.get(URLS[0])
    assert state is not None and state.engine == EngineLoad(waiting=0, running=1)
