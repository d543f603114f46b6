"""What each vLLM role does with a validated completion request: the KV side of a prefill or a
decode, the EC side of an encoder, and how many tokens the answer gets. Returns an ``Answer``
that the app renders as JSON or as a stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import ecstore, errors, handles, media, textgen, wire
from .state import SimState
from .validate import Request


class IncompleteHandle(Exception):
    """A decode got ``do_remote_prefill`` without the keys it needs: real vLLM hangs, then dies."""


class HandleWithoutBlocks(Exception):
    """A decode got ``do_remote_prefill`` with no ``remote_block_ids``: real vLLM's scheduler
    asserts there is nothing to load, which is false, and its EngineCore dies at once."""


@dataclass
class Answer:
    request_id: str
    pieces: list[list[str]]  # token pieces per choice
    finish_reasons: list[str]
    prompt_tokens: int
    cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    # Mooncake prefill: the transfer whose KV this answer computes (settled once it is sent).
    transfer_id: str | None = None
    # Mooncake decode: the handle to pull KV with before the first token.
    pull: dict[str, Any] | None = None
    encoder_only: bool = False  # no generation at all: a stream has no content chunk
    # Prompt tokens this server computes itself (the cost model's prefill work); None: all
    # that its prefix cache did not answer.
    computed_tokens: int | None = None

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


def _cached(req: Request, state: SimState) -> list[int]:
    """Each prompt's tokens the prefix cache answers; the prompt's blocks are cached after."""
    cache = state.prefix_cache
    ids = req.prompt_ids or [None] * len(req.prompts)
    cached = [cache.lookup_and_insert(p) if given is None else cache.insert(given)
              for p, given in zip(req.prompts, ids, strict=True)]
    state.publish_kv_events()
    state.count("prefix_cached_tokens", sum(cached))
    state.count("prefix_computed_tokens", req.total_prompt_tokens - sum(cached))
    return cached


def _computing(req: Request, state: SimState, request_id: str) -> Answer:
    """A server that computes the prompt itself (a combined instance, a decode with no KV to
    pull): under the cost model, or publishing KV events, its own prefix cache answers what it
    can."""
    answer = _generate(req, *_token_budget(req, state), request_id)
    if state.config.prefill_tokens_per_s > 0 or state.prefix_cache.recording:
        answer.cached_tokens = sum(_cached(req, state))
    return answer


def _prefill(req: Request, state: SimState, rank: int, request_id: str) -> Answer:
    cfg = state.config
    cached = _cached(req, state)
    # ExampleConnector ignores kv_transfer_params: it stores every prompt's KV by content.
    if cfg.kv_connector == "example" or not handles.wants_remote_decode(req.kv_params):
        answer = _generate(req, *_token_budget(req, state), request_id)
        answer.cached_tokens = sum(cached)
        return answer
    # Remote decode: the KV stays here for the decode to pull. Real vLLM still honours
    # max_tokens (a proxy sends 1); the handles then cover the generated tokens too.
    answer = _generate(req, *_token_budget(req, state), request_id)
    answer.cached_tokens = sum(cached)
    if req.stream:
        return answer  # real vLLM sends no kv_transfer_params in any SSE chunk
    state.count("kv_handles_issued")
    if cfg.kv_connector == "mooncake":
        # The router builds the decode's params itself; we only promise KV for its transfer id.
        transfer_id = (req.kv_params or {}).get("transfer_id")
        if isinstance(transfer_id, str) and transfer_id:
            state.transfers.open(transfer_id, state.rank_engine_ids[rank], rank,
                                 req.prompts[-1])
            answer.transfer_id = transfer_id
        return answer
    num_tokens = req.prompt_tokens[-1]  # several prompts: vLLM returns the last one's params
    generated = len(answer.pieces[-1])
    computed = num_tokens + max(generated - 1, 0)
    answer.kv_transfer_params = handles.nixl_params(
        secret=cfg.secret,
        engine_id=state.rank_engine_ids[rank],
        request_id=request_id,
        chat=req.chat,
        num_tokens=num_tokens,
        block_ids=state.blocks.allocate(handles.blocks_for(computed)),
        cached_tokens=cached[-1] if generated <= 1 else None,
        host=cfg.host,
        side_channel_port=cfg.side_channel_port,
        computed_tokens=computed,
    )
    params = answer.kv_transfer_params
    for key in cfg.kv_params_omit:
        params.pop(key, None)
    params.update(cfg.kv_params_extra)
    return answer


def _decode(req: Request, state: SimState, request_id: str) -> Answer:
    if state.config.kv_connector == "example":
        # Shared storage: any params are ignored (real vLLM: no hang, no error).
        return _generate(req, *_token_budget(req, state), request_id)
    verdict = handles.classify(state.config.secret, req.kv_params, req.prompt_tokens[-1])
    if verdict != handles.MOONCAKE:  # a Mooncake handle is judged by the pull itself
        state.count(f"kv_handles_{verdict}")
    if verdict == handles.INCOMPLETE:
        raise IncompleteHandle(str(sorted(req.kv_params or {})))
    if verdict == handles.NO_BLOCKS:
        raise HandleWithoutBlocks(str(sorted(req.kv_params or {})))
    if verdict not in (handles.VALID, handles.MOONCAKE):
        return _computing(req, state, request_id)
    answer = _generate(req, *_token_budget(req, state), request_id)
    answer.computed_tokens = 0  # the KV arrives from prefill
    if verdict == handles.MOONCAKE:
        answer.pull = dict(req.kv_params or {})
    else:
        _keep_received(req, state)
    return answer


def _keep_received(req: Request, state: SimState) -> None:
    """What vLLM's decode does with KV that arrived from a prefill: its blocks are cached
    like computed ones (the scheduler's ``_update_waiting_for_remote_kv`` calls
    ``cache_blocks``), so they show in its KV events and serve a later prompt that shares
    them. Nothing is counted as computed or cached: this request computed nothing."""
    if state.config.prefill_tokens_per_s <= 0 and not state.prefix_cache.recording:
        return
    cache = state.prefix_cache
    ids = req.prompt_ids or [None] * len(req.prompts)
    for prompt, given in zip(req.prompts, ids, strict=True):
        cache.insert(textgen.token_ids(prompt) if given is None else given)
    state.publish_kv_events()


def _encode(req: Request, state: SimState, request_id: str) -> Answer:
    cfg = state.config
    kwargs = req.body.get("mm_processor_kwargs")
    items = media.extract_items(req.messages, kwargs)
    answer = Answer(request_id=request_id, pieces=[[]], finish_reasons=["stop"],
                    prompt_tokens=req.total_prompt_tokens, encoder_only=True,
                    computed_tokens=0)
    if not items:
        return answer  # real vLLM: nothing to encode, nothing published, ec_transfer_params null
    state.count("items_encoded", len(items))
    audio_in_video = isinstance(kwargs, dict) and bool(kwargs.get("use_audio_in_video"))
    params = media.ec_transfer_params(items, cfg.ec_metadata, audio_in_video)
    for key, entry in params.items():
        ecstore.publish(cfg.secret, key, entry["metadata"])
    push = req.body.get("ec_transfer_params")
    if isinstance(push, dict) and push.get("consumer_zmq"):
        state.count("ec_pushes", len(push.get("ec_items") or ()))
    answer.ec_transfer_params = params
    return answer


def _find_embeddings(req: Request, state: SimState) -> None:
    """What a language model with an EC connector does with a request's media: raw items found
    in the store are used as published, others it encodes itself; a ``*_embeds`` reference
    whose embedding cannot be found is an internal error (vLLM's retryable 500)."""
    secret = state.config.secret
    kwargs = req.body.get("mm_processor_kwargs")
    for item in media.extract_items(req.messages, kwargs):
        found, _ = ecstore.lookup(secret, item.key)
        state.count("media_from_ec" if found else "media_encoded_locally")
    for ref in media.extract_embeds(req.messages, kwargs):
        found, published = ecstore.lookup(secret, ref.key)
        if not found:
            state.count("ec_embeds_unresolved")
            raise errors.embedding_missing(ref.kind, ref.key)
        state.count("ec_embeds_resolved" if ref.metadata == published
                    else "ec_embeds_mismatched")
    params = req.body.get("ec_transfer_params")
    if isinstance(params, dict) and isinstance(params.get("ec_items"), list):
        state.count("ec_items_received", len(params["ec_items"]))


def answer(req: Request, state: SimState, rank: int) -> Answer:
    """Plan the answer for ``req`` on this server's role (``rank``: the DP rank it was sent to)."""
    role = state.config.role
    request_id = wire.new_id(req.chat)
    if role != "encode":
        if req.body.get("ec_transfer_params"):
            state.count("ec_params_received")
        _find_embeddings(req, state)
    if role == "prefill":
        return _prefill(req, state, rank, request_id)
    if role == "decode":
        return _decode(req, state, request_id)
    if role == "encode":
        return _encode(req, state, request_id)
    return _computing(req, state, request_id)
