"""The ``kv_aware`` policy and its KV-event readers on real loopback ZMQ sockets
(docs/behaviour.md#routing-policies)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import gevent
import msgpack
import pytest
import zmq
import zmq.green as zmq_green

from epd_flask.control.roster import Instance, Roster, RosterError, Settings, parse
from epd_flask.core.events import Events
from epd_flask.fleet import kvevents, policies
from epd_flask.fleet.kvaware import Tokenizer, tokenize_request
from epd_flask.fleet.kvcache import prompt_keys
from epd_flask.fleet.kvevents import KVEvents
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import Decision, Placement, RouteRequest
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.routing import Router
from epd_flask.upstream.transport import Transport
from tests.bodies import chat
from tests.fakes import FakeUpstream, Handler, response, serve_and_wait
from tests.helpers import eventually, free_port
from tests.unit.test_kvcache import BLOCK, Engine, batch, stored

PROMPT = list(range(1000, 1000 + 6 * BLOCK))


class Publisher:
    """vLLM's side of the socket: a bound PUB sending (topic, seq, payload) messages."""

    def __init__(self) -> None:
        self.sock = zmq_green.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.engine = Engine(port)

    def send(self, payload: bytes, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def store(self, tokens: list[int]) -> None:
        self.send(batch(*self.engine.store(tokens)))

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def publishers() -> Iterator[list[Publisher]]:
    started: list[Publisher] = []
    yield started
    for p in started:
        p.close()


class Heard:
    """What readers built with ``events`` reported."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.events = Events()
        self.events.kv_events.add_listener(self)

    def __call__(self, url: str, kind: str, n: int) -> None:
        self.counts[(url, kind)] = self.counts.get((url, kind), 0) + n


@pytest.fixture
def heard() -> Heard:
    return Heard()


def kv_router(instances: list[Instance], timeout: float = 0.5,
              events: Events | None = None) -> tuple[KVEvents, Router]:
    """A ``kv_aware`` prefill router over ``instances``, reading their KV events."""
    live = LiveFleet(Roster(settings=Settings(routing={"prefill": "kv_aware"}),
                            instances=tuple(instances)))
    kv = KVEvents(live.registry, events=events)
    return kv, Router(live, pictures=kv.picture, no_pictures=kv.missing,
                      tokenizer=Tokenizer(Transport(), lambda: timeout), seed=0)


def fleet(publishers: list[Publisher], n: int,
          events: Events | None = None) -> tuple[Registry, KVEvents, Router]:
    instances = []
    for _i in range(n):
        pub = Publisher()
        publishers.append(pub)
        # Nobody listens at these URLs: a /tokenize call is refused at once.
        instances.append(Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}",
                                  kv_events=pub.endpoint))
    kv, router = kv_router(instances, events=events)
    return router.live.registry, kv, router


def connected(kv: KVEvents, count: int) -> bool:
    return len(kv.readers) == count and all(r.connected for r in kv.readers.values())


def publish_until_ready(kv: KVEvents, pub: Publisher, url: str, tokens: list[int]) -> None:
    """A SUB socket misses what is sent before its subscription reaches the publisher (ZMQ's
    slow joiner): send until the picture has it, as vLLM does with every new prompt."""
    def seen() -> bool:  # these tokens' blocks, not just any: an earlier store may be there
        return matched(kv, url, tokens) == len(tokens) // BLOCK

    def sent_and_seen() -> bool:
        pub.engine.hashes.clear()
        pub.store(tokens)
        return eventually(seen, 0.1)
    eventually(sent_and_seen, interval=0, what="the reader hearing the publisher")


@contextlib.contextmanager
def one_ready_reader(publishers: list[Publisher],
                     heard: Heard) -> Iterator[tuple[str, KVEvents, Router]]:
    """One instance whose reader is connected and has heard ``PROMPT`` stored: its URL, the
    readers and the router; the readers stop on leaving."""
    registry, kv, router = fleet(publishers, 1, heard.events)
    url = registry.instances()[0].url
    kv.sync()
    try:
        assert eventually(lambda: connected(kv, 1))
        publish_until_ready(kv, publishers[0], url, PROMPT)
        yield url, kv, router
    finally:
        kv.stop()


def matched(kv: KVEvents, url: str, tokens: list[int]) -> int:
    picture = kv.picture(url)
    return 0 if picture is None else picture.matched(prompt_keys(tokens, BLOCK))


def route(router: Router, body: dict[str, Any], prefix: bytes = b"conversation",
          headers: dict[str, str] | None = None) -> tuple[Instance, list[str]]:
    """One request's prefill choice as the pipeline makes it: its tokens asked for once,
    then the pick; the decisions as its log line would name them."""
    heard: list[str] = []
    request = router.with_tokens(RouteRequest(prefix=prefix), ("prefill",), body, headers)
    chosen = router.pick("prefill", request, lambda role, d: heard.append(d.describe(role)))
    return chosen.instance, heard


def test_kv_choice_most_blocks_under_the_load_bound_ties_to_the_prefix_choice() -> None:
    a, b, c = (Placement(Instance(role="prefill", url=f"http://10.0.0.{i}:1"))
               for i in (1, 2, 3))
    prefix = Decision(a, "kv_aware", policies.HIT, "hit")
    loads = {a.url: 0, b.url: 0, c.url: 0}

    def choose(matched: dict[str, int]) -> Decision:
        return policies.kv_choice([a, b, c], matched, 10, lambda i: loads[i.url], 1.25, prefix)

    got = choose({b.url: 7, c.url: 3})
    assert (got.target, got.outcome, got.why) == (b, "kvhit", "blocks=7/10,load=0")
    assert choose({a.url: 4, b.url: 4}).target == a  # a tie: the prefix choice
    assert choose({b.url: 4, c.url: 4}).target == b  # then the first in rendezvous order
    got = choose({})
    assert (got.target, got.outcome, got.why) == (a, "kvmiss", "blocks=0/10,hit")
    loads[b.url] = 5  # over ceil(1.25 * 6 / 3) = 3: spills to the next best holder
    got = choose({b.url: 7, c.url: 3})
    assert (got.target, got.why) == (c, "blocks=3/10,load=0")


def test_on_a_prefill_the_choice_is_where_the_prompt_would_be_done_first() -> None:
    """Queued prompt tokens plus the prompt's tokens not held: a held prefix counts for the
    tokens it saves, so a long enough queue outweighs it (docs/behaviour.md#routing-policies)."""
    a, b, c = (Placement(Instance(role="prefill", url=f"http://10.0.0.{i}:1"))
               for i in (1, 2, 3))
    prefix = Decision(a, "kv_aware", policies.HIT, "hit")
    queued = {a.url: 0, b.url: 0, c.url: 0}
    sizes = dict.fromkeys(queued, 16)

    def choose(matched: dict[str, int]) -> Decision:
        # A prompt of 10 blocks of 16 tokens and 4 more.
        return policies.kv_cost_choice([a, b, c], matched, sizes, 10, 164,
                                       lambda i: queued[i.url], prefix)

    got = choose({b.url: 7, c.url: 3})
    assert (got.target, got.outcome, got.why) == (b, "kvhit", "blocks=7/10,load=0")
    queued[b.url] = 100  # b saves 112 tokens but has 100 queued: c (saves 48) is done sooner
    got = choose({b.url: 7, c.url: 3})
    assert (got.target, got.why) == (c, "blocks=3/10,load=0")
    queued[b.url] = 60  # now b is done first again: 60 + 52 < 0 + 116
    assert choose({b.url: 7, c.url: 3}).target == b
    queued.update(dict.fromkeys(queued, 0))
    got = choose({})
    assert (got.target, got.outcome) == (a, "kvmiss")  # nothing held, all idle: prefix choice
    queued[a.url] = 1
    assert choose({}).target == b  # then the first in rendezvous order of the least queued


def test_a_load_that_moves_while_a_choice_is_made_is_read_once_per_candidate() -> None:
    """Sibling workers' calls change the load board between two reads of it: a choice reads
    each candidate's load once, so the best it found is among those it ties (a second read
    used to find none: IndexError, a 500)."""
    a, b, c = (Placement(Instance(role="prefill", url=f"http://10.0.0.{i}:1"))
               for i in (1, 2, 3))
    prefix = Decision(a, "kv_aware", policies.HIT, "hit")
    reads = iter(range(1000, 0, -7))

    def moving(instance: Instance) -> int:
        return next(reads)

    got = policies.kv_cost_choice([a, b, c], {}, dict.fromkeys((a.url, b.url, c.url), 16),
                                  10, 164, moving, prefix)
    assert (got.target, got.why) == (c, "blocks=0/10,load=986")
    got = policies.kv_choice([a, b, c], {b.url: 2, c.url: 2}, 10, moving, 1.25, prefix)
    assert got.target == b and got.outcome == "kvhit"


def test_kv_aware_routes_to_the_instance_holding_the_prompt_and_logs_why(
        publishers: list[Publisher], heard: Heard) -> None:
    registry, kv, router = fleet(publishers, 3, heard.events)
    kv.start()
    try:
        assert eventually(lambda: connected(kv, 3))
        holder = registry.instances()[2]
        publish_until_ready(kv, publishers[2], holder.url, PROMPT[:4 * BLOCK])
        chosen, why = route(router, {"model": "m", "prompt": PROMPT})
        assert chosen == holder
        assert why == ["prefill:kv_aware(blocks=4/6,load=0)"]
        assert heard.counts[(holder.url, "stored")] >= 1
        # A prompt no instance holds: the prefix choice, saying so.
        chosen, why = route(router, {"model": "m", "prompt": [7] * (3 * BLOCK)})
        assert why[0].startswith("prefill:kv_aware(blocks=0/3,")
    finally:
        kv.stop()


def test_garbage_and_gaps_are_counted_warned_about_once_and_tolerated(
        publishers: list[Publisher], heard: Heard, caplog: pytest.LogCaptureFixture) -> None:
    registry, kv, router = fleet(publishers, 1, heard.events)
    url = registry.instances()[0].url
    pub = publishers[0]
    kv.start()
    try:
        assert eventually(lambda: connected(kv, 1))
        publish_until_ready(kv, pub, url, PROMPT[:2 * BLOCK])
        with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.kvevents"):
            for _ in range(3):
                pub.send(b"\xc1 not msgpack")
            pub.sock.send_multipart([b"kv", b"short"])
            pub.send(batch(stored([1], None, [9] * BLOCK)), seq=pub.seq + 5)  # 5 lost
            pub.store(PROMPT)
            assert eventually(lambda: heard.counts.get((url, "gap"), 0) >= 1)
            assert eventually(lambda: matched(kv, url, PROMPT) == 6)
        assert heard.counts[(url, "malformed")] == 4
        warnings = [r for r in caplog.records if "not vLLM's KV-event format" in r.message]
        assert len(warnings) == 1
        _chosen, why = route(router, {"model": "m", "prompt": PROMPT})
        assert why == ["prefill:kv_aware(blocks=6/6,load=0)"]
    finally:
        kv.stop()


def test_a_dead_endpoint_warns_once_and_routes_by_prefix(
        caplog: pytest.LogCaptureFixture) -> None:
    dead = Publisher()
    endpoint = dead.endpoint
    dead.close()  # nobody listens there now
    inst = Instance(role="prefill", url="http://10.0.0.1:8100", kv_events=endpoint)
    kv, router = kv_router([inst, Instance(role="prefill", url="http://10.0.0.2:8100")])
    with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.kvevents"):
        kv.start()
        try:
            assert eventually(lambda: any("is not reachable" in r.message
                                          for r in caplog.records))
            gevent.sleep(0.5)  # ZMQ keeps retrying: still one warning
            _chosen, why = route(router, {"model": "m", "prompt": PROMPT})
        finally:
            kv.stop()
    assert len([r for r in caplog.records if "is not reachable" in r.message]) == 1
    assert why[0].startswith("prefill:kv_aware(noevents,")


def test_readers_follow_the_roster_and_evictions_drop_the_picture(
        publishers: list[Publisher]) -> None:
    registry, kv, _ = fleet(publishers, 2)
    first, second = registry.instances()
    kv.sync()
    try:
        assert eventually(lambda: connected(kv, 2))
        publish_until_ready(kv, publishers[0], first.url, PROMPT)
        kept = kv.readers[first.url]
        # A roster change that keeps the first instance keeps its reader and its picture.
        registry.replace([first])
        kv.sync()
        assert kv.readers == {first.url: kept} and kv.picture(first.url) is not None
        # Evicted: reader and picture gone; back: a new reader starts from nothing.
        for _ in range(registry.fail_threshold):
            registry.record_failure(first.url, "down")
        kv.sync()
        assert kv.readers == {} and kv.picture(first.url) is None
        registry.record_success(first.url)
        kv.sync()
        assert kv.readers[first.url] is not kept and kv.picture(first.url) is None
    finally:
        kv.stop()
    assert second.url not in kv.readers


def test_tokenize_request_asks_for_what_the_prefill_will_see() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"x": 1}, "max_tokens": 3}
    assert tokenize_request(chat) == {"model": "m", "messages": chat["messages"],
                                      "chat_template_kwargs": {"x": 1}}
    assert tokenize_request({"model": "m", "prompt": "hello"}) == {"model": "m",
                                                                   "prompt": "hello"}
    assert tokenize_request({"model": "m", "prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_request({"model": "m", "prompt": ["a", "b"]}) is None  # a batch
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert tokenize_request({"model": "m", "messages": [image]}) is None


def test_a_tokenize_failure_routes_by_prefix(publishers: list[Publisher]) -> None:
    """An instance that cannot be reached for /tokenize: the prefix choice, no error."""
    registry, kv, router = fleet(publishers, 2)
    kv.sync()
    try:
        assert eventually(lambda: connected(kv, 2))
        publish_until_ready(kv, publishers[0], registry.instances()[0].url, PROMPT)
        _chosen, why = route(router, {"model": "m", "prompt": "some text"})
        assert why[0].startswith("prefill:kv_aware(notokens,")
    finally:
        kv.stop()


def test_an_instance_that_left_and_returns_is_a_new_outage_to_warn_of(
        caplog: pytest.LogCaptureFixture) -> None:
    """Warned once per outage; leaving the fleet ends what is remembered of it, so a churning
    fleet leaves nothing behind and a returning instance's failure is said again."""
    gone = Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}")
    other = Instance(role="decode", url="http://127.0.0.1:9")
    live = LiveFleet(Roster(settings=Settings(), instances=(gone, other)))
    tokenizer = Tokenizer(Transport(), lambda: 0.5)
    Router(live, tokenizer=tokenizer, seed=0)

    def warnings() -> int:
        return sum("cannot tokenize" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.kvaware"):
        for _ in range(2):
            assert tokenizer.tokens({"model": "m", "prompt": "text"}, gone) == ()
        assert warnings() == 1
        live.adopt(Roster(settings=Settings(), instances=(other,)), 2)
        live.adopt(Roster(settings=Settings(), instances=(gone, other)), 3)
        assert tokenizer.tokens({"model": "m", "prompt": "text"}, gone) == ()
        assert warnings() == 2


@pytest.mark.parametrize("value", ["tcp://*:5558", "5558", "http://10.0.0.1:5558",
                                   "tcp://10.0.0.1", "tcp://10.0.0.1:0"])
def test_an_unusable_kv_events_endpoint_is_a_roster_error(value: str) -> None:
    doc = {"instances": [{"role": "prefill", "url": "http://10.0.0.1:8100", "kv_events": value},
                         {"role": "decode", "url": "http://10.0.0.2:8200"}]}
    with pytest.raises(RosterError, match="kv_events"):
        parse(doc, "test roster")


def test_a_kv_events_endpoint_reads_as_tcp() -> None:
    doc = {"instances": [{"role": "prefill", "url": "http://10.0.0.1:8100",
                          "kv_events": "10.0.0.1:5558"},
                         {"role": "decode", "url": "http://10.0.0.2:8200"}]}
    assert parse(doc, "test roster").instances[0].kv_events == "tcp://10.0.0.1:5558"


def tokenizing_fleet(publishers: list[Publisher], handler: Handler) -> tuple[
        KVEvents, Router, FakeUpstream, list[Instance], bytes]:
    """Two instances with events, the first a fake answering /tokenize with ``handler``,
    and a prefix key whose choice (the instance asked for tokens) is that fake."""
    fake = FakeUpstream(handler)
    pubs = [Publisher(), Publisher()]
    publishers += pubs
    urls = [fake.url, f"http://127.0.0.1:{free_port()}"]
    instances = [Instance(role="prefill", url=u, kv_events=p.endpoint)
                 for u, p in zip(urls, pubs, strict=True)]
    kv, router = kv_router(instances, timeout=0.3)
    kv.sync()
    assert eventually(lambda: connected(kv, 2))
    key = next(k for k in (b"c%d" % i for i in range(100))
               if policies.rendezvous_order(k, [Placement(i) for i in instances])[0].url
               == fake.url)
    return kv, router, fake, instances, key


CHAT = chat("hello", model="m", add_generation_prompt=True)


def tokens_answer(conn: Any, _request: bytes) -> None:
    conn.sendall(response(body=json.dumps({"count": len(PROMPT), "max_model_len": 512,
                                           "tokens": PROMPT}).encode()))


def test_tokens_from_tokenize_match_the_held_blocks(publishers: list[Publisher]) -> None:
    kv, router, fake, instances, key = tokenizing_fleet(publishers, tokens_answer)
    try:
        for inst, pub in zip(instances, publishers, strict=True):
            publish_until_ready(kv, pub, inst.url, [1] * BLOCK)  # both have a picture
        publish_until_ready(kv, publishers[1], instances[1].url, PROMPT)
        heard: list[str] = []
        request = router.with_tokens(RouteRequest(prefix=key), ("prefill", "decode"), CHAT,
                                     {"Authorization": "Bearer k"})
        chosen = router.pick("prefill", request, lambda role, d: heard.append(d.describe(role)))
        # A retry's pick reads the same request: no second /tokenize.
        assert router.pick("prefill", request, lambda role, d: None) == chosen
        assert chosen.instance == instances[1]
        assert heard == ["prefill:kv_aware(blocks=6/6,load=0)"]
        assert len(fake.requests) == 1
        head, _, body = fake.requests[0].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /tokenize ") and b"Authorization: Bearer k" in head
        assert json.loads(body) == CHAT
    finally:
        kv.stop()
        fake.stop()


def test_a_slow_tokenize_is_cut_at_the_timeout_and_routes_by_prefix(
        publishers: list[Publisher]) -> None:
    kv, router, fake, instances, key = tokenizing_fleet(publishers, serve_and_wait(b"", 5.0))
    try:
        publish_until_ready(kv, publishers[1], instances[1].url, PROMPT)
        started = time.monotonic()
        _chosen, why = route(router, CHAT, prefix=key)
        assert len(fake.requests) == 1
        assert time.monotonic() - started < 2.0  # the 0.3 s timeout, not the 5 s stall
        assert why[0].startswith("prefill:kv_aware(notokens,")
    finally:
        kv.stop()
        fake.stop()


@pytest.mark.parametrize("tokens", [[-1] * 8, [2 ** 32] * 8, [1, 2, True, 4]],
                         ids=["negative", "2^32", "a boolean"])
def test_tokenize_answering_ids_no_block_can_hold_routes_by_prefix(
        publishers: list[Publisher], tokens: list[Any]) -> None:
    def answer(conn: Any, _request: bytes) -> None:
        conn.sendall(response(body=json.dumps({"count": len(tokens), "max_model_len": 512,
                                               "tokens": tokens}).encode()))
    kv, router, fake, instances, key = tokenizing_fleet(publishers, answer)
    try:
        publish_until_ready(kv, publishers[1], instances[1].url, PROMPT)
        _chosen, why = route(router, CHAT, prefix=key)
        assert why[0].startswith("prefill:kv_aware(notokens,")
    finally:
        kv.stop()
        fake.stop()


@pytest.mark.parametrize("token", [-1, 2 ** 32, 2 ** 64 - 1], ids=["negative", "2^32", "2^64-1"])
def test_a_store_of_ids_no_block_can_hold_is_malformed_and_the_reader_goes_on(
        publishers: list[Publisher], heard: Heard, token: int) -> None:
    registry, kv, _router = fleet(publishers, 1, heard.events)
    url = registry.instances()[0].url
    pub = publishers[0]
    kv.sync()
    try:
        assert eventually(lambda: connected(kv, 1))
        publish_until_ready(kv, pub, url, PROMPT[:2 * BLOCK])
        pub.send(batch(stored([1], None, [token] * BLOCK)))
        assert eventually(lambda: heard.counts.get((url, "malformed"), 0) == 1)
        pub.store(PROMPT)
        assert eventually(lambda: matched(kv, url, PROMPT) == 6)
    finally:
        kv.stop()


@pytest.fixture
def high_fds() -> Iterator[None]:
    """~1,100 descriptors held open first, so every socket the test opens has a number past
    1,023, where ``select()`` refuses to look (FD_SETSIZE): a busy worker's case."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2048:
        pytest.skip("needs a descriptor limit of at least 2048 (ulimit -n)")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    yield
    for fd in held:
        os.close(fd)


def test_readers_work_at_descriptor_numbers_past_select_s_reach(
        publishers: list[Publisher], heard: Heard, high_fds: None) -> None:
    registry, kv, router = fleet(publishers, 3, heard.events)
    kv.start()
    try:
        assert eventually(lambda: connected(kv, 3))
        for inst, pub in zip(registry.instances(), publishers, strict=True):
            publish_until_ready(kv, pub, inst.url, PROMPT[:3 * BLOCK])
        _chosen, why = route(router, {"model": "m", "prompt": PROMPT})
        assert why == ["prefill:kv_aware(blocks=3/6,load=0)"]
        assert all(r.failures == 0 for r in kv.readers.values())
    finally:
        kv.stop()


def test_many_dead_endpoints_are_retried_with_backoff(high_fds: None) -> None:
    """ZMQ retries a refused connection every 100 ms by default: 1,000 dead endpoints took half
    a core. Retries back off (0.2 s doubling to 10 s): a handful per endpoint in 4 s."""
    dead = []
    for _ in range(100):
        pub = Publisher()
        dead.append(pub.endpoint)
        pub.close()
    registry = Registry([Instance(role="prefill", url=f"http://10.0.{i // 250}.{i % 250}:1",
                                  kv_events=endpoint) for i, endpoint in enumerate(dead)])
    kv = KVEvents(registry)
    kv.sync()
    try:
        assert eventually(lambda: all(r.retries >= 1 for r in kv.readers.values()))
        gevent.sleep(4.0)
        retries = [r.retries for r in kv.readers.values()]
        assert len(retries) == 100 and all(r.failures == 0 for r in kv.readers.values())
    finally:
        kv.stop()
    # 0.2 + 0.4 + 0.8 + 1.6 + 3.2 s: at most 6 in the ~5 s since the first; 100 ms: ~50.
    assert max(retries) <= 8, retries


# pyzmq's green socket whose construction failed (no socket left) warns from its __del__.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_reader_that_fails_starts_again_with_backoff(
        publishers: list[Publisher], caplog: pytest.LogCaptureFixture) -> None:
    """A worker out of ZMQ sockets (each reader needs three): the second reader fails to
    start, says so, routes nothing by its picture, and starts again (after 1 s, then 2 s,
    ...) until it can: here once the first instance leaves the roster."""
    context = zmq_green.Context()
    context.set(zmq.MAX_SOCKETS, 3)
    pubs = [Publisher(), Publisher()]
    publishers += pubs
    first, second = (Instance(role="prefill", url=f"http://127.0.0.1:{free_port()}",
                              kv_events=p.endpoint) for p in pubs)
    registry = Registry([first, second])
    kv = KVEvents(registry, context=lambda: context)
    try:
        with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.kvevents"):
            kv.start()
            assert eventually(lambda: second.url in kv.readers
                              and kv.readers[second.url].failures >= 2, 10)
        assert kv.readers[first.url].connected and kv.picture(second.url) is None
        failed = [r for r in caplog.records if "failed (ZMQError" in r.getMessage()]
        assert failed and "starts again in 1 s" in failed[0].getMessage()
        assert "starts again in 2 s" in failed[1].getMessage()
        registry.replace([second])
        assert eventually(lambda: connected(kv, 1) and second.url in kv.readers, 10)
        publish_until_ready(kv, pubs[1], second.url, PROMPT)
    finally:
        kv.stop()
        context.destroy(linger=0)
        caplog.clear()  # its records' tracebacks hold the half-built sockets
        gc.collect()  # which go now, under this test's filter


def test_a_message_claiming_more_events_than_any_step_has_is_dropped_unread(
        publishers: list[Publisher], heard: Heard) -> None:
    """Its count is read before any event is decoded: too many, and the whole message goes,
    counted as dropped; the picture that missed it is stale, and kv_aware says so."""
    with one_ready_reader(publishers, heard) as (url, kv, router):
        bomb = msgpack.packb([1.0, [0] * (kvevents.MAX_MESSAGE_EVENTS + 1)])
        publishers[0].send(bomb)
        assert eventually(lambda: heard.counts.get((url, "dropped"), 0) == 1)
        assert heard.counts.get((url, "malformed"), 0) == 0  # none of them was looked at
        assert kv.picture(url) is None
        _chosen, why = route(router, {"model": "m", "prompt": PROMPT})
        assert why[0].startswith("prefill:kv_aware(stale,")


def test_a_burst_after_a_quiet_spell_is_read_not_dropped(
        publishers: list[Publisher], heard: Heard) -> None:
    """Behind means finding more queued after every message for a while; a reader that waited
    for the publisher is not behind when the publisher's next step sends several at once (an
    engine idle between requests does exactly that)."""
    with one_ready_reader(publishers, heard) as (url, kv, router):
        gevent.sleep(kvevents.BEHIND_SECONDS * 1.5)
        burst = [[7000 + 10 * n + i for i in range(BLOCK)] for n in range(20)]
        for tokens in burst:  # all queued before the reader wakes
            publishers[0].store(tokens)
        assert eventually(lambda: matched(kv, url, burst[-1]) == 1)
        assert heard.counts.get((url, "dropped"), 0) == 0
        _chosen, why = route(router, {"model": "m", "prompt": PROMPT})
        assert not why[0].startswith("prefill:kv_aware(stale,"), why


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big", signed=True), payload]


NESTED = b"\x91" * 100_000 + b"\xc0"  # [[[[...nil...]]]], 100,000 deep
HOSTILE: dict[str, tuple[list[bytes], str]] = {
    "one frame": ([b"kv"], "malformed"),
    "four frames": ([b"kv", b"\0" * 8, batch(), b"x"], "malformed"),
    "a thousand frames": ([b"kv"] * 1000, "malformed"),
    "a short sequence": ([b"kv", b"\0" * 7, batch()], "malformed"),
    "not msgpack": (_frames(0, b"\xc1" * 64), "malformed"),
    "nested 100,000 deep": (_frames(0, NESTED), "malformed"),
    "events nested 100,000 deep": (_frames(0, b"\x92\xcb" + b"\0" * 8 + NESTED), "malformed"),
    "an array claiming 2^32 items": (_frames(0, b"\xdd\xff\xff\xff\xff"), "malformed"),
    "an event claiming 2^32 bytes": (_frames(0, b"\x92\x00\x91\xc6\xff\xff\xff\xff"),
                                     "malformed"),
    "a map claiming 2^32 keys": (_frames(0, b"\x92\x00\x91\xdf\xff\xff\xff\xff"), "malformed"),
    "a store of a billion blocks": (_frames(0, batch(stored([1], None, [1] * BLOCK,
                                                            size=10 ** 9))), "malformed"),
    "a sequence far ahead": (_frames(2 ** 62, batch()), "gap"),
    "a negative sequence": (_frames(-5, batch()), "gap"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_messages_are_counted_and_the_reader_goes_on(
        publishers: list[Publisher], heard: Heard, name: str) -> None:
    frames, kind = HOSTILE[name]
    registry, kv, _router = fleet(publishers, 1, heard.events)
    url = registry.instances()[0].url
    pub = publishers[0]
    kv.sync()
    try:
        assert eventually(lambda: connected(kv, 1))
        publish_until_ready(kv, pub, url, PROMPT[:2 * BLOCK])
        reader = kv.readers[url]
        pub.sock.send_multipart(frames)
        assert eventually(lambda: heard.counts.get((url, kind), 0) >= 1)
        pub.engine.hashes.clear()
        pub.store(PROMPT)
        assert eventually(lambda: matched(kv, url, PROMPT) == 6)
        assert kv.readers[url] is reader and reader.failures == 0
    finally:
        kv.stop()


@pytest.mark.parametrize("body", [
    b'{"tokens": [1, 2, 3]}', b'{"tokens": [1, 18446744073709551616]}', b'{"tokens": [1, 2.0]}',
    b'{"tokens": ["\xff"]}', b'{"tokens": [1, 2', b'{"tokens": [1, NaN]}'])
def test_only_a_tokenize_answer_of_token_ids_gives_tokens(
        body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """The answer is read with orjson (``jsoncodec.loads_ids``): a number beyond 64 bits (a
    float to orjson), a float, text that is not UTF-8 or not JSON give no tokens and a warning,
    and routing goes by prefix, as with any failed /tokenize."""
    fake = FakeUpstream(lambda conn, _request: conn.sendall(response(body=body)))
    try:
        tokenizer = Tokenizer(Transport(), lambda: 1.0)
        with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.kvaware"):
            got = tokenizer.tokens({"model": "m", "prompt": "text"},
                                   Instance(role="prefill", url=fake.url))
    finally:
        fake.stop()
    good = body == b'{"tokens": [1, 2, 3]}'
    assert got == ((1, 2, 3) if good else ())
    assert any("cannot tokenize" in m for m in caplog.messages) is not good
