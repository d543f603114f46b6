"""The ``kv_aware`` policy: the prompt's tokens, how much of them each candidate's cache holds,
and the choice (docs/behaviour.md#routing-policies; the arithmetic is ``policies.kv_choice``).

Tokens come from vLLM's own ``POST /tokenize`` on the instance the prefix policy would pick:
it applies the served model's chat template exactly as the prefill will, so the blocks we
hash are the blocks the engine hashed. The ``tokenizers`` library would save the round trip
(measured on this machine against vLLM 0.32, tiny-llama, a 392-token chat: /tokenize 1.75 ms
p50, 11 ms p99, ~0.35 ms of proxy CPU; ``tokenizers.encode`` 0.13 ms of CPU) but cannot apply
a chat template, and would need every model's tokenizer files beside the proxy. The call is
made only for a ``kv_aware`` role, only when some candidate has a picture, once per request
(the router puts the tokens in the request's ``RouteRequest``), bounded by
``kv_tokenize_timeout``; any failure routes by prefix, never fails the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from epd_flask.control.roster import Instance
from epd_flask.core import jsoncodec
from epd_flask.core.errors import BackendError, ProxyError
from epd_flask.core.tracing import CallTrace, RequestTrace
from epd_flask.fleet import policies
from epd_flask.fleet.kvcache import MAX_TOKEN_ID, Picture, are_token_ids, prompt_keys
from epd_flask.fleet.policies import Decision, Load, Placement, Prefix, RouteRequest
from epd_flask.upstream.transport import Transport

logger = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"
STAGE = "tokenize"
#: The chat fields that change what the template renders (vLLM's TokenizeChatRequest).
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
               "chat_template", "chat_template_kwargs", "tools")
#: A prompt longer than this many blocks is matched on its first ones only.
MAX_PROMPT_BLOCKS = 4096
NO_TOKENS: tuple[int, ...] = ()


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """What to ask ``/tokenize`` for ``body``'s prompt; the tokens themselves when the
    client sent token ids; None when there is nothing to match (a batch, media, no prompt)."""
    model = body.get("model")
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                    not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return None  # media: its blocks are hashed with the media, never matched
        doc = {"model": model, "messages": messages}
        doc.update({k: body[k] for k in CHAT_FIELDS if k in body})
        return doc
    prompt = body.get("prompt")
    # Ids a block name cannot hold (no vocabulary has them) leave nothing to match: the
    # prefill judges them as vLLM does (400), never us.
    if isinstance(prompt, list) and prompt and are_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, str) and prompt:
        doc = {"model": model, "prompt": prompt}
        if "add_special_tokens" in body:
            doc["add_special_tokens"] = body["add_special_tokens"]
        return doc
    return None


def parse_tokens(doc: Any) -> list[int]:
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(tokens, list) or not are_token_ids(tokens):
        raise ValueError(f"/tokenize answered no list of token ids in 0..{MAX_TOKEN_ID}")
    return tokens


def held_tokens(picture: Picture, tokens: Sequence[int]) -> int | None:
    """How many of the prompt's ``tokens``, from the first, ``picture``'s instance holds (None:
    its block size is not known yet, so nothing can be matched)."""
    size = picture.block_size
    if not size:
        return None
    return picture.matched(prompt_keys(tokens, size, MAX_PROMPT_BLOCKS), tokens) * size


class KVAware(Prefix):
    """The prefix choice, overruled by the candidates' cached blocks when they can be
    compared: on a prefill, where the prompt would be done first (``kv_cost_choice``); on
    another role, the most blocks under the load bound (``kv_choice``)."""

    needs_tokens = True

    def worth_tokens(self, candidates: Sequence[Placement]) -> bool:
        return any(self.env.pictures(c.url) is not None for c in candidates)

    def choose(self, candidates: Sequence[Placement], request: RouteRequest,
               load: Load) -> Decision:
        prefix = super().choose(candidates, request, load)
        if prefix.outcome == policies.NOKEY:
            return prefix
        pictures: dict[str, Picture] = {}
        for placed in candidates:
            picture = self.env.pictures(placed.url)
            if picture is not None:
                pictures[placed.url] = picture
        if not pictures:
            return self._fallback(prefix, self.env.no_pictures([c.url for c in candidates]))
        tokens = request.tokens
        if not tokens:
            return self._fallback(prefix, "notokens")
        keys: dict[int, list[bytes]] = {}
        matched: dict[str, int] = {}
        for url, picture in pictures.items():
            size = picture.block_size or 0
            if size not in keys:
                keys[size] = prompt_keys(tokens, size, MAX_PROMPT_BLOCKS)
            matched[url] = picture.matched(keys[size], tokens)
        blocks = max(len(k) for k in keys.values())
        order = policies.rendezvous_order(request.prefix, candidates) \
            if request.prefix is not None else list(candidates)
        if load.tokens:
            sizes = {url: picture.block_size or 0 for url, picture in pictures.items()}
            return policies.kv_cost_choice(order, matched, sizes, blocks, len(tokens),
                                           load.measure, prefix, self.name)
        return policies.kv_choice(order, matched, blocks, load.calls,
                                  self.env.settings().routing_load_factor, prefix, self.name)

    def _fallback(self, prefix: Decision, reason: str) -> Decision:
        return Decision(prefix.target, self.name, policies.FALLBACK, f"{reason},{prefix.why}")


class Tokenizer:
    """The prompt's token ids from an instance's ``/tokenize``; remembers which instances
    fail, to warn once per outage."""

    def __init__(self, transport: Transport, timeout: Callable[[], float],
                 headers: dict[str, str] | None = None) -> None:
        self.transport = transport
        self.timeout = timeout
        self.headers = headers or {}
        self._failing: set[str] = set()

    def forget(self, kept: frozenset[str]) -> None:
        """Only instances still listed stay remembered as failing."""
        self._failing &= kept

    def tokens(self, body: dict[str, Any], instance: Instance,
               headers: dict[str, str] | None = None,
               trace: RequestTrace | None = None) -> tuple[int, ...]:
        """``body``'s prompt as token ids, asked of ``instance`` (empty: unknown); the call
        is a span of the request's ``trace``, if it has one."""
        wanted = tokenize_request(body)
        if isinstance(wanted, list):
            return tuple(wanted)
        if wanted is None:
            return NO_TOKENS
        headers = headers if headers is not None else self.headers
        span = trace.call(STAGE, instance.role, instance.url) if trace is not None else None
        if span is not None:
            headers = {**headers, **span.headers}
        return tuple(self._tokenize(instance.url, wanted, headers, span))

    def _tokenize(self, url: str, doc: dict[str, Any], headers: dict[str, str],
                  span: CallTrace | None) -> Sequence[int]:
        timeout = self.timeout()
        status: int | None = None
        failure: ProxyError | None = None
        try:
            resp = self.transport.post_json(url + TOKENIZE_PATH, doc, stage=STAGE,
                                            headers=headers, read_timeout=timeout,
                                            total_timeout=timeout)
            status = resp.status_code
            raw = self.transport.read_body(resp, STAGE, max_bytes=self.transport.max_answer_bytes)
            if status != 200:
                raise ValueError(f"/tokenize answered {status}")
            tokens = parse_tokens(jsoncodec.loads_ids(raw))
        except (ProxyError, ValueError) as exc:
            failure = exc if isinstance(exc, ProxyError) else BackendError(
                str(exc), code="bad_tokenize_answer", stage=STAGE, instance=url)
            if url not in self._failing:
                self._failing.add(url)
                logger.warning("kv_aware: cannot tokenize on %s (%s); routing by prefix while "
                               "it cannot", url, getattr(exc, "message", None) or exc)
            return NO_TOKENS
        finally:
            if span is not None:
                span.end(status, failure)
        if url in self._failing:
            self._failing.discard(url)
            logger.info("kv_aware: %s tokenizes again", url)
        return tokens
