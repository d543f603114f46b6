"""A KV-event publisher that can flood its subscribers, in a process of its own (so the flood
has its own CPU and the test's event loop stays free to measure the proxy).

It binds a PUB socket as vLLM does (vLLM's high-water mark) and, while idle, sends one small
store every 50 ms so subscribers build a picture. Commands on stdin, one per line:
``flood SECONDS`` sends messages of ``--stores`` one-block ``BlockStored`` events (distinct
blocks, cycling through enough of them to fill a picture) as fast as it can for SECONDS,
then prints ``flooded MESSAGES``; ``quit`` ends it.

    python -m tests.e2e.kvflood --endpoint tcp://127.0.0.1:5557 --stores 10000
"""

from __future__ import annotations

import argparse
import select
import sys
import time

import msgpack
import zmq

BLOCK_SIZE = 16
HWM = 100_000
#: Distinct blocks the flood cycles through: more than a picture holds.
DISTINCT_BLOCKS = 160_000


def store(block: int) -> dict[str, object]:
    tokens = [(block * BLOCK_SIZE + i) % 150_000 for i in range(BLOCK_SIZE)]
    return {"type": "BlockStored", "block_hashes": [block + 1], "parent_block_hash": None,
            "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None], "group_idx": 0}


def payloads(stores: int) -> list[bytes]:
    count = max(1, DISTINCT_BLOCKS // stores)
    return [msgpack.packb([time.time(), [store(n * stores + i) for i in range(stores)], 0])
            for n in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--stores", type=int, default=10_000)
    args = parser.parse_args()
    pub = zmq.Context().socket(zmq.PUB)
    pub.set_hwm(HWM)
    pub.bind(args.endpoint)
    flood = payloads(args.stores)
    idle = msgpack.packb([time.time(), [store(DISTINCT_BLOCKS)], 0])
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))
        seq += 1

    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            send(idle)
            continue
        command = sys.stdin.readline().split()
        if not command or command[0] == "quit":
            return
        until = time.monotonic() + float(command[1])
        sent = 0
        while time.monotonic() < until:
            send(flood[sent % len(flood)])
            sent += 1
        print(f"flooded {sent}", flush=True)


if __name__ == "__main__":
    main()
