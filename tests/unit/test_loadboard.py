"""The host's count of running requests per instance, summed over its workers' files, and
when an instance is full (docs/behaviour.md#admission)."""

from __future__ import annotations

import os
import subprocess
import sys

from epd_flask.control.roster import parse
from epd_flask.control.statedir import StateDir
from epd_flask.fleet import loadboard
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.loadboard import LoadBoard
from epd_flask.fleet.policies import RouteRequest, candidates_of
from epd_flask.fleet.routing import LiveInstances
from epd_flask.fleet.saturation import ENGINE_WAITING_FULL, Capacity

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def boards(tmp_path, n: int = 2) -> list[LoadBoard]:
    started = [LoadBoard(tmp_path) for _ in range(n)]
    for board in started:
        board.start()
    return started


def test_every_worker_sees_the_hosts_total(tmp_path) -> None:
    one, two = boards(tmp_path)
    try:
        one.add(A, 1)
        one.add(A, 1)
        two.add(A, 1)
        two.add(B, 1)
        assert (one.count(A), two.count(A), one.count(B)) == (3, 3, 1)
        one.add(A, -2)
        assert two.count(A) == 1 and one.own(A) == 0
    finally:
        one.stop()
        two.stop()
    assert not list(tmp_path.glob("load-*.bin")), "a stopped worker leaves no file"


def test_open_calls_and_their_tokens_are_counted_apart_from_running_requests(tmp_path) -> None:
    one, two = boards(tmp_path)
    try:
        one.add(A, 1, loadboard.CALLS)
        one.add(A, 700, loadboard.TOKENS)
        two.add(A, 1)  # admission's running request: a count of its own
        two.add(A, 1, loadboard.CALLS)
        two.add(A, 50, loadboard.TOKENS)
        one.add(A, 1500, loadboard.UNANSWERED[0])  # a high request's prompt, not answered
        one.add(A, 1, loadboard.UNANSWERED_CALLS[0])
        one.add(A, 9_000, loadboard.UNANSWERED_SINCE[0])  # routed at 9 s
        two.add(A, 1, loadboard.UNANSWERED_CALLS[0])
        two.add(A, 11_000, loadboard.UNANSWERED_SINCE[0])  # and one at 11 s
        assert one.counts(A) == two.counts(A) == (1, 2, 750, 1500, 0, 2, 0, 20_000, 0)
        assert two.count(A) == 1 and two.count(A, loadboard.CALLS) == 2
        one.add(A, -1, loadboard.CALLS)
        one.add(A, -700, loadboard.TOKENS)
        one.add(A, -1500, loadboard.UNANSWERED[0])
        one.add(A, -1, loadboard.UNANSWERED_CALLS[0])
        one.add(A, -9_000, loadboard.UNANSWERED_SINCE[0])
        assert two.counts(A) == (1, 1, 50, 0, 0, 1, 0, 11_000, 0)
        assert one.own(A, loadboard.TOKENS) == 0
    finally:
        one.stop()
        two.stop()


def test_a_worker_that_starts_after_a_first_read_counts_from_its_first_request(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loadboard, "REFRESH_SECONDS", 3600.0)  # only a change looks again
    monkeypatch.setattr(loadboard, "CHANGED_SECONDS", 0.0)
    one = LoadBoard(tmp_path)
    one.start()
    two = LoadBoard(tmp_path)
    try:
        assert one.count(A) == 0  # a first read, alone (routing's, at boot)
        two.start()
        two.add(A, 1)
        assert one.count(A) == 1
    finally:
        one.stop()
        two.stop()


