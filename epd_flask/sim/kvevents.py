"""vLLM's KV-cache events, as ``--kv-events-config`` makes vLLM 0.32 publish them: a ZMQ PUB
socket sending, per engine step, three frames (topic, an 8-byte big-endian sequence number,
a msgpack ``KVEventBatch``), so a router's kv_aware policy can follow the sim's prefix cache.

The payload is what vLLM's msgspec structs encode to (vllm/distributed/kv_events.py): the
batch is array-like ``[ts, [events...], data_parallel_rank]``; each event is a map whose first
key is ``"type"`` (the struct's tag) followed by its fields in declaration order, fields left
at their default omitted. Publishing never blocks and never fails a request: PUB drops what no
subscriber takes, and a full queue drops the batch (counted).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Any

import gevent
import msgpack
import zmq.green as zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
#: vLLM's KVEventsConfig fields and defaults (vllm/config/kv_events.py), in its order.
CONFIG_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
PUBLISHERS = ("null", "zmq")
#: vLLM's replay protocol: a batch sequence of -1 ends the answer to a replay request.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def parse_config(value: Any) -> dict[str, Any] | None:
    """``--kv-events-config`` (its JSON text, or the object) as vLLM reads it, completed with
    vLLM's defaults; None when events are off. Raises ValueError fit for an HTTP 400."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("kv_events_config must be a JSON object")
    unknown = sorted(set(value) - set(CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"kv_events_config: unknown field(s) {', '.join(unknown)}")
    config = {**CONFIG_DEFAULTS, **value}
    if not isinstance(config["enable_kv_cache_events"], bool):
        raise ValueError("kv_events_config.enable_kv_cache_events must be a boolean")
    if config["publisher"] is None:
        config["publisher"] = "zmq" if config["enable_kv_cache_events"] else "null"
    if config["publisher"] not in PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}")
    for name in ("endpoint", "topic"):
        if not isinstance(config[name], str):
            raise ValueError(f"kv_events_config.{name} must be a string")
    if not config["endpoint"].startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError("kv_events_config.endpoint must be a tcp://, ipc:// or inproc:// "
                         "address")
    replay = config["replay_endpoint"]
    if replay is not None and not (isinstance(replay, str) and is_bind_endpoint(replay)):
        raise ValueError("kv_events_config.replay_endpoint must be an address to bind "
                         "(tcp://*:port)")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if isinstance(config[name], bool) or not isinstance(config[name], int) \
                or config[name] < 0:
            raise ValueError(f"kv_events_config.{name} must be a non-negative integer")
    if not config["enable_kv_cache_events"] or config["publisher"] == "null":
        return None
    return config


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM binds wildcard, ipc and inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def block_stored(block_hashes: list[int], parent: int | None, token_ids: list[int],
                 block_size: int) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM's block pool makes it for a request without LoRA or media:
    one ``extra_keys`` entry (None) per block, KV cache group 0."""
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": None,
            "medium": MEDIUM_GPU, "lora_name": None,
            "extra_keys": [None] * len(block_hashes), "group_idx": 0}


def block_removed(block_hash: int) -> dict[str, Any]:
    """vLLM sends one ``BlockRemoved`` per evicted block."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": MEDIUM_GPU,
            "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict[str, Any]], ts: float, dp_rank: int = 0) -> bytes:
    return msgpack.packb([ts, events, dp_rank])


class Publisher:
    """One sim's PUB socket (and replay ROUTER socket, if configured)."""

    def __init__(self, config: dict[str, Any], host: str) -> None:
        self._topic = config["topic"].encode("utf-8")
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config["buffer_steps"])
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config["hwm"])
        self._replay = None
        self._replay_loop: gevent.Greenlet | None = None
        try:
            endpoint = config["endpoint"]
            if is_bind_endpoint(endpoint):
                endpoint = _bind(self._pub, endpoint, host)
            else:
                self._pub.connect(endpoint)
            replay = config["replay_endpoint"]
            if replay is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                replay = _bind(self._replay, replay, host)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_config: cannot open {config['endpoint']}: {exc}") \
                from None
        #: The configuration as /kv_event_sources reports it: ports chosen by the OS filled in.
        self.config = {**config, "endpoint": endpoint, "replay_endpoint": replay}
        if self._replay is not None:
            self._replay_loop = gevent.spawn(self._serve_replay)

    def publish(self, events: list[dict[str, Any]]) -> bool:
        """Send one batch now; False if ZMQ could not take it (dropped, never waited for)."""
        payload = encode_batch(events, time.time())
        seq = self._seq
        self._seq += 1
        if self._replay is not None:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("KV event batch %d dropped: %s", seq, exc)
            return False
        return True

    def _serve_replay(self) -> None:
        """vLLM's replay: a request carrying a start sequence number (8 bytes) gets every
        buffered batch from there, then an END_SEQ frame."""
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        self._replay.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                            flags=zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""),
                                            flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("KV event replay cut short: %s", exc)

    def close(self) -> None:
        if self._replay_loop is not None:
            self._replay_loop.kill(block=False)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def _bind(sock: Any, endpoint: str, host: str) -> str:
    """Bind; ``tcp://*:0`` binds the sim's own address on a port the OS picks (vLLM binds the
    node's IP there) and the answer names it."""
    if endpoint != "tcp://*:0":
        sock.bind(endpoint)
        return endpoint
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
