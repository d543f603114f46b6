"""The sim's stand-in for a tokenizer and a model: prompt token estimates and deterministic text.

Text depends only on the prompt, so a P/D pair answers exactly what a single server would (as
greedy vLLM does), and the vocabulary holds multi-byte UTF-8 pieces so a relay that decodes and
re-encodes, or splits a character across writes, is caught by byte comparison.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

BYTES_PER_TOKEN = 4
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


def completion_prompt_text(prompt: Any) -> str:
    """One completion prompt (text or token ids) as the text the sim hashes and counts."""
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


def render_chat(messages: list[Any]) -> str:
    """A ChatML rendering like the tiny model's template; per-message overhead comes with it."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role", "user")
        out.append(f"<|im_start|>{role}\n{_content_text(message.get('content'))}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def generate(prompt_text: str, n_tokens: int) -> list[str]:
    """The first ``n_tokens`` pieces of the answer to ``prompt_text`` (a prefix of longer ones)."""
    if n_tokens <= 0:
        return []
    seed = hashlib.blake2b(prompt_text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    rng = random.Random(int.from_bytes(seed, "big"))
    return rng.choices(VOCAB, k=n_tokens)

