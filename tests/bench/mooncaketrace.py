"""A production trace in Mooncake's format, as requests the simulator counts exactly.

One JSON object per line (Mooncake's FAST'25 trace release): ``timestamp`` (ms from the
start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``, the prompt as a chain
of 512-token blocks, equal ids at equal positions meaning the same prefix. No text is in the
trace, so each id becomes a block of text of its own: 512 pieces of 4 ASCII characters,
derived from the id alone, which the simulator counts as 512 tokens (``sim/textgen.py``: 4
bytes are one token id). The same ids give the same text, so two prompts share exactly the
prefix the trace says they share, down to a partial last block (a prompt's text is cut at
``input_length`` tokens). Prompts go to ``/v1/completions`` as text, so no chat template adds
tokens the trace did not count.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512
#: The simulator's tokens: 4 bytes of UTF-8 each (``epd_flask/sim/textgen.BYTES_PER_TOKEN``).
BYTES_PER_TOKEN = 4
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN
PATH = "/v1/completions"
#: The trace this repository carries (tests/bench/traces/README.md says where it comes from).
DEFAULT = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class Row:
    """One request of the trace; ``t`` is its arrival in seconds after the first, already
    divided by the replay's speed."""

    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def block_text(hash_id: int) -> str:
    """The text of one 512-token block: base64 of SHAKE-128 output keyed by the id, 2048 ASCII
    characters, nothing JSON must escape."""
    raw = hashlib.shake_128(b"mooncake-block-%d" % hash_id).digest(BLOCK_BYTES * 3 // 4)
    return base64.b64encode(raw).decode("ascii")


def prompt_text(row: Row) -> str:
    """The prompt of ``row``: its blocks' text, cut at ``input_length`` tokens."""
    text = "".join(block_text(h) for h in row.hash_ids)
    return text[:row.input_length * BYTES_PER_TOKEN]


def load(path: Path, limit: int = 0, speed: float = 1.0) -> list[Row]:
    """The first ``limit`` requests of the trace (0: all), arrivals divided by ``speed`` and
    counted from the first one. Refuses a row whose length and blocks disagree."""
    if speed <= 0:
        raise ValueError(f"the replay's speed must be > 0, got {speed}")
    rows: list[Row] = []
    first: float | None = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            doc = json.loads(line)
            ids = tuple(int(h) for h in doc["hash_ids"])
            length = int(doc["input_length"])
            if not ids or not (len(ids) - 1) * BLOCK_TOKENS < length <= len(ids) * BLOCK_TOKENS:
                raise ValueError(f"{path}:{number}: input_length {length} does not fit "
                                 f"{len(ids)} blocks of {BLOCK_TOKENS} tokens")
            stamp = float(doc["timestamp"]) / 1000.0
            first = stamp if first is None else first
            rows.append(Row((stamp - first) / speed, length, int(doc["output_length"]), ids))
            if limit and len(rows) >= limit:
                break
    return rows


def body(row: Row, model: str, max_tokens: int) -> dict[str, Any]:
    """The completion request of ``row``: a stream, its answer capped at ``max_tokens``."""
    return {"model": model, "prompt": prompt_text(row),
            "max_tokens": max(1, min(row.output_length, max_tokens)), "stream": True}


def as_json(row: Row) -> dict[str, Any]:
    return {"t": row.t, "input_length": row.input_length,
            "output_length": row.output_length, "hash_ids": list(row.hash_ids)}


def from_json(doc: dict[str, Any]) -> Row:
    return Row(float(doc["t"]), int(doc["input_length"]), int(doc["output_length"]),
               tuple(doc["hash_ids"]))
