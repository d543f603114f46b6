"""The sim's stand-in for a tokenizer and a model: prompt token estimates and deterministic text.

Text depends only on the prompt, so a P/D pair answers exactly what a single server would (as
greedy vLLM does), and the vocabulary holds multi-byte UTF-8 pieces so a relay that decodes and
re-encodes, or splits a character across writes, is caught by byte comparison.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from typing import Any

BYTES_PER_TOKEN = 4
#: Token ids fall in [0, VOCAB_SIZE), a Llama-sized vocabulary.
VOCAB_SIZE = 32000
#: Knuth's multiplicative hash spreads neighbouring 4-byte pieces over the whole vocabulary.
_SPREAD = 0x9E3779B1
_MASK_32 = 0xFFFFFFFF
VOCAB = (
    "ulb", " ip", "sqn", " ao", "mw", " og", "nn", "aka", " pc", " giv", "oen", " jf", "arm",
    " the", " a", " of", "é", " café", "世", "界", " 世界", "ñ", " año", "ü", "→", " ✓", "ß",
    "€", " naïve", "日本", " z", "xu", "vg", "dn", " k", "sk", "mg", "cb", " end", ".", ",",
)
MEDIA_PLACEHOLDERS = {
    "image_url": "<image>",
    "audio_url": "<audio>",
    "input_audio": "<audio>",
    "video_url": "<video>",
    # An embedding encoded elsewhere fills the same placeholder as the media it came from.
    "image_embeds": "<image>",
    "audio_embeds": "<audio>",
    "video_embeds": "<video>",
}


def count_tokens(text: str) -> int:
    """Prompt tokens the way the sim counts them: about four UTF-8 bytes per token, at least one."""
    return max(1, math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN))


def token_ids(text: str) -> list[int]:
    """The sim's tokenizer: each 4-byte piece of the UTF-8 text is one token, its id a stable
    hash of the piece, so ``len(token_ids(t)) == count_tokens(t)`` and the prefix cache, the
    KV events and ``POST /tokenize`` all see the same ids. An empty text is one token (0),
    as a real tokenizer's BOS keeps a prompt from being empty."""
    data = text.encode("utf-8", "surrogatepass")
    if not data:
        return [0]
    data += b"\0" * (-len(data) % BYTES_PER_TOKEN)
    words = struct.unpack(f"<{len(data) // BYTES_PER_TOKEN}I", data)
    # map() over bound int methods runs in C: a third of a comprehension's cost.
    return list(map(VOCAB_SIZE.__rmod__, map(_MASK_32.__and__, map(_SPREAD.__mul__, words))))


def token_strs(text: str) -> list[str]:
    """The text of each token ``token_ids`` makes (a piece that splits a character is shown
    with replacement characters, as a byte-level tokenizer's pieces are)."""
    data = text.encode("utf-8", "surrogatepass")
    if not data:
        return [""]
    return [data[i:i + BYTES_PER_TOKEN].decode("utf-8", "replace")
            for i in range(0, len(data), BYTES_PER_TOKEN)]


def completion_prompt_text(prompt: Any) -> str:
    """One completion prompt (text or token ids) as the text the sim counts and answers (its
    prefix cache keeps given token ids as they are)."""
    if isinstance(prompt, str):
        return prompt
    # Token ids: one id is one token, so keep four bytes per id for the estimate.
    return "".join(f"{int(t) % 10000:04d}" for t in prompt)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text":
            parts.append(str(part.get("text", "")))
        elif kind in MEDIA_PLACEHOLDERS:
            parts.append(MEDIA_PLACEHOLDERS[kind])
    return "".join(parts)


def render_chat(messages: list[Any], add_generation_prompt: bool = True) -> str:
    """A ChatML rendering like the tiny model's template; per-message overhead comes with it."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role", "user")
        out.append(f"<|im_start|>{role}\n{_content_text(message.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def generate(prompt_text: str, n_tokens: int) -> list[str]:
    """The first ``n_tokens`` pieces of the answer to ``prompt_text`` (a prefix of longer ones)."""
    if n_tokens <= 0:
        return []
    seed = hashlib.blake2b(prompt_text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    rng = random.Random(int.from_bytes(seed, "big"))
    return rng.choices(VOCAB, k=n_tokens)

