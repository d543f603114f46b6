"""The fleet benchmark's workload: multi-turn chat sessions sharing a few system prompts,
generated from a seed (nothing downloaded), identical for every target it is replayed to.

- Sessions start as a Poisson process at ``rate`` sessions per second; each is one of
  ``system_prompts`` system prompts (Zipf-like popularity: the first is the most common) and a
  user id (the ``user`` field, for session affinity).
- Turns per session: geometric with mean ``mean_turns``; ShareGPT conversations average about
  3.5 human turns (LMSYS, "Vicuna" blog, 2023; ShareGPT_V3 as used by vLLM's benchmarks).
- Lengths are lognormal around ShareGPT's means as the vLLM paper reports them (Kwon et al.,
  SOSP 2023, §6.1: ShareGPT input ~ 161 tokens, output ~ 338 tokens per turn): user turns
  mean ``user_tokens``, answers mean ``answer_tokens`` (the benchmark caps answers to keep the
  run short; prefill is what routing changes). System prompts are 600-2000 tokens, as agent
  and assistant products ship them.
- A turn is sent ``think`` seconds (exponential) after the previous turn of its session was
  *sent*: open loop, so a slow target cannot slow the offered load down.
Text is made of words from a fixed list at ~4 characters per token, like English for BPE
tokenizers (and exactly the sim's count of UTF-8 bytes / 4).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

WORDS = ("the", "cache", "prefix", "token", "model", "router", "decode", "prefill", "block",
         "fleet", "answer", "query", "system", "user", "latency", "batch", "engine", "kv",
         "stream", "instance", "policy", "load", "hash", "turn")
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class TraceSpec:
    seed: int = 14
    duration: float = 20.0
    rate: float = 1.0  # new sessions per second
    system_prompts: int = 4
    mean_turns: float = 3.5
    user_tokens: int = 160
    answer_tokens: int = 40
    max_answer_tokens: int = 96
    think: float = 2.0


def _text(rng: random.Random, tokens: int) -> str:
    out: list[str] = []
    size = 0
    while size < tokens * CHARS_PER_TOKEN:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8, floor: int = 4,
               cap: int | None = None) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    value = max(floor, int(rng.lognormvariate(mu, sigma)))
    return min(value, cap) if cap else value


def generate(spec: TraceSpec, model: str = "tiny-llama") -> list[dict[str, Any]]:
    """The requests in send order: ``{"t": seconds from the start, "session": n, "turn": k,
    "body": {...}}``."""
    rng = random.Random(spec.seed)
    systems = [_text(rng, rng.randint(600, 2000)) for _ in range(spec.system_prompts)]
    weights = [1.0 / (i + 1) for i in range(spec.system_prompts)]
    out: list[dict[str, Any]] = []
    t = rng.expovariate(spec.rate)
    session = 0
    while t < spec.duration:
        system = rng.choices(systems, weights)[0]
        turns = 1
        while rng.random() > 1.0 / spec.mean_turns and turns < 12:
            turns += 1
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        sent = t
        for turn in range(turns):
            messages.append({"role": "user", "content": _text(
                rng, _lognormal(rng, spec.user_tokens, cap=2000))})
            answer = _lognormal(rng, spec.answer_tokens, cap=spec.max_answer_tokens)
            if sent < spec.duration:
                out.append({"t": sent, "session": session, "turn": turn, "body": {
                    "model": model, "messages": list(messages), "max_tokens": answer,
                    "stream": True, "user": f"user-{session}"}})
            messages.append({"role": "assistant", "content": _text(rng, answer)})
            sent += rng.expovariate(1.0 / spec.think)
        session += 1
        t += rng.expovariate(spec.rate)
    out.sort(key=lambda r: r["t"])
    return out
