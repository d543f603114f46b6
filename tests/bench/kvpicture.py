"""Memory of one instance's KV-cache picture per block it holds
(docs/behaviour.md#routing-policies), measured with tracemalloc: a picture kept at its bound by
chains of stores as vLLM publishes them (16-token blocks, token ids below 150,000), with vLLM
0.32's 64-bit integer block hashes and with the 32-byte hashes of earlier releases.

    .venv/bin/python -m tests.bench.kvpicture [--blocks 131072] [--report docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tracemalloc
from pathlib import Path

from epd_flask.fleet.kvcache import CachePicture, Stored

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

BLOCK_SIZE = 16
CHAIN_BLOCKS = 16


def fill(blocks: int, int_hashes: bool, seed: int = 1) -> CachePicture:
    """Twice the bound is stored, so the picture is measured as it lives: full, the oldest
    blocks going out as new ones come in."""
    rng = random.Random(seed)
    picture = CachePicture(blocks)
    parent = None
    for n in range(2 * blocks // CHAIN_BLOCKS):
        hashes = tuple(rng.getrandbits(64) if int_hashes else rng.randbytes(32)
                       for _ in range(CHAIN_BLOCKS))
        tokens = tuple(rng.randrange(150_000) for _ in range(CHAIN_BLOCKS * BLOCK_SIZE))
        # Half the chains continue the previous one, half start from the root.
        picture.apply([Stored(hashes, parent if n % 2 else None, tokens, BLOCK_SIZE)])
        parent = hashes[-1]
    return picture


def bytes_per_block(blocks: int, int_hashes: bool) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    picture = fill(blocks, int_hashes)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(picture) == blocks // CHAIN_BLOCKS * CHAIN_BLOCKS
    return (after - before) / len(picture)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=131072)
    parser.add_argument("--report", default="",
                        help="markdown file whose `kvpicture` block the figures replace")
    args = parser.parse_args()
    started, info = report.now(), report.machine()
    rows = []
    for int_hashes in (True, False):
        kind = "64-bit integer hashes" if int_hashes else "32-byte hashes"
        size = bytes_per_block(args.blocks, int_hashes)
        rows.append(f"| {kind} | {size:.0f} | {size * args.blocks / 2**20:.0f} |")
        print(f"{kind}: {size:.0f} bytes per block ({args.blocks} blocks)")
    if args.report:
        command = report.recorded_command(".venv/bin/python -m tests.bench.kvpicture",
                                          sys.argv[1:])
        report.write_section(Path(args.report), "kvpicture", "\n".join([
            report.stamp(started, info, command),
            f"A picture held at its bound of {args.blocks} blocks (tracemalloc):", "",
            "| block hashes | bytes per block | MB when full |", "|---|---:|---:|", *rows]))


if __name__ == "__main__":
    main()
