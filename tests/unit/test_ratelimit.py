"""Token buckets, their stores and OpenAI's rate-limit headers (docs/behaviour.md#admission)."""

from __future__ import annotations

import pytest

from epd_flask.control.roster import Tenant
from epd_flask.serving import ratelimit
from epd_flask.serving.admission import requested_tokens, usage_total
from epd_flask.serving.ratelimit import HostStore, MemoryStore, Take


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
