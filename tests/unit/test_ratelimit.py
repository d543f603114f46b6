"""Token buckets, their stores and OpenAI's rate-limit headers (docs/behaviour.md#admission)."""

from __future__ import annotations

import os

import pytest

from epd_flask.control.roster import Tenant
from epd_flask.serving import ratelimit
from epd_flask.serving.admission import requested_tokens, usage_total
from epd_flask.serving.ratelimit import HostStore, MemoryStore, Take
from epd_flask.serving.redisstore import Limiter


def test_a_bucket_holds_a_minute_and_refills_at_a_sixtieth_per_second() -> None:
    assert ratelimit.refill(0.0, 30.0, 600) == 300.0
    assert ratelimit.refill(590.0, 30.0, 600) == 600.0
    assert ratelimit.until_full(300.0, 600) == 30.0
    taken = ratelimit.decide([5.0, 1000.0], [Take("requests", 10, 1), Take("tokens", 1000, 300)],
                             give=False)
    assert taken.allowed and [lv.remaining for lv in taken.levels] == [4.0, 700.0]


def test_both_buckets_or_neither() -> None:
    refused = ratelimit.decide([5.0, 100.0], [Take("requests", 10, 1), Take("tokens", 600, 300)],
                               give=False)
    assert not refused.allowed and refused.short == "tokens"
    assert [lv.remaining for lv in refused.levels] == [5.0, 100.0]  # nothing taken
    assert refused.retry_after == pytest.approx(20.0)  # 200 tokens at 10 per second


def test_giving_back_never_overfills_and_a_shortfall_may_go_into_debt() -> None:
    back = ratelimit.decide([590.0], [Take("tokens", 600, -50)], give=True)
    assert back.levels[0].remaining == 600.0
    debt = ratelimit.decide([10.0], [Take("tokens", 600, 50)], give=True)
    assert debt.allowed and debt.levels[0].remaining == -40.0


@pytest.mark.parametrize(("seconds", "shown"), [(0.0201, "21ms"), (1.5, "1.5s"), (8.634, "8.64s"),
                                                (360, "6m0s"), (61.2, "1m2s")])
def test_reset_times_are_written_as_openai_writes_them(seconds: float, shown: str) -> None:
    assert ratelimit.duration(seconds) == shown


def test_headers_name_each_limit_the_tenant_has() -> None:
    verdict = ratelimit.decide([3.0], [Take("requests", 600, 1)], give=False)
    assert ratelimit.headers(verdict.levels) == [
        ("x-ratelimit-limit-requests", "600"), ("x-ratelimit-remaining-requests", "2"),
        ("x-ratelimit-reset-requests", "59.8s")]


def test_a_tenant_takes_from_the_limits_it_has() -> None:
    both = Tenant(requests_per_minute=10, tokens_per_minute=1000)
    assert ratelimit.takes_for(both, 70) == [Take("requests", 10, 1), Take("tokens", 1000, 70)]
    assert ratelimit.takes_for(Tenant(), 70) == []


def test_the_memory_store_refuses_past_the_limit() -> None:
    store = MemoryStore()
    takes = [Take("requests", 2, 1)]
    assert [store.apply("t", takes).allowed for _ in range(3)] == [True, True, False]
    assert store.apply("other", takes).allowed  # one bucket per tenant


def test_workers_of_one_host_share_its_buckets(tmp_path) -> None:
    one, two = HostStore(tmp_path / "rl.bin"), HostStore(tmp_path / "rl.bin")
    takes = [Take("requests", 3, 1)]
    try:
        outcomes = [(one if n % 2 else two).apply("t", takes).allowed for n in range(5)]
        assert outcomes == [True, True, True, False, False]
        assert two.apply("u", takes).allowed
    finally:
        one.close()
        two.close()


def test_what_a_request_may_use() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50, "n": 2}
    assert requested_tokens(True, chat, 104) == 104 + 100
    assert requested_tokens(True, {**chat, "max_completion_tokens": 10}, 104) == 104 + 20
    assert requested_tokens(True, {"messages": []}, 4) == 4  # its usage is charged at the end
    assert requested_tokens(False, {"prompt": "hi"}, 1) == 1 + 16  # vLLM's default max_tokens


@pytest.mark.parametrize(("data", "total"), [
    (b'{"id":"x","usage":{"prompt_tokens":5,"total_tokens":21,"completion_tokens":16}}', 21),
    (b'data: {"choices":[],"usage":null}\n\ndata: {"choices":[],"usage":{"prompt_tokens":4,'
     b'"completion_tokens":5}}\n\ndata: [DONE]\n\n', 9),
    (b'data: {"choices":[{"delta":{}}],"usage": null}\n\n', None),
    (b'{"usage": {"total_tokens": "many"}}', None),
    (b'no usage here', None),
])
def test_the_answers_usage_is_read_where_it_is(data: bytes, total: int | None) -> None:
    assert usage_total(data) == total


def test_an_answers_headers_tell_the_buckets_after_its_correction() -> None:
    taken = ratelimit.decide([10.0, 1000.0], [Take("requests", 10, 1), Take("tokens", 1000, 300)],
                             give=False)
    # It used 120 of the 300 reserved, and it never ran (its request goes back too).
    after = ratelimit.corrected(taken, [Take("requests", 10, -1), Take("tokens", 1000, -180)])
    assert [lv.remaining for lv in after.levels] == [10.0, 880.0]
    assert after.levels[0].reset == 0.0 and after.levels[1].reset == pytest.approx(7.2)
    over = ratelimit.corrected(taken, [Take("tokens", 1000, -5000)])
    assert over.levels[1].remaining == 1000.0  # never past the limit


def test_corrections_waiting_together_are_one_operation_per_tenant() -> None:
    merged = ratelimit.merged([
        ("a", [Take("tokens", 1000, -50)]), ("b", [Take("requests", 5, -1)]),
        ("a", [Take("tokens", 1000, 20), Take("requests", 10, -1)]),
        ("b", [Take("requests", 5, 1)])])
    assert merged == {"a": [Take("tokens", 1000, -30), Take("requests", 10, -1)]}


def test_the_limiter_opens_the_hosts_buckets_in_the_process_that_uses_them(tmp_path) -> None:
    """A descriptor opened before a fork would share its flock with the child: neither
    would exclude the other. Nothing is opened until a limited request comes."""
    limiter = Limiter(str(tmp_path))
    assert not (tmp_path / "ratelimit.bin").exists()
    takes = [Take("requests", 3, 1)]
    assert limiter.apply("t", takes).allowed
    assert (tmp_path / "ratelimit.bin").exists()
    parent = limiter.local
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own descriptor, the same buckets
        try:
            child = limiter.local
            os.write(write, b"%d%d" % (child is not parent,
                                       limiter.apply("t", takes).levels[0].remaining))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"11"  # a new store, and the parent's take already counted
    assert limiter.local is parent
    assert int(limiter.apply("t", takes).levels[0].remaining) == 0  # the child took one
    limiter.close()
