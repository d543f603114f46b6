"""One KV picture per host: one worker reads the KV events, its siblings follow its pictures
through the state directory's sockets (docs/behaviour.md#routing-policies). Real ZMQ: a
loopback publisher, the relay's Unix sockets in a temporary state directory."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_flask.control.roster import Instance, Roster, Settings
from epd_flask.fleet import kvrelay
from epd_flask.fleet.kvaware import Tokenizer
from epd_flask.fleet.kvcache import CachePicture, Changes, HeldKeys, Removed, Stored, prompt_keys
from epd_flask.fleet.kvevents import KVEvents
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.routing import Router
from epd_flask.upstream.transport import Transport
from tests.helpers import eventually, free_port
from tests.unit.test_kvaware import PROMPT, Publisher, route
from tests.unit.test_kvcache import BLOCK, batch


class Host:
    """The workers of one host: each with its own registry over the same instances, all
    sharing ``state_dir``."""

    def __init__(self, state_dir: Path, instances: tuple[Instance, ...]) -> None:
        self.state_dir = state_dir
        self.instances = instances
        self.workers: list[tuple[KVEvents, Router]] = []

    def worker(self) -> tuple[KVEvents, Router]:
        live = LiveFleet(Roster(settings=Settings(routing={"prefill": "kv_aware"}),
                                instances=self.instances))
        kv = KVEvents(live.registry, state_dir=self.state_dir)
        router = Router(live, pictures=kv.picture, no_pictures=kv.missing,
                        tokenizer=Tokenizer(Transport(), lambda: 0.5), seed=0)
        kv.sync()
        self.workers.append((kv, router))
        return kv, router

    def stop(self) -> None:
        for kv, _ in self.workers:
            kv.stop()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


@pytest.fixture
def host(tmp_path: Path, publisher: Publisher) -> Iterator[Host]:
    others = tuple(Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}")
                   for _ in range(2))
    instances = (Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}",
                          kv_events=publisher.endpoint), *others)
    h = Host(tmp_path / "state", instances)
    h.state_dir.mkdir()
    yield h
    h.stop()


def matched(kv: KVEvents, url: str, tokens: list[int]) -> int:
    picture = kv.picture(url)
    return 0 if picture is None else picture.matched(prompt_keys(tokens, BLOCK))


def store_until(kv: KVEvents, pub: Publisher, url: str, tokens: list[int]) -> None:
    """Store ``tokens`` until ``kv`` (the reading worker) has them: a SUB socket misses what
    is sent before its subscription reaches the publisher."""
    def sent_and_seen() -> bool:
        pub.engine.hashes.clear()
        pub.store(tokens)
        return eventually(lambda: matched(kv, url, tokens) == len(tokens) // BLOCK, 0.1)
    assert eventually(sent_and_seen, interval=0, what="the reader hearing the publisher")


def test_one_worker_of_a_host_reads_and_its_siblings_route_by_its_picture(
        host: Host, publisher: Publisher) -> None:
    reader, _ = host.worker()
    sibling, router = host.worker()
    url = host.instances[0].url
    assert reader.relay is not None and reader.relay.leading and list(reader.readers) == [url]
    assert sibling.following and sibling.readers == {}
    store_until(reader, publisher, url, PROMPT[:4 * BLOCK])
    assert eventually(lambda: matched(sibling, url, PROMPT) == 4)
    chosen, why = route(router, {"model": "m", "prompt": PROMPT})
    assert chosen == host.instances[0] and why == ["prefill:kv_aware(blocks=4/6,load=0)"]
    # Evicted on the engine: gone from the sibling's picture too.
    evicted = publisher.engine.hash_of(PROMPT[:3 * BLOCK])
    publisher.send(batch({"type": "BlockRemoved", "block_hashes": [evicted],
                          "medium": "GPU"}))
    assert eventually(lambda: matched(sibling, url, PROMPT) == 2)
    assert matched(reader, url, PROMPT) == 2


def test_a_sibling_that_starts_late_or_misses_a_change_is_given_everything(
        host: Host, publisher: Publisher) -> None:
    reader, _ = host.worker()
    url = host.instances[0].url
    store_until(reader, publisher, url, PROMPT[:3 * BLOCK])
    late, _ = host.worker()
    assert eventually(lambda: matched(late, url, PROMPT) == 3)
    follower = late.relay.follower if late.relay is not None else None
    holder = reader.relay.holder if reader.relay is not None else None
    assert follower is not None and holder is not None
    asked = follower._asked
    # A change the follower never gets (as if the holder's queue had dropped it): the next
    # one shows the gap, and the follower asks for everything again.
    holder.sequence += 1
    publisher.store(PROMPT)
    assert eventually(lambda: matched(late, url, PROMPT) == 6)
    assert follower._asked > asked


def test_when_the_reading_worker_stops_a_sibling_reads_and_the_others_follow_it(
        host: Host, publisher: Publisher) -> None:
    first, _ = host.worker()
    second, _ = host.worker()
    third, _ = host.worker()
    url = host.instances[0].url
    store_until(first, publisher, url, PROMPT[:2 * BLOCK])
    assert eventually(lambda: matched(third, url, PROMPT) == 2)
    first.stop()
    # Nobody reads until the lock is taken: what the old reader knew is not trusted.
    assert eventually(lambda: third.picture(url) is None, 3)
    second.sync()
    third.sync()
    assert second.relay is not None and second.relay.leading and list(second.readers) == [url]
    assert third.following
    store_until(second, publisher, url, PROMPT)
    assert eventually(lambda: matched(third, url, PROMPT) == 6)


def test_the_reading_worker_says_which_pictures_are_stale_and_which_instances_it_reads(
        host: Host, publisher: Publisher) -> None:
    reader, _ = host.worker()
    sibling, _ = host.worker()
    url = host.instances[0].url
    store_until(reader, publisher, url, PROMPT)
    assert eventually(lambda: matched(sibling, url, PROMPT) == 6)
    reader.readers[url]._stale_until = time.monotonic() + 5
    assert eventually(lambda: sibling.missing([url]) == "stale")
    assert sibling.picture(url) is None
    reader.readers[url]._stale_until = 0.0
    assert eventually(lambda: matched(sibling, url, PROMPT) == 6)
    # The instance leaves the reader's registry: its reader stops, and the sibling forgets it.
    reader.registry.replace(host.instances[1:])
    reader.sync()
    assert url not in reader.readers
    assert eventually(lambda: sibling.picture(url) is None and sibling.missing([url])
                      == "noevents")


def test_without_a_short_enough_state_directory_every_worker_reads(
        tmp_path: Path, publisher: Publisher) -> None:
    deep = tmp_path / ("d" * 100)
    assert kvrelay.socket_paths(deep) is None
    instance = Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}",
                        kv_events=publisher.endpoint)
    h = Host(deep, (instance,))
    try:
        a, _ = h.worker()
        b, _ = h.worker()
        assert a.relay is None and b.relay is None
        assert list(a.readers) == list(b.readers) == [instance.url]
    finally:
        h.stop()


def test_a_pictures_changes_are_each_keys_last_state_and_rebuild_it_elsewhere() -> None:
    picture = CachePicture(max_blocks=4)
    picture.changes = Changes(cleared=True)
    copy = HeldKeys()
    tokens = list(range(6 * BLOCK))

    def relay() -> None:
        changes = picture.changes
        assert changes is not None
        if changes.cleared:
            copy.clear()
        copy.block_size = picture.block_size
        copy.change([k for k, v in changes.held.items() if v],
                    [k for k, v in changes.held.items() if not v],
                    [k for k, v in changes.roots.items() if v],
                    [k for k, v in changes.roots.items() if not v])
        picture.changes = Changes()
    # Six blocks into four: the first two stored and evicted within one change, never sent.
    picture.apply([Stored(list(range(1, 7)), None, tokens, BLOCK)])
    assert sum(picture.changes.held.values()) == 4 if picture.changes else False
    relay()
    keys = prompt_keys(tokens, BLOCK)
    assert copy.held == set(keys[2:]) and copy.matched(keys) == picture.matched(keys) == 0
    # An orphan chain (its parent unknown), then one of its blocks evicted.
    picture.apply([Stored([50, 51], 999, tokens[:2 * BLOCK], BLOCK)])
    picture.apply([Removed([51])])
    relay()
    assert copy.roots == set(picture.roots()) and copy.held == set(picture.keys())
    assert copy.matched(keys, tokens) == picture.matched(keys, tokens) == 1
    picture.clear()
    relay()
    assert copy.held == set() and copy.roots == set()


def test_a_host_whose_instances_publish_no_events_takes_no_lock_and_opens_no_socket(
        tmp_path: Path) -> None:
    h = Host(tmp_path, (Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}"),))
    try:
        kv, _ = h.worker()
        kv.sync()
        assert kv.relay is not None and not kv.relay.active
        assert list(tmp_path.iterdir()) == []
    finally:
        h.stop()


def test_an_ask_the_reader_cannot_answer_is_logged_and_the_next_one_served(
        host: Host, publisher: Publisher, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    reader, _ = host.worker()
    url = host.instances[0].url
    store_until(reader, publisher, url, PROMPT)
    holder = reader.relay.holder if reader.relay is not None else None
    assert holder is not None
    snapshot = holder.snapshot
    asked: list[int] = []

    def once_broken() -> list[bytes]:
        asked.append(1)
        if len(asked) == 1:
            raise RuntimeError("broken")
        return snapshot()
    monkeypatch.setattr(holder, "snapshot", once_broken)
    late, _ = host.worker()
    assert eventually(lambda: matched(late, url, PROMPT) == 6, 5)
    assert any("cannot answer a sibling's ask" in r.getMessage() for r in caplog.records)
