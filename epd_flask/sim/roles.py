"""What each vLLM role does with a validated completion request: the KV side of a prefill or a
decode, the EC side of an encoder, and how many tokens the answer gets. Returns an ``Answer``
that the app renders as JSON or as a stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import errors, handles, media, textgen, wire
from .state import SimState
from .validate import Request


class IncompleteHandle(Exception):
    """A decode got ``do_remote_prefill`` without the keys it needs: real vLLM hangs, then dies."""


@dataclass
class Answer:
    request_id: str
    pieces: list[list[str]]  # token pieces per choice
    finish_reasons: list[str]
    prompt_tokens: int
    cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)


def _token_budget(req: Request, state: SimState) -> tuple[int, str]:
    """How many tokens to produce and why the answer ends there."""
    cfg = state.config
    limit = req.max_tokens
    if limit is None:
        limit = cfg.max_model_len - max(req.prompt_tokens)
    n = min(limit, cfg.output_tokens)
    return n, "length" if n >= limit else "stop"


def _generate(req: Request, n: int, finish: str, request_id: str) -> Answer:
    return Answer(
        request_id=request_id,
        pieces=[textgen.generate(p, n) for p in req.prompts],
        finish_reasons=[finish] * len(req.prompts),
        prompt_tokens=req.total_prompt_tokens,
    )


def _prefill(req: Request, state: SimState, rank: int, request_id: str) -> Answer:
    cfg = state.config
    cached = [state.prefix_cache.lookup_and_insert(p, t)
              for p, t in zip(req.prompts, req.prompt_tokens, strict=True)]
    state.count("prefix_cached_tokens", sum(cached))
    if not handles.wants_remote_decode(req.kv_params):
        answer = _generate(req, *_token_budget(req, state), request_id)
        answer.cached_tokens = sum(cached)
        return answer
    # Remote decode: one token now, the KV stays here for the decode to pull.
    answer = _generate(req, 1, "length", request_id)
    answer.cached_tokens = sum(cached)
    if req.stream:
        return answer  # real vLLM sends no kv_transfer_params in any SSE chunk
    state.count("kv_handles_issued")
    if cfg.kv_connector == "mooncake":
        return answer  # Mooncake: the router builds the decode's params itself
    num_tokens = req.prompt_tokens[-1]  # several prompts: vLLM returns the last one's params
    answer.kv_transfer_params = handles.nixl_params(
        secret=cfg.secret,
        engine_id=state.rank_engine_ids[rank],
        request_id=request_id,
        chat=req.chat,
        num_tokens=num_tokens,
        block_ids=state.blocks.allocate(handles.blocks_for(num_tokens)),
        cached_tokens=cached[-1],
        host=cfg.host,
        side_channel_port=cfg.side_channel_port,
    )
    return answer


def _decode(req: Request, state: SimState, request_id: str) -> Answer:
    verdict = handles.classify(state.config.secret, req.kv_params, req.prompt_tokens[-1])
    state.count(f"kv_handles_{verdict}")
    if verdict == handles.INCOMPLETE:
        raise IncompleteHandle(str(sorted(req.kv_params or {})))
    return _generate(req, *_token_budget(req, state), request_id)


def _encode(req: Request, state: SimState, request_id: str) -> Answer:
    items = media.extract_items(req.messages)
    if not items:
        raise errors.bad_request(
            "This encoder-only server needs at least one multimodal item (image_url, "
            "audio_url, input_audio or video_url) in the messages.", "messages")
    state.count("items_encoded", len(items))
    return Answer(
        request_id=request_id,
        pieces=[[]],
        finish_reasons=["stop"],
        prompt_tokens=req.total_prompt_tokens,
        ec_transfer_params=media.ec_transfer_params(items, state.config.ec_metadata),
    )


def answer(req: Request, state: SimState, rank: int) -> Answer:
    """Plan the answer for ``req`` on this server's role (``rank``: the DP rank it was sent to)."""
    role = state.config.role
    request_id = wire.new_id(req.chat)
    if role != "encode" and req.body.get("ec_transfer_params"):
        state.count("ec_params_received")
    if role == "prefill":
        return _prefill(req, state, rank, request_id)
    if role == "decode":
        return _decode(req, state, request_id)
    if role == "encode":
        return _encode(req, state, request_id)
    return _generate(req, *_token_budget(req, state), request_id)
