"""What the proxy refuses in a completion body itself, before any backend hears of it.

The rule for what is checked here: the fields the proxy reads, rewrites or branches on
(``messages`` and their content parts for the encode stage, ``max_tokens`` and friends and
``stream``/``stream_options`` for the prefill rewrite, ``prompt``, ``model``) must have the types
OpenAI's API documents, judged as JSON Schema judges them (``5.0`` is an integer, ``"5"`` and
``true`` are not). A wrong type there would otherwise cost an encoder and a prefill call before
decode refused it, or be silently rewritten away by the prefill body
(docs/behaviour.md#prefill-and-decode). Everything else (value ranges that need the model,
sampling parameters, tools, unknown fields) is vLLM's to judge; its 4xx answer is relayed as it
wrote it (docs/behaviour.md#edge). Plain functions over the parsed body; imports only
``errors``.
"""

from __future__ import annotations

from typing import Any

from epd_flask.core.errors import ClientError

CHAT_PATH = "/v1/chat/completions"
#: Content part types whose payload is ``{"url": str}`` (vLLM also takes a bare URL string).
URL_PARTS = ("image_url", "audio_url", "video_url")
#: Integer fields that are token counts, with the smallest value vLLM accepts.
TOKEN_LIMITS = {"max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 0}


def check_completion(path: str, body: dict[str, Any]) -> None:
    """Raise ``ClientError`` (400, ``param`` naming the field) for what we refuse ourselves.

    The body's size, encoding and nesting were checked at the edge (edge.py) already.
    """
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise _invalid("model", "a string", body["model"])
    for name, least in TOKEN_LIMITS.items():
        _check_count(body, name, least)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _invalid("stream", "a boolean", body["stream"])
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("stream_options", "an object", options)
    if path == CHAT_PATH:
        _check_messages(body)
    else:
        _check_prompt(body)


def _check_count(body: dict[str, Any], name: str, least: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if not _is_integer(value):
        raise _invalid(name, "an integer", value)
    if value < least:
        raise ClientError(f"{name} must be at least {least}, got {value}", param=name,
                          code="invalid_value")


def _check_messages(body: dict[str, Any]) -> None:
    if "messages" not in body:
        raise ClientError("messages is required", param="messages", code="missing_required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _invalid("messages", "an array of message objects", messages)
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _invalid(where, "a message object", message)
        if not isinstance(message.get("role"), str):
            raise _invalid(f"{where}.role", "a string", message.get("role"))
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _invalid(f"{where}.content", "a string or an array of content parts",
                           content)
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content.{j}")


def _check_part(part: Any, where: str) -> None:
    """A content part the encode stage may read; part types we do not know are vLLM's."""
    if not isinstance(part, dict):
        raise _invalid(where, "a content part object", part)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _invalid(f"{where}.type", "a string", kind)
    if kind == "text" and not isinstance(part.get("text"), str):
        raise _invalid(f"{where}.text", "a string", part.get("text"))
    if kind in URL_PARTS:
        payload = part.get(kind)
        if isinstance(payload, dict):
            payload = payload.get("url")
            where = f"{where}.{kind}.url"
        else:
            where = f"{where}.{kind}"
        if not isinstance(payload, str):
            raise _invalid(where, "a URL string (or an object with one under \"url\")",
                           payload)
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise _invalid(f"{where}.input_audio", "an object with data and format", audio)
        for key in ("data", "format"):
            if not isinstance(audio.get(key), str):
                raise _invalid(f"{where}.input_audio.{key}", "a string", audio.get(key))


def _check_prompt(body: dict[str, Any]) -> None:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if "prompt" not in body or body["prompt"] is None:
        if body.get("prompt_embeds") is None:
            raise ClientError("prompt is required", param="prompt", code="missing_required")
        return
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return
    expected = "a string, an array of strings, or token ids"
    if not isinstance(prompt, list):
        raise _invalid("prompt", expected, prompt)
    if not (all(isinstance(one, str) for one in prompt)
            or all(_is_token(one) for one in prompt)
            or all(isinstance(one, list) and all(_is_token(t) for t in one)
                   for one in prompt)):
        raise ClientError(f"prompt must be {expected} (one kind throughout)", param="prompt",
                          code="invalid_type")


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(param: str, expected: str, got: Any) -> ClientError:
    return ClientError(f"{param} must be {expected}, got {_kind(got)}", param=param,
                       code="invalid_type")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
