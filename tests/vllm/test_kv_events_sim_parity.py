"""The sim's KV events against vLLM's own code (no server needed): vLLM's msgspec decoder reads
a sim batch and re-encodes it byte for byte, and vLLM's block hashing gives the sim's hashes
for the same token ids."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from epd_flask.sim import kvevents
from epd_flask.sim.kvcache import PrefixCache
from tests.vllm import fleet

VLLM_SIDE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as k

payload = open(sys.argv[1], "rb").read()
batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
k.init_none_hash(sha256)
stored = batch.events[0]
size = stored.block_size
parent, hashes = None, []
for start in range(0, len(stored.token_ids), size):
    parent = k.hash_block_tokens(sha256, parent, stored.token_ids[start:start + size], None)
    hashes.append(k.maybe_convert_block_hash(parent))
print(json.dumps({"same_bytes": msgspec.msgpack.encode(batch) == payload,
                  "kinds": [type(e).__name__ for e in batch.events],
                  "hashes": hashes, "event_hashes": stored.block_hashes}))
"""


def test_vllm_decodes_sim_events_and_agrees_on_block_hashes(tmp_path: Path) -> None:
    cache = PrefixCache(capacity=3, block_size=32)
    cache.recording = True
    cache.insert([(i * 7919) % 32000 for i in range(5 * 32 + 5)])  # five blocks, two evicted
    path = tmp_path / "batch.msgpack"
    path.write_bytes(kvevents.encode_batch(cache.take_events(), 1.5))
    done = subprocess.run([str(fleet.VENV / "bin" / "python"), "-c", VLLM_SIDE, str(path)],
                          capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["same_bytes"]
    assert seen["kinds"] == ["BlockStored", "BlockRemoved", "BlockRemoved"]
    assert seen["hashes"] == seen["event_hashes"]
