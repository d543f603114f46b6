"""The simulator's KV-cache events and ``/tokenize`` (epd_flask/sim/kvevents.py): vLLM 0.32's
wire format read back with plain pyzmq and msgpack, so a kv_aware router can follow the sim's
prefix cache by tokenizing through ``/tokenize`` and chaining blocks of ``block_size`` ids."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import requests
import zmq.green as zmq

from epd_flask.sim import textgen
from epd_flask.sim.cli import build_parser, config_from_args
from epd_flask.sim.kvcache import PrefixCache, block_hashes
from tests.bodies import completion, conversation

#: Every wait on the socket ends; the events of a request come in its own response's time.
RECV_TIMEOUT_MS = 2000
PRIMING_ATTEMPTS = 100
SYSTEM = "You route requests by what each instance has cached already. " * 8
EVENTS_ON = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
             "topic": "kv"}


class Subscriber:
    """A kv_aware router's view of one sim: a SUB socket on its /kv_event_sources endpoint."""

    def __init__(self, endpoint: str, topic: str = "kv") -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)

    def frames(self, timeout_ms: int = RECV_TIMEOUT_MS) -> list[bytes] | None:
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def batch(self, timeout_ms: int = RECV_TIMEOUT_MS) -> tuple[int, list[Any]]:
        """(sequence number, events) of the next batch; fails the test if none comes."""
        frames = self.frames(timeout_ms)
        assert frames is not None, "no KV event batch arrived"
        topic, seq, payload = frames
        ts, events, rank = msgpack.unpackb(payload)
        assert topic == b"kv" and len(seq) == 8 and rank == 0
        assert abs(ts - time.time()) < 60
        return int.from_bytes(seq, "big"), events

    def close(self) -> None:
        self.sock.close()


def subscribe(url: str) -> Subscriber:
    """Connect, then reset the sim until its AllBlocksCleared arrives: the subscription has
    reached the publisher (PUB drops whatever is sent before that) and the cache is empty."""
    sources = requests.get(url + "/kv_event_sources", timeout=5).json()
    sub = Subscriber(sources["0"]["endpoint"])
    for _ in range(PRIMING_ATTEMPTS):
        requests.post(url + "/sim/reset", timeout=5)
        frames = sub.frames(timeout_ms=50)
        if frames is not None:
            while sub.frames(timeout_ms=50) is not None:
                pass  # resets published while the subscription was on its way
            return sub
    sub.close()
    raise AssertionError("the subscription never reached the sim's publisher")


