"""The load store's pieces (docs/behaviour.md#routing-policies 2): what a host sends and how the
other hosts' counts are read and summed, which host is which, and the exchange with a real
Redis: a host's counts heard by the others but not by itself, a host that stops sending
forgotten when its key expires, a store that stops answering counting for nothing."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest

from epd_flask.control.roster import Instance
from epd_flask.core.events import Events
from epd_flask.fleet import loadshare
from epd_flask.fleet.loadboard import CALLS, TOKENS, LoadBoard
from epd_flask.fleet.loadshare import LoadShare, decode, encode, host_counts, host_name, others
from epd_flask.fleet.registry import Registry
from tests.helpers import eventually

P1, P2, P3 = (f"http://10.0.0.{i}:8000" for i in (1, 2, 3))


def board_with(counts: dict[str, tuple[int, int]]) -> LoadBoard:
    board = LoadBoard(None)
    for url, (calls, tokens) in counts.items():
        board.add(url, calls, CALLS)
        board.add(url, tokens, TOKENS)
    return board


@contextmanager
def exchanging(url: str, instances: list[str], *shares: LoadShare) -> Iterator[None]:
    """``shares`` sending their counts on ``instances`` through the store at ``url``; stopped
    when the block ends."""
    for share in shares:
        share.follow(lambda: instances)
        share.configure(url)
    try:
        yield
    finally:
        for share in shares:
            share.stop()


def test_a_host_sends_the_instances_it_has_calls_on_and_their_tokens() -> None:
    board = board_with({P1: (2, 3000), P2: (0, 0)})
    board.add(P3, 1)  # a running request, no call: not routing's load
    counts = host_counts(board, [P1, P2, P3])
    assert counts == {P1: (2, 3000)}
    assert decode(encode(counts)) == counts


def test_the_other_hosts_counts_are_summed_and_what_cannot_be_read_is_left_out() -> None:
    a = encode({P1: (2, 3000), P2: (1, 10)})
    b = encode({P1: (1, 500)})
    bad = orjson.dumps({P2: [1, -5], P3: ["1", 2], "x": [1], "y": 7})
    answer = [b"host-a", a, b"host-b", b, b"host-c", bad, b"host-d", b"not json", b"host-e",
              b"[1, 2]"]
    assert others(answer) == {P1: (3, 3500), P2: (1, 10)}
    assert others([]) == {}


def test_one_master_is_one_host_and_each_master_another(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert host_name(tmp_path / "a") == host_name(str(tmp_path / "a"))
    assert host_name(tmp_path / "a") != host_name(tmp_path / "b")
    assert host_name(None).endswith(f":pid{os.getpid()}")


def test_each_host_hears_the_others_counts_not_its_own_and_forgets_one_that_stops(
        redis_server, monkeypatch: pytest.MonkeyPatch) -> None:
    board_a, board_b = board_with({P1: (2, 3000)}), board_with({P2: (1, 40)})
    a, b = LoadShare(board_a, "host-a"), LoadShare(board_b, "host-b")
    with exchanging(redis_server.url, [P1, P2, P3], a, b):
        a.exchange()
        b.exchange()
        assert b.counts(P1) == (2, 3000) and b.counts(P2) == (0, 0)  # its own are not others'
        a.exchange()
        assert a.counts(P2) == (1, 40) and a.counts(P1) == (0, 0)
        board_a.add(P1, -1, CALLS)
        board_a.add(P1, -1000, TOKENS)
        board_a.add(P3, 1, CALLS)
        a.exchange()  # changed: sent at once
        b.exchange()
        assert (b.counts(P1), b.counts(P3)) == ((1, 2000), (1, 0))
        # Host A's last word lives 0.3 s (so the test need not wait 2 s; the steps above keep
        # the real TTL, which a loaded machine's pauses between them cannot outlast), then it
        # stops sending (it died): its key expires and host B forgets it.
        monkeypatch.setattr(loadshare, "TTL", 0.3)
        board_a.add(P3, 1, CALLS)
        a.exchange()
        eventually(lambda: (b.exchange(), b.counts(P1))[1] == (0, 0), 5,
                   what="host A's key expired")
        assert b.counts(P3) == (0, 0)


def test_a_store_that_stops_answering_counts_for_nothing_and_is_logged_once(
        redis_server, caplog) -> None:
    heard: list[bool | None] = []
    events = Events()
    events.load_store.add_listener(heard.append)
    a = LoadShare(board_with({P1: (2, 3000)}), "host-a")
    b = LoadShare(LoadBoard(None), "host-b", events)
    with exchanging(redis_server.url, [P1], a, b):
        a.exchange()
        b.exchange()
        assert b.counts(P1) == (2, 3000) and b.up is True
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.loadshare"):
            b.exchange()
            b._retry_at = 0.0  # the next exchange at once, not a second later
            b.exchange()
        assert b.up is False and b.counts(P1) == (0, 0)
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
            f"routing: the load store {redis_server.url} does not answer"]
        assert heard == [True, False]
        b.configure("")
        assert heard == [True, False, None] and b.up is None


def test_routing_counts_this_host_and_the_other_hosts_it_heard_of(redis_server) -> None:
    board = board_with({P1: (1, 100)})
    share = LoadShare(board, "host-b")
    registry = Registry([Instance(role="prefill", url=P1)], board=board, share=share)
    assert registry.proxies(P1) == (1, 100)  # no store: this host alone
    other = LoadShare(board_with({P1: (2, 3000)}), "host-a")
    with exchanging(redis_server.url, [P1], share, other):
        other.exchange()
        share.exchange()
        assert registry.host(P1) == (1, 100)
        assert registry.proxies(P1) == (3, 3100)
