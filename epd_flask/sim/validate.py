"""Turn a completion request's raw body into a ``Request``, refusing what vLLM 0.32 refuses with
the same status and error shape (FastAPI validation first, then vLLM's own checks).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from . import errors, textgen

CHAT_PATH = "/v1/chat/completions"
TOKENIZE_PATH = "/tokenize"
COMPLETIONS_PATH = "/v1/completions"
JSON_CONTENT_TYPE = "application/json"


@dataclass
class Request:
    """One validated completion request, as the roles see it."""

    chat: bool
    body: dict[str, Any]
    prompts: list[str]  # text hashed and counted per choice (chat: the rendered conversation)
    prompt_tokens: list[int]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    kv_params: dict[str, Any] | None
    messages: list[Any] = field(default_factory=list)
    # How many alternatives per token to report (completions' ``logprobs``, chat's
    # ``top_logprobs``); None: no logprobs asked for.
    logprobs: int | None = None
    # The name the answer carries: a LoRA adapter's when one was asked for, else the base's.
    model: str = ""
    # Per prompt, the token ids a completion was given instead of text (None for text): the
    # prefix cache keeps those very ids, as vLLM does.
    prompt_ids: list[list[int] | None] = field(default_factory=list)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)


def parse_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The JSON object in the body, or the 400 FastAPI would give for it."""
    if content_type.split(";", 1)[0].strip().lower() != JSON_CONTENT_TYPE:
        raise errors.unsupported_media_type()
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise errors.invalid_json(exc.start, "Invalid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise errors.invalid_json(exc.pos, exc.msg) from None
    if not isinstance(body, dict):
        raise errors.not_an_object(body)
    return body


_INT = TypeAdapter(int | None)
_BOOL = TypeAdapter(bool | None)


def _lax(adapter: TypeAdapter[Any], body: dict[str, Any], name: str, loc: str = "body") -> Any:
    """The field as vLLM's pydantic model reads it in lax mode ("5" is 5, "true" is True), or
    the 400 FastAPI gives for it."""
    value = body.get(name)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise errors.validation_error(err["type"], f"{loc}.{name}", err["msg"], value) from None


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    return _lax(_INT, body, name)


def _optional_bool(body: dict[str, Any], name: str, loc: str = "body") -> bool:
    return bool(_lax(_BOOL, body, name, loc))


def _optional_dict(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None or isinstance(value, dict):
        return value
    raise errors.validation_error(
        "dict_type", f"body.{name}", "Input should be a valid dictionary", value)


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt] if prompt else []
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
    elif prompt is None:
        prompts = []
    else:
        raise errors.validation_error(
            "string_type", "body.prompt", "Input should be a valid string", prompt)
    for one in prompts:
        ok = (isinstance(one, str) and one) or (
            isinstance(one, list) and one and all(isinstance(t, int) for t in one))
        if not ok:
            prompts = []
            break
    if not prompts:
        raise errors.bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    return prompts


def _chat_messages(body: dict[str, Any]) -> list[Any]:
    if "messages" not in body:
        raise errors.missing_field("messages", body)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise errors.validation_error(
            "list_type", "body.messages", "Input should be a valid list", messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise errors.validation_error(
                "model_attributes_type", f"body.messages.{i}",
                "Input should be a valid dictionary or object to extract fields from", message)
    return messages


def parse_request(
    path: str, body: dict[str, Any], served_model: str, max_model_len: int,
    adapters: Collection[str] = (),
) -> Request:
    """Validate a parsed body for ``path`` in vLLM's order: schema, model, prompt, lengths."""
    chat = path == CHAT_PATH
    if chat:
        messages = _chat_messages(body)
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
    else:
        messages = []
        max_name = "max_tokens"
    max_tokens = _optional_int(body, max_name)
    stream = _optional_bool(body, "stream")
    if chat:
        logprobs = (_optional_int(body, "top_logprobs") or 0) if _optional_bool(
            body, "logprobs") else None
    else:
        logprobs = _optional_int(body, "logprobs")
    stream_options = _optional_dict(body, "stream_options") or {}
    kv_params = _optional_dict(body, "kv_transfer_params")

    model = body.get("model")
    if model and model != served_model and model not in adapters:
        raise errors.model_not_found(str(model), served_model)

    raw = [textgen.render_chat(messages)] if chat else _completion_prompts(body)
    prompts = [textgen.completion_prompt_text(one) for one in raw]
    prompt_tokens = [textgen.count_tokens(p) for p in prompts]

    if max_tokens is not None:
        if max_tokens < 1:
            raise errors.bad_request(f"max_tokens must be at least 1, got {max_tokens}.",
                                     max_name, max_tokens)
        if max_tokens > max_model_len:
            raise errors.bad_request(
                f"{max_name}={max_tokens} cannot be greater than max_model_len="
                f"{max_model_len}. Please request fewer output tokens.",
                max_name, max_tokens)
    longest = max(prompt_tokens)
    if longest >= max_model_len:
        raise errors.bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {longest} input tokens. Please reduce the length of the input.",
            "prompt")
    if max_tokens is not None and longest + max_tokens > max_model_len:
        raise errors.bad_request(
            f"'{max_name}' is too large: {max_tokens}. This model's maximum context length "
            f"is {max_model_len} tokens and your request has {longest} input tokens "
            f"({max_tokens} > {max_model_len} - {longest}).",
            max_name, max_tokens)

    return Request(
        model=model if model and model in adapters else served_model,
        chat=chat,
        body=body,
        prompts=prompts,
        prompt_ids=[one if isinstance(one, list) else None for one in raw],
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_optional_bool(stream_options, "include_usage", "body.stream_options"),
        kv_params=kv_params,
        messages=messages,
        logprobs=logprobs,
    )


def parse_tokenize(
    body: dict[str, Any], served_model: str, adapters: Collection[str] = ()
) -> tuple[str, bool]:
    """``POST /tokenize``'s body (vLLM's TokenizeCompletionRequest or TokenizeChatRequest) as
    (the prompt the sim would compute, rendered as a completion would render it; whether the
    token texts are wanted)."""
    if "messages" in body:
        messages = _chat_messages(body)
        add_generation_prompt = _lax(_BOOL, body, "add_generation_prompt")
        prompt = textgen.render_chat(
            messages, True if add_generation_prompt is None else add_generation_prompt)
    elif "prompt" not in body:
        raise errors.missing_field("prompt", body)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise errors.validation_error(
                "string_type", "body.prompt", "Input should be a valid string", prompt)
    want_strs = _optional_bool(body, "return_token_strs")
    model = body.get("model")
    if model and model != served_model and model not in adapters:
        raise errors.model_not_found(str(model), served_model)
    return prompt, want_strs