def _asked(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def chat(url: str, user: str) -> dict[str, Any]:
    r = requests.post(url + "/v1/chat/completions", timeout=5,
                      json=conversation(_asked(user), max_tokens=1))
    assert r.status_code == 200, r.text
    return r.json()


def tokenize_chat(url: str, user: str) -> list[int]:
    r = requests.post(url + "/tokenize", timeout=5, json=conversation(_asked(user)))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    return body["tokens"]


def test_stored_blocks_are_the_tokenized_chat_in_chained_blocks(start_sim) -> None:
    sim = start_sim(role="prefill", kv_events_config=EVENTS_ON, block_size=32,
                    prompt_tokens_details=True, max_model_len=4096)
    sub = subscribe(sim.url)
    try:
        ids = tokenize_chat(sim.url, "hello")
        first = chat(sim.url, "hello")
        _, events = sub.batch()
        assert first["usage"]["prompt_tokens"] == len(ids)
        [stored] = events
        full = len(ids) // 32
        assert stored["type"] == "BlockStored" and stored["block_size"] == 32
        assert stored["parent_block_hash"] is None
        assert len(stored["block_hashes"]) == full >= 3
        assert stored["token_ids"] == ids[:full * 32]
        assert [stored[k] for k in ("lora_id", "medium", "lora_name", "group_idx")] == \
            [None, "GPU", None, 0]
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in stored["block_hashes"])

        again = chat(sim.url, "hello")  # all cached: nothing new stored, no batch
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            ((len(ids) - 1) // 32) * 32
        other = tokenize_chat(sim.url, "a different question, longer than the first one "
                              "so that it fills a block of its own at the end")
        chat(sim.url, "a different question, longer than the first one so that it fills a "
             "block of its own at the end")
        _, events = sub.batch()
        [tail] = events  # the shared system prompt's blocks are cached: only the new tail
        differ = next(i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b)
        shared = differ // 32
        assert tail["parent_block_hash"] == stored["block_hashes"][shared - 1]
        assert tail["token_ids"] == other[shared * 32:(len(other) // 32) * 32]
        # The reset that primed the subscription, then the two chats that stored blocks.
        assert sim.state.stats()["kv_event_batches_published"] == 3
    finally:
        sub.close()


def test_a_prompt_of_token_ids_is_cached_as_those_ids(start_sim) -> None:
    """vLLM caches the ids a completion was given; a router holding them matches directly."""
    sim = start_sim(role="prefill", kv_events_config=EVENTS_ON, prompt_tokens_details=True)
    sub = subscribe(sim.url)
    try:
        prompt = list(range(2000, 2040))
        for _ in range(2):
            done = requests.post(sim.url + "/v1/completions", timeout=5,
                                 json=completion(prompt, max_tokens=1)).json()
        _, [stored] = sub.batch()
        assert stored["token_ids"] == prompt[:32]
        assert done["usage"]["prompt_tokens"] == 40
        assert done["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    finally:
        sub.close()


def test_eviction_publishes_block_removed_tail_first(start_sim) -> None:
    sim = start_sim(role="prefill_decode", kv_events_config=EVENTS_ON, kv_cache_blocks=12,
                    max_model_len=4096)
    sub = subscribe(sim.url)
    try:
        chat(sim.url, "first")
        _, [old] = sub.batch()
        assert len(old["block_hashes"]) < 12  # it fits: nothing removed yet
        chat(sim.url, "x" * 400)  # ~100 more tokens: twelve blocks no longer hold both
        _, events = sub.batch()
        kinds = [e["type"] for e in events]
        assert kinds[0] == "BlockStored" and "BlockRemoved" in kinds
        new = events[0]
        removed = [e["block_hashes"] for e in events if e["type"] == "BlockRemoved"]
        assert all(len(hashes) == 1 for hashes in removed)  # one event per block, as vLLM
        removed_hashes = {h for [h] in removed}
        assert removed_hashes <= set(old["block_hashes"]) | set(new["block_hashes"])
        # What goes first is a tail, never the head of the shared system prompt.
        assert old["block_hashes"][0] not in removed_hashes
        assert len(sim.state.prefix_cache) == 12
    finally:
        sub.close()


def test_reset_and_block_size_change_publish_all_blocks_cleared(start_sim) -> None:
    sim = start_sim(role="prefill", kv_events_config=EVENTS_ON)
    sub = subscribe(sim.url)
    try:
        requests.post(sim.url + "/sim/reset", timeout=5)
        assert sub.batch()[1] == [{"type": "AllBlocksCleared"}]
        r = requests.post(sim.url + "/sim/config", json={"block_size": 32}, timeout=5)
        assert r.status_code == 200 and r.json()["block_size"] == 32
        assert sub.batch()[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close()


def test_events_are_off_by_default_and_switch_on_through_the_control_api(start_sim) -> None:
    sim = start_sim(role="prefill")
    assert sim.config.kv_events_config is None
    assert requests.get(sim.url + "/kv_event_sources", timeout=5).json() == {}
    chat(sim.url, "no events")
    assert sim.state.stats()["kv_event_batches_published"] == 0

    r = requests.post(sim.url + "/sim/config", json={"kv_events_config": EVENTS_ON}, timeout=5)
    assert r.status_code == 200, r.text
    sources = requests.get(sim.url + "/kv_event_sources", timeout=5).json()
    assert list(sources) == ["0"]
    assert sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
    assert {k: v for k, v in sources["0"].items() if k != "endpoint"} == {
        "enable_kv_cache_events": True, "publisher": "zmq", "replay_endpoint": None,
        "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv"}
    sub = subscribe(sim.url)
    try:
        chat(sim.url, "now with events")
        assert sub.batch()[1][0]["type"] == "BlockStored"
    finally:
        sub.close()
    r = requests.post(sim.url + "/sim/config", json={"kv_events_config": {"bogus": 1}},
                      timeout=5)
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = requests.post(sim.url + "/sim/config", json={"kv_events_config": None}, timeout=5)
    assert r.status_code == 200
    assert requests.get(sim.url + "/kv_event_sources", timeout=5).json() == {}


def test_a_batch_nobody_reads_never_holds_a_request(start_sim) -> None:
    """A publisher connecting to a subscriber that is not there: ZMQ queues up to the
    high-water mark, then drops; requests are answered either way."""
    endpoint = {**EVENTS_ON, "endpoint": "tcp://127.0.0.1:9", "hwm": 2}
    sim = start_sim(role="prefill", kv_events_config=endpoint, max_model_len=4096)
    started = time.monotonic()
    for i in range(20):
        chat(sim.url, f"unread {i}")
    assert time.monotonic() - started < 10
    stats = sim.state.stats()
    assert stats["kv_event_batches_published"] + stats["kv_event_batches_dropped"] == 20


def test_tokenize_matches_vllm_shape_and_the_completion_count(start_sim) -> None:
    sim = start_sim(role="prefill_decode")
    r = requests.post(sim.url + "/tokenize", timeout=5,
                      json=completion("héllo, 世界!", return_token_strs=True))
    assert r.status_code == 200
    body = r.json()
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
    assert body["max_model_len"] == 512 and body["count"] == len(body["tokens"]) == 4
    assert "".join(body["token_strs"]).startswith("héllo")
    assert all(0 <= t < textgen.VOCAB_SIZE for t in body["tokens"])
    done = requests.post(sim.url + "/v1/completions", timeout=5,
                         json=completion("héllo, 世界!", max_tokens=1)).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = requests.post(sim.url + "/tokenize", timeout=5,
                                json={"messages": messages}).json()
    without = requests.post(sim.url + "/tokenize", timeout=5, json={
        "messages": messages, "add_generation_prompt": False}).json()
    assert with_prompt["count"] > without["count"]
    assert with_prompt["tokens"][:without["count"] - 1] == without["tokens"][:-1]


@pytest.mark.parametrize(("body", "status", "type_"), [
    ({"model": "tiny-llama"}, 400, "Bad Request"),
    ({"prompt": 5}, 400, "Bad Request"),
    ({"messages": "hi"}, 400, "Bad Request"),
    ({"model": "nope", "prompt": "hi"}, 404, "NotFoundError"),
])
def test_tokenize_errors_in_vllm_shape(start_sim, body, status, type_) -> None:
    sim = start_sim()
    r = requests.post(sim.url + "/tokenize", json=body, timeout=5)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["type"] == type_ and error["code"] == status
    r = requests.post(sim.url + "/tokenize", data="{", timeout=5,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_token_ids_agree_with_the_token_count() -> None:
    for text in ("", "a", "abcd", "abcde", "世界", "x" * 1001, textgen.render_chat([])):
        assert len(textgen.token_ids(text)) == textgen.count_tokens(text)
    assert textgen.token_ids("abcdabcd")[0] == textgen.token_ids("abcdabcd")[1]
    assert textgen.token_ids("abcd") != textgen.token_ids("abce")


def test_cache_keeps_whole_prefixes_under_eviction() -> None:
    cache = PrefixCache(capacity=4, block_size=4)
    cache.recording = True
    a = list(range(16))  # four blocks
    assert cache.insert(a) == 0
    [stored] = cache.take_events()
    assert stored["parent_block_hash"] is None and stored["token_ids"] == a
    assert cache.insert(a[:8] + [99] * 4) == 8  # shares two blocks, adds one
    events = cache.take_events()
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0]["parent_block_hash"] == stored["block_hashes"][1]
    assert events[1]["block_hashes"] == [stored["block_hashes"][3]]  # a's tail went first
    assert cache.insert(a) == 12  # a lost only its last block


def test_cli_takes_vllms_kv_events_flags() -> None:
    args = build_parser().parse_args([
        "--block-size", "32", "--kv-events-config",
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558", '
        '"topic": "kv"}'])
    config = config_from_args(args)
    assert config.block_size == 32
    assert config.kv_events_config["endpoint"] == "tcp://*:5558"
    assert config.kv_events_config["buffer_steps"] == 10000
    off = config_from_args(build_parser().parse_args([
        "--kv-events-config", '{"enable_kv_cache_events": false}']))
    assert off.kv_events_config is None


def test_block_hashes_are_vllms_default_sha256_hashes() -> None:
    """Computed with vLLM 0.32's own hash_block_tokens(sha256, ...) and maybe_convert_block_hash
    (PYTHONHASHSEED unset): a router that rebuilds vLLM's hashes finds the sim's blocks."""
    ids = [*range(40), 31999, 5, 70000]
    assert block_hashes(ids, 16) == [3262291359910021016, 7142137847444424233]


def test_replay_endpoint_resends_buffered_batches_as_vllm_does(start_sim) -> None:
    """A subscriber that missed batches asks the ROUTER socket for everything from a sequence
    number on (vLLM's replay protocol) and gets them, then an end marker of -1."""
    sim = start_sim(role="prefill", max_model_len=4096,
                    kv_events_config={**EVENTS_ON, "replay_endpoint": "tcp://*:0"})
    for question in ("one", "two", "three"):
        chat(sim.url, f"{question} " * 40)  # each fills blocks of its own: one batch each
    replay = requests.get(sim.url + "/kv_event_sources", timeout=5).json()["0"][
        "replay_endpoint"]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(replay)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        seqs = []
        for _ in range(10):
            assert dealer.poll(RECV_TIMEOUT_MS), "the replay answer never came"
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            assert topic == b"kv" and msgpack.unpackb(payload)[1][0]["type"] == "BlockStored"
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == [1, 2]
    finally:
        dealer.close()
