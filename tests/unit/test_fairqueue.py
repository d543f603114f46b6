"""The admission queue's order (docs/behaviour.md#admission): strict priority between classes,
weighted fair sharing among a class's tenants, no credit for idle tenants."""

from __future__ import annotations

from collections import Counter

from epd_flask.serving.fairqueue import RANK, FairQueue, Waiter


def waiter(tenant: str, priority: str = "normal", cost: float = 1.0) -> Waiter:
    return Waiter(tenant, RANK[priority], cost, payload=tenant)


def drain(queue: FairQueue, count: int | None = None) -> list[str]:
    out = []
    while len(queue) and (count is None or len(out) < count):
        out.append(queue.pop().payload)
    return out


def test_a_higher_class_always_goes_first() -> None:
    queue = FairQueue()
    for name, priority in [("l1", "low"), ("n1", "normal"), ("l2", "low"), ("h1", "high"),
                           ("n2", "normal")]:
        queue.push(waiter(name, priority), weight=1)
    assert drain(queue) == ["h1", "n1", "n2", "l1", "l2"]


def test_backlogged_tenants_are_served_in_the_ratio_of_their_weights() -> None:
    queue = FairQueue()
    for _ in range(100):
        queue.push(waiter("b"), weight=1)
        queue.push(waiter("a"), weight=4)
    served = Counter(drain(queue, 50))
    assert served == {"a": 40, "b": 10}


def test_shares_by_tokens_weigh_each_request_by_its_cost() -> None:
    queue = FairQueue()
    for _ in range(20):
        queue.push(waiter("big", cost=1000), weight=1)
        queue.push(waiter("small", cost=100), weight=1)
    # Equal weights, equal token shares: ten small requests per big one.
    assert Counter(drain(queue, 11)) == {"small": 10, "big": 1}


def test_a_tenant_that_waited_for_nothing_builds_no_credit() -> None:
    queue = FairQueue()
    for _ in range(10):
        queue.push(waiter("busy"), weight=1)
    assert drain(queue, 5) == ["busy"] * 5
    for _ in range(4):
        queue.push(waiter("late"), weight=1)
    # "late" starts level with "busy" from now on: alternation, not four in a row.
    assert drain(queue, 4) in (["busy", "late", "busy", "late"], ["late", "busy", "late", "busy"])


def test_a_request_that_leaves_gives_its_place_back() -> None:
    queue = FairQueue()
    first, second = waiter("a"), waiter("a")
    queue.push(first, weight=1)
    queue.push(second, weight=1)
    queue.push(waiter("b"), weight=1)
    queue.remove(second)
    assert len(queue) == 2
    assert drain(queue) == ["a", "b"]
    queue.push(waiter("a"), weight=1)  # an empty queue forgets: no debt from the one that left
    assert drain(queue) == ["a"]


def test_the_request_that_would_go_last_is_the_one_a_full_queue_refuses() -> None:
    queue = FairQueue()
    for name, priority in [("n1", "normal"), ("l1", "low"), ("l2", "low"), ("h1", "high")]:
        queue.push(waiter(name, priority), weight=1)
    assert queue.last_served().payload == "l2"
    assert queue.goes_before(RANK["normal"], "x", 1.0, 1.0, queue.last_served())
    assert not queue.goes_before(RANK["low"], "l", 1.0, 1.0, queue.last_served())
    heavy = FairQueue()
    for _ in range(3):
        heavy.push(waiter("batch"), weight=1)  # tags 1, 2, 3
    light = heavy.last_served()
    assert light.finish == 3.0
    assert heavy.goes_before(RANK["normal"], "chat", 1.0, 4.0, light)  # tag 0.25
    assert not heavy.goes_before(RANK["normal"], "batch", 1.0, 1.0, light)  # tag 4
