"""Log-probabilities in vLLM's two wire forms: the legacy completions object (parallel lists of
offsets, values, tokens and top-k maps) and chat's list of per-token entries with UTF-8 bytes.
Values are made up but deterministic, negative, and the sampled token is always the most likely
(the sim is greedy).
"""

from __future__ import annotations

import hashlib
from typing import Any

from .textgen import VOCAB


def _value(piece: str, position: int, rank: int) -> float:
    digest = hashlib.blake2b(f"{position}\0{rank}\0{piece}".encode(), digest_size=4).digest()
    return -(0.5 + rank + int.from_bytes(digest, "big") / 2**32)


def _alternatives(piece: str, position: int, k: int) -> list[tuple[str, float]]:
    """The sampled piece first, then ``k - 1`` other vocabulary pieces, less likely each."""
    out = [(piece, _value(piece, position, 0))]
    start = (VOCAB.index(piece) + 1) if piece in VOCAB else 0
    for offset in range(len(VOCAB)):
        if len(out) >= k:
            break
        other = VOCAB[(start + offset) % len(VOCAB)]
        if other != piece:
            out.append((other, _value(other, position, len(out))))
    return out


def completion_logprobs(pieces: list[str], k: int, first_offset: int = 0,
                        first_position: int = 0) -> dict[str, Any]:
    """The completions form for ``pieces``; a stream chunk passes its running offsets."""
    offsets, values, tops = [], [], []
    offset = first_offset
    for i, piece in enumerate(pieces):
        alternatives = _alternatives(piece, first_position + i, max(k, 1))
        offsets.append(offset)
        values.append(alternatives[0][1])
        tops.append(dict(alternatives))
        offset += len(piece)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": list(pieces),
            "top_logprobs": tops}


def _chat_entry(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(pieces: list[str], top: int, first_position: int = 0) -> dict[str, Any]:
    content = []
    for i, piece in enumerate(pieces):
        alternatives = _alternatives(piece, first_position + i, max(top, 1))
        entry = _chat_entry(*alternatives[0])
        entry["top_logprobs"] = [_chat_entry(t, v) for t, v in alternatives[:top]]
        content.append(entry)
    return {"content": content}
