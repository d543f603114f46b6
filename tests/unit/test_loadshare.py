"""The load store's pieces (docs/behaviour.md#routing-policies 2): what a host sends and how the
other hosts' counts are read and summed, which host is which, and the exchange with a real
Redis: a host's counts heard by the others but not by itself, a host that stops sending
forgotten when its key expires, a store that stops answering counting for nothing; and one
worker per host (state directory) exchanging while its siblings read its snapshot, a sibling
taking over when it stops; a call claimed at once, heard by the other hosts before any
exchange."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gevent
import orjson
import pytest

from epd_flask.control.roster import Instance
from epd_flask.core.events import Events
from epd_flask.fleet import loadshare
from epd_flask.fleet.loadboard import CALLS, TOKENS, LoadBoard
from epd_flask.fleet.loadshare import LoadShare, decode, encode, host_counts, host_name, others
from epd_flask.fleet.registry import Registry
from epd_flask.upstream import redisclient
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


def store_clients(url: str) -> int:
    """The connections the Redis at ``url`` has open, besides the one asking."""
    client = redisclient.connect(url)
    try:
        return len(client.client_list()) - 1
    finally:
        client.close()


def ticks(*shares: LoadShare, rounds: int = 3) -> None:
    for _ in range(rounds):
        for share in shares:
            share.tick()


def test_one_worker_per_host_talks_to_the_store_and_its_sibling_reads_its_snapshot(
        redis_server, tmp_path: Path) -> None:
    # Host A: two workers of one master (one state directory, the same host sum); host B
    # alone, without a state directory.
    host_a = {P1: (2, 3000)}
    w1 = LoadShare(board_with(host_a), "host-a", state_dir=tmp_path)
    w2 = LoadShare(board_with(host_a), "host-a", state_dir=tmp_path)
    board_b = board_with({P2: (1, 40)})
    b = LoadShare(board_b, "host-b")
    with exchanging(redis_server.url, [P1, P2], w1, w2, b):
        ticks(w1, w2, b)
        assert w1.leading and not w2.leading
        assert store_clients(redis_server.url) == 2  # w1 and host B, not w2
        assert w1.counts(P2) == w2.counts(P2) == (1, 40)
        assert w1.counts(P1) == w2.counts(P1) == (0, 0)  # its own host's are not others'
        assert b.counts(P1) == (2, 3000)
        assert w2.up is True
        board_b.add(P2, 1, CALLS)
        b.tick()
        w1.tick()
        assert w2.counts(P2) == (2, 40)  # read when routing asks, no tick of its own needed

        # The exchanging worker dies (its lock released with it): the sibling takes over at
        # its next tick, and host A's counts keep reaching host B.
        w1.stop()
        w2.tick()
        assert w2.leading
        eventually(lambda: store_clients(redis_server.url) == 2, what="w1's connection gone")
        board_b.add(P2, 1, CALLS)
        ticks(b, w2, rounds=1)
        assert w2.counts(P2) == (3, 40)
        assert (b.tick(), b.counts(P1))[1] == (2, 3000)

        # A worker left without a store lets a sibling with one exchange (mid-reload).
        w3 = LoadShare(board_with(host_a), "host-a", state_dir=tmp_path)
        w3.follow(lambda: [P1, P2])
        w3.configure(redis_server.url)
        try:
            w3.tick()
            assert not w3.leading and w3.counts(P2) == (3, 40)
            w2.configure("")
            w3.tick()
            assert w3.leading and w3.counts(P2) == (3, 40)
        finally:
            w3.stop()


def test_a_stalled_exchanging_worker_counts_for_nothing_and_another_store_is_ignored(
        redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w1 = LoadShare(LoadBoard(None), "host-a", state_dir=tmp_path)
    w2 = LoadShare(LoadBoard(None), "host-a", state_dir=tmp_path)
    b = LoadShare(board_with({P2: (1, 40)}), "host-b")
    with exchanging(redis_server.url, [P2], w1, w2, b):
        ticks(b, w1, w2)
        assert w2.counts(P2) == (1, 40)
        # A sibling configured for another store (mid-reload) does not use the snapshot, nor
        # does it take over while the exchanging worker lives.
        w2.configure("redis://127.0.0.1:1/0")
        ticks(w1, w2)
        assert not w2.leading and w2.counts(P2) == (0, 0)
        assert store_clients(redis_server.url) == 2
        w2.configure(redis_server.url)
        w2.tick()
        assert w2.counts(P2) == (1, 40)
        # The exchanging worker stalls, holding the lock: its last read counts for nothing
        # after STALE (0.2 s here), for it and its sibling alike.
        monkeypatch.setattr(loadshare, "STALE", 0.2)
        eventually(lambda: (w2.tick(), w2.counts(P2))[1] == (0, 0), 5,
                   what="the stalled worker's snapshot gone stale")
        assert w1.counts(P2) == (0, 0) and not w2.leading
        w1.tick()
        assert w2.counts(P2) == (1, 40)


def test_only_the_exchanging_worker_logs_the_store_going_down_and_its_sibling_reports_it(
        redis_server, tmp_path: Path, caplog) -> None:
    heard: list[bool | None] = []
    events = Events()
    events.load_store.add_listener(heard.append)
    a = LoadShare(board_with({P1: (2, 3000)}), "host-a")
    w1 = LoadShare(LoadBoard(None), "host-b", state_dir=tmp_path)
    w2 = LoadShare(LoadBoard(None), "host-b", events, state_dir=tmp_path)
    with exchanging(redis_server.url, [P1], a, w1, w2):
        ticks(a, w1, w2)
        assert w2.counts(P1) == (2, 3000) and w2.up is True
        redis_server.stop()
        with caplog.at_level(logging.INFO, logger="epd_flask.fleet.loadshare"):
            w1.tick()
            w2.tick()
            assert w1.up is False and w2.up is False and w2.counts(P1) == (0, 0)
            w1._retry_at = 0.0  # the next exchange at once, not a second later
            w1.tick()
            w1.stop()  # the sibling takes over during the outage: no second warning
            w2.tick()
            assert w2.leading and w2.up is False
            redis_server.start()
            w2._retry_at = 0.0
            w2.tick()
            assert w2.up is True
        assert [r.getMessage().split(" (")[0].split(";")[0] for r in caplog.records
                if r.levelno >= logging.INFO] == [
            f"routing: the load store {redis_server.url} does not answer",
            f"routing: the load store {redis_server.url} answers again"]
        assert heard == [True, False, True]


def test_a_worker_that_cannot_share_the_exchange_makes_it_itself(redis_server, tmp_path: Path,
                                                                 caplog) -> None:
    a = LoadShare(board_with({P1: (2, 3000)}), "host-a")
    lone = LoadShare(LoadBoard(None), "host-b", state_dir=tmp_path / "missing")
    with exchanging(redis_server.url, [P1], a, lone), \
            caplog.at_level(logging.WARNING, logger="epd_flask.fleet.loadshare"):
        ticks(a, lone)
        assert lone.counts(P1) == (2, 3000) and not lone.leading
        assert ["cannot share the load store's exchange" in r.getMessage()
                for r in caplog.records] == [True]


def subscribers(url: str) -> int:
    client = redisclient.connect(url)
    try:
        return client.pubsub_numsub(loadshare.CLAIMS)[0][1]
    finally:
        client.close()


def test_a_call_one_host_opens_counts_on_the_others_at_once_until_the_exchange_carries_it(
        redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Host A alone (no state directory), host B two workers (w1 exchanges, w2 reads its
    # snapshot). No exchange runs between the call and its being counted: only the claim.
    monkeypatch.setattr(loadshare, "CLAIM_SECONDS", 0.5)
    board_a = LoadBoard(None)
    a = LoadShare(board_a, "host-a")
    registry_a = Registry([Instance(role="prefill", url=P1)], board=board_a, share=a)
    w1 = LoadShare(LoadBoard(None), "host-b", state_dir=tmp_path)
    w2 = LoadShare(LoadBoard(None), "host-b", state_dir=tmp_path)
    with exchanging(redis_server.url, [P1], a, w1, w2):
        ticks(a, w1, w2, rounds=1)
        assert w1.leading and w1.counts(P1) == (0, 0)
        listening = [gevent.spawn(lambda s=share: [s.listen() for _ in range(40)])
                     for share in (a, w1, w2)]
        try:
            eventually(lambda: subscribers(redis_server.url) == 2,
                       what="each host's exchanging worker listening, host B's sibling not")
            registry_a.track(P1, 1, 700)
            eventually(lambda: w1.counts(P1) == (1, 700), 5, what="host B heard the claim")
            assert w2.counts(P1) == (1, 700)  # its sibling through the snapshot, at once
            assert a.counts(P1) == (0, 0)  # a host's own claims are not the others'
            # The claim counts for CLAIM_SECONDS; host A's exchange carries the call then.
            gevent.sleep(loadshare.CLAIM_SECONDS)
            w1.exchange()
            assert w1.counts(P1) == w2.counts(P1) == (0, 0)
            a.exchange()
            w1.exchange()
            assert w1.counts(P1) == (1, 700)
            # A call closed is never claimed; the exchange carries it.
            registry_a.track(P1, -1, 700)
            a.exchange()
            w1.exchange()
            assert w1.counts(P1) == w2.counts(P1) == (0, 0)
        finally:
            gevent.killall(listening)


def test_a_claim_that_cannot_be_read_or_is_the_hosts_own_counts_for_nothing() -> None:
    share = LoadShare(LoadBoard(None), "host-b")
    share._read_at = time.monotonic()
    share._script = object()  # a store configured, without talking to one
    for raw in (b"host-a not json", b"host-a [1]", b"host-a", b"host-b " + encode({P1: (1, 10)}),
                b'host-a {"%s": [1, -7], "%s": ["x", 1]}' % (P1.encode(), P2.encode())):
        share.heard(raw)
    assert share.counts(P1) == share.counts(P2) == (0, 0)
    share.heard(b"host-a " + encode({P1: (2, 10)}), b"host-c " + encode({P2: (1, 5)}))
    assert (share.counts(P1), share.counts(P2)) == ((2, 10), (1, 5))


def test_a_listening_worker_reconfigured_or_stopped_hands_its_subscription_back_quietly(
        redis_server, caplog) -> None:
    share = LoadShare(LoadBoard(None), "host-a")
    share.follow(lambda: [P1])
    share.configure(redis_server.url)
    share.start()
    try:
        with caplog.at_level(logging.WARNING):
            eventually(lambda: subscribers(redis_server.url) == 1, what="listening")
            share.configure("")  # a reload that drops the store, then one that brings it back
            eventually(lambda: subscribers(redis_server.url) == 0, what="the listener gone")
            share.configure(redis_server.url)
            eventually(lambda: subscribers(redis_server.url) == 1, what="listening again")
    finally:
        share.stop()
    eventually(lambda: subscribers(redis_server.url) == 0, what="stopped")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