def test_a_worker_that_died_stops_counting(tmp_path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    board = LoadBoard(tmp_path)
    board.start()
    try:
        board.add(A, 2)
        # A file a worker left with 2 running on A, and a live sibling's with the same.
        (tmp_path / f"load-{dead_pid}.bin").write_bytes(board._path.read_bytes())
        (tmp_path / f"load-{os.getppid()}.bin").write_bytes(board._path.read_bytes())
        assert board.count(A) == 4, "the dead worker's file is not summed, the live one's is"
        StateDir(tmp_path).forget_worker(dead_pid)  # what the master does when it reaps one
        assert not (tmp_path / f"load-{dead_pid}.bin").exists()
    finally:
        board.stop()


def test_a_full_file_is_laid_out_again_and_readers_follow(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loadboard, "SLOTS", 4)
    one, two = boards(tmp_path)
    try:
        for n in range(4):
            one.add(f"http://127.0.0.1:{9100 + n}", 1)
        assert two.count("http://127.0.0.1:9100") == 1
        for n in range(3):
            one.add(f"http://127.0.0.1:{9100 + n}", -1)
        one.add("http://127.0.0.1:9200", 5)  # no slot left: the idle ones are dropped
        assert two.count("http://127.0.0.1:9200") == 5
        assert two.count("http://127.0.0.1:9103") == 1
        assert two.count("http://127.0.0.1:9100") == 0
    finally:
        one.stop()
        two.stop()


def fleet(max_concurrency: int | None = 2) -> LiveFleet:
    extra = {} if max_concurrency is None else {"max_concurrency": max_concurrency}
    return LiveFleet(parse({"instances": [{"role": "prefill_decode", "url": A, **extra},
                                          {"role": "prefill_decode", "url": B, **extra}]}))


def test_room_is_the_free_places_less_the_requests_let_through() -> None:
    live = fleet()
    board = LoadBoard(None)
    capacity = Capacity(live, board)
    assert capacity.active and capacity.room("prefill_decode", None, reserved=3)
    board.add(A, 2)
    assert capacity.full(live.view.instances[0])
    assert capacity.room("prefill_decode", None, reserved=1)
    assert not capacity.room("prefill_decode", None, reserved=2)
    board.add(B, 2)
    assert not capacity.room("prefill_decode", None)


def test_an_engine_with_a_queue_is_full_whatever_its_bound() -> None:
    live = fleet(max_concurrency=None)
    waiting = {A: ENGINE_WAITING_FULL, B: ENGINE_WAITING_FULL - 1}
    capacity = Capacity(live, LoadBoard(None), waiting=lambda s: waiting[s.instance.url])
    assert [capacity.full(i) for i in live.view.instances] == [True, False]
    assert capacity.room("prefill_decode", None)
    waiting[B] += 1
    assert not capacity.room("prefill_decode", None)


def test_routing_prefers_instances_with_room() -> None:
    live = fleet()
    board = LoadBoard(None)
    capacity = Capacity(live, board)
    found = LiveInstances(live).candidates("prefill_decode", None, None)
    anyone = RouteRequest()
    assert [c.url for c in capacity.roomy("prefill_decode", anyone, found)] == [A, B]
    board.add(A, 2)
    assert [c.url for c in capacity.roomy("prefill_decode", anyone, found)] == [B]
    board.add(B, 2)  # every one full: all stay candidates (admission held the request back)
    assert len(capacity.roomy("prefill_decode", anyone, found)) == 2


def test_without_admission_nothing_is_filtered() -> None:
    live = LiveFleet(parse({"instances": [{"role": "prefill_decode", "url": A},
                                          {"role": "prefill_decode", "url": B}]}))
    capacity = Capacity(live, LoadBoard(None))
    assert not capacity.active
    found = LiveInstances(live).candidates("prefill_decode", None, None)
    assert candidates_of(live.view.instances) == capacity.roomy("prefill_decode",
                                                                RouteRequest(), found)


def test_a_request_that_leaves_a_reserve_routes_where_more_is_free() -> None:
    live = fleet(max_concurrency=3)
    board = LoadBoard(None)
    capacity = Capacity(live, board)
    found = LiveInstances(live).candidates("prefill_decode", None, None)
    board.add(A, 2)
    assert [c.url for c in capacity.roomy("prefill_decode", RouteRequest(keep=1), found)] == [B]
    assert capacity.room("prefill_decode", None, reserved=1, keep=1)  # B's 3 - 1 kept
    assert not capacity.room("prefill_decode", None, reserved=2, keep=1)
    assert capacity.room("prefill_decode", None, reserved=2)
    assert [c.url for c in capacity.roomy("prefill_decode", RouteRequest(), found)] == [A, B]


def unanswered(board: LoadBoard, url: str, tokens: int, routed_at_ms: int, rank: int = 0) -> None:
    board.add(url, tokens, loadboard.UNANSWERED[rank])
    board.add(url, 1, loadboard.UNANSWERED_CALLS[rank])
    board.add(url, routed_at_ms, loadboard.UNANSWERED_SINCE[rank])


def test_a_better_class_goes_where_its_prompts_ahead_are_fewest_then_oldest() -> None:
    """Rule 14: an engine with none of the class's prompts unanswered first; among engines
    with about as many (estimates within ``AS_MANY`` of the fewest), the one whose were
    routed earliest; clearly fewer tokens win whatever their age."""
    live = fleet(max_concurrency=8)
    board = LoadBoard(None)
    capacity = Capacity(live, board)
    found = LiveInstances(live).candidates("prefill_decode", None, None)
    high, normal = RouteRequest(rank=0), RouteRequest(rank=1)

    def chosen(request: RouteRequest) -> list[str]:
        return [c.url for c in capacity.roomy("prefill_decode", request, found)]
    unanswered(board, A, 1500, 10_000)
    assert chosen(high) == [B], "none ahead on B"
    unanswered(board, B, 1400, 10_050)  # a little fewer tokens, routed 50 ms later
    assert chosen(high) == [A], "about as many ahead: A has been at its prompt longer"
    unanswered(board, B, 1, 10_050, rank=1)  # a normal prompt does not hold a high one
    assert chosen(high) == [A]
    assert chosen(normal) == [A], "a normal request waits for both classes"
    unanswered(board, A, 1500, 10_060)  # now twice as many on A
    assert chosen(high) == [B]
    board.add(B, -1400, loadboard.UNANSWERED[0])
    board.add(B, -1, loadboard.UNANSWERED_CALLS[0])
    board.add(B, -10_050, loadboard.UNANSWERED_SINCE[0])  # B's high prompt answered
    assert chosen(high) == [B]
    assert chosen(RouteRequest()) == [A, B], "a request of the worst class: the policy alone"
