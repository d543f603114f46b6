"""What the proxy refuses in a completion body itself, before any backend hears of it.

The rule: refuse exactly what vLLM would refuse too, with its status (400), for the fields the
proxy reads, rewrites or branches on; everything else is vLLM's to judge and its 4xx answer is
relayed as it wrote it. Scalars (``model``, ``max_tokens`` and friends, ``stream``,
``stream_options``, ``n``, ``prompt``) are judged by serving/fields.py's copies of vLLM's
pydantic models in lax mode, so ``"5"`` and ``5.0`` are 5 and ``"true"`` is True, as there.
``messages`` follow vLLM's chat parser, whose refusals decide there (its model admits nearly
any part object). Value ranges are checked where vLLM's ``SamplingParams`` would refuse the
value whatever the model. Catching these here spares an encoder and a prefill call on a
request decode then refuses (docs/behaviour.md#edge).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from epd_flask.core.errors import ClientError
from epd_flask.serving import fields
from epd_flask.serving.multimodal import part_kind

CHAT_PATH = fields.CHAT_PATH
#: Content part types whose payload is ``{"url": str}`` (vLLM also takes a bare URL string).
URL_PARTS = ("image_url", "audio_url", "video_url")
#: What vLLM's chat parser makes of a part with no ``type`` and no media key.
MISSING_TYPE = "Missing 'type' field in multimodal part"
#: How to say what a field typed as a union accepts (pydantic reports each member apart).
UNION_FORMS = {"prompt": "a string, an array of strings, token ids (integers >= 0) or arrays "
                         "of token ids, one kind throughout"}


def check_completion(path: str, body: dict[str, Any]) -> None:
    """Raise ``ClientError`` (400, ``param`` naming the field) for what we refuse ourselves.

    The body's size, encoding and nesting were checked at the edge (edge.py) already.
    """
    try:
        read = fields.read(path, body)
    except ValidationError as exc:
        raise _refusal(exc) from None
    # vLLM's "before" validator reads the raw values: "stream": "false" passes it.
    if body.get("stream_options") and not body.get("stream"):
        raise ClientError("Stream options can only be defined when `stream=True`.",
                          param="stream_options", code="invalid_value")
    if path == CHAT_PATH:
        _check_messages(body)
    else:
        _check_prompt(body)
    _check_ranges(read)


def _check_ranges(read: fields.ChatFields | fields.CompletionFields) -> None:
    """The limits vLLM's ``SamplingParams`` enforces on the token counts it is given."""
    if isinstance(read, fields.ChatFields) and read.max_completion_tokens is not None:
        name, limit = "max_completion_tokens", read.max_completion_tokens
    else:
        name, limit = "max_tokens", read.max_tokens
    # A completion with echo and max_tokens 0 returns the prompt alone (vLLM sends 1 token).
    echo_only = isinstance(read, fields.CompletionFields) and read.echo and limit == 0
    if limit is not None and limit < 1 and not echo_only:
        raise ClientError(f"{name} must be at least 1, got {limit}", param=name,
                          code="invalid_value")
    if read.min_tokens < 0:
        raise ClientError(f"min_tokens must be at least 0, got {read.min_tokens}",
                          param="min_tokens", code="invalid_value")


def _refusal(exc: ValidationError) -> ClientError:
    """The first error, named by its field path (a union's member names left out)."""
    err = exc.errors(include_url=False)[0]
    path: list[str] = []
    for part in err["loc"]:
        if isinstance(part, str) and not part.isidentifier():
            break  # a union member's tag, e.g. "list[constrained-int]"
        path.append(str(part))
    param = ".".join(path)
    if len(path) < len(err["loc"]):
        return ClientError(f"{param} must be one of its documented forms: {UNION_FORMS[param]}",
                           param=param, code="invalid_type")
    return ClientError(f"{param}: {err['msg']} (got {_kind(err['input'])})", param=param,
                       code="invalid_type")


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
    """A content part as vLLM's chat parser takes it: a bare string is text; an object names
    its ``type`` or is one of the simple media forms (``{"image_url": "..."}``). Part types
    we do not read are vLLM's; media the encode stage reads must carry a URL (or audio)."""
    if isinstance(part, str):
        return
    if not isinstance(part, dict):
        raise _invalid(where, "a string or a content part object", part)
    kind = part_kind(part)
    if kind is None:
        raise ClientError(f"{where}: {MISSING_TYPE} (name its type, e.g. \"text\" or "
                          "\"image_url\")", param=f"{where}.type", code="invalid_type")
    if not isinstance(kind, str):
        raise _invalid(f"{where}.type", "a string", kind)
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
    """vLLM's own words and rule (the types were judged above)."""
    if body.get("prompt") in (None, "") and body.get("prompt_embeds") in (None, []):
        raise ClientError("Either prompt or prompt_embeds must be provided and non-empty.",
                          param="prompt", code="missing_required")


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
