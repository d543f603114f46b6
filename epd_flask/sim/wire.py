"""vLLM 0.32's response bodies and SSE chunks, key for key as captured: pure functions from
values to dicts or bytes. Key order follows the captures so bodies diff cleanly against them.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from .config import VLLM_VERSION

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    """Compact JSON with raw UTF-8, as vLLM (pydantic) writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{random.getrandbits(64):016x}"


def fingerprint(engine_id: str) -> str:
    return f"vllm-{VLLM_VERSION}-{engine_id.replace('-', '')[:8]}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, detailed: bool = True
) -> dict[str, Any]:
    """``cached_tokens`` shows only when non-zero, and only if the server reports prompt
    details at all (the caller passes 0 otherwise, as vLLM without the flag)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if detailed:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens} if cached_tokens else None
        out["completion_tokens_details"] = None
    return out


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    texts: list[str],
    finish_reasons: list[str],
    fingerprint: str,
    usage: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None = None,
    ec_transfer_params: dict[str, Any] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    per_choice = logprobs or [None] * len(texts)
    choices = [
        {"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
         "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
         "prompt_token_ids": None, "routed_experts": None}
        for i, (text, reason, lp) in enumerate(zip(texts, finish_reasons, per_choice,
                                                   strict=True))
    ]
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": fingerprint,
        "usage": usage, "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": ec_transfer_params, "metrics": None,
    }


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    texts: list[str],
    finish_reasons: list[str],
    fingerprint: str,
    usage: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None = None,
    ec_transfer_params: dict[str, Any] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    per_choice = logprobs or [None] * len(texts)
    choices = [
        {"index": i,
         "message": {"role": "assistant", "content": text, "refusal": None,
                     "annotations": None, "audio": None, "function_call": None,
                     "reasoning": None},
         "logprobs": lp, "finish_reason": reason, "stop_reason": None, "token_ids": None,
         "routed_experts": None}
        for i, (text, reason, lp) in enumerate(zip(texts, finish_reasons, per_choice,
                                                   strict=True))
    ]
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": fingerprint,
        "usage": usage, "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
        "kv_transfer_params": kv_transfer_params, "ec_transfer_params": ec_transfer_params,
        "metrics": None,
    }


def completion_chunk(
    request_id: str, created: int, model: str, index: int, text: str,
    finish_reason: str | None = None, fingerprint: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One token of a streamed completion; the last one per choice carries ``finish_reason``."""
    chunk: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": finish_reason, "stop_reason": None,
                     "prompt_token_ids": None, "token_ids": None}],
    }
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def chat_role_chunk(request_id: str, created: int, model: str, index: int) -> dict[str, Any]:
    """The first chunk of a streamed chat answer: the assistant role and empty content."""
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
        "prompt_token_ids": None, "prompt_text": None,
    }


def chat_chunk(
    request_id: str, created: int, model: str, index: int, text: str,
    finish_reason: str | None = None, fingerprint: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    chunk: dict[str, Any] = {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [choice],
    }
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def usage_chunk(
    request_id: str, created: int, model: str, chat: bool, usage: dict[str, Any],
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": [], "usage": usage,
        "system_fingerprint": fingerprint,
    }


def models_list(model: str, max_model_len: int,
                adapters: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """vLLM's ``/v1/models``: the base model, then each loaded LoRA adapter with its path as
    ``root``, the base as ``parent`` and no ``max_model_len`` (``OpenAIServingModels``)."""
    created = int(time.time())
    cards = [{
        "id": model, "object": "model", "created": created, "owned_by": "vllm",
        "root": f"models/{model}", "parent": None, "max_model_len": max_model_len,
        "permission": [_permission(created)],
    }]
    cards += [{
        "id": name, "object": "model", "created": created, "owned_by": "vllm",
        "root": adapter["path"], "parent": model, "max_model_len": None,
        "permission": [_permission(created)],
    } for name, adapter in (adapters or {}).items()]
    return {"object": "list", "data": cards}


def _permission(created: int) -> dict[str, Any]:
    return {
        "id": f"modelperm-{random.getrandbits(64):016x}", "object": "model_permission",
        "created": created, "allow_create_engine": False, "allow_sampling": True,
        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
        "allow_fine_tuning": False, "organization": "*", "group": None,
        "is_blocking": False,
    }


def version() -> dict[str, Any]:
    return {"version": VLLM_VERSION}


def bootstrap_query(rank_engine_ids: list[str], worker_ports: list[int]) -> dict[str, Any]:
    """Mooncake's bootstrap ``/query``: per DP rank its engine id and (tp, pp) worker addresses."""
    return {
        str(rank): {"engine_id": engine_id,
                    "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{port}"}}}
        for rank, (engine_id, port) in enumerate(
            zip(rank_engine_ids, worker_ports, strict=True))
    }


#: The scheduler gauges of vLLM 0.32's ``/metrics`` the sim exports, with their help text
#: (vllm/v1/metrics/loggers.py, PrometheusStatLogger): labelled ``model_name`` and
#: ``engine`` in that order, one series per engine (DP rank).
ENGINE_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)


def engine_metrics(model: str, engines: list[tuple[int, int, float]]) -> bytes:
    """Prometheus text of ``ENGINE_GAUGES`` as prometheus_client writes it, from each engine's
    (running, waiting, kv cache usage from 0 to 1)."""
    lines = []
    label = json.dumps(model)
    for index, (name, doc) in enumerate(ENGINE_GAUGES):
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} gauge")
        for engine, values in enumerate(engines):
            lines.append(f'{name}{{model_name={label},engine="{engine}"}} '
                         f"{float(values[index])!r}")
    return ("\n".join(lines) + "\n").encode("utf-8")
