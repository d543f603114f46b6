"""The completion fields the proxy reads, typed as vLLM's request models type them.

vLLM validates a body with pydantic in lax mode (``ChatCompletionRequest`` in
``vllm/entrypoints/openai/chat_completion/protocol.py``, ``CompletionRequest`` in
``.../completion/protocol.py``), so ``"max_tokens": "5"`` is 5 and ``"stream": "true"`` is
True there. The proxy must accept what vLLM accepts and act on what vLLM will make of it, so
the models here copy vLLM's field types for the fields the proxy reads, and the helpers give
the serving path the same coerced values. The client's body itself is forwarded as sent; vLLM
coerces it again. ``messages`` are not typed here: vLLM's model admits nearly any part object
and judges parts in its chat parser, which web/validation.py mirrors by hand.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

CHAT_PATH = "/v1/chat/completions"

TokenId = Annotated[int, Field(ge=0)]


class _Lax(BaseModel):
    """Lax like vLLM's ``OpenAIBaseModel``; other fields are vLLM's to judge."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lax):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Common(_Lax):
    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class ChatFields(_Common):
    max_completion_tokens: int | None = None
    n: int | None = 1


class CompletionFields(_Common):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    max_tokens: int | None = 16
    n: int = 1
    echo: bool | None = False


_FLAG = TypeAdapter(bool | None)
_COUNT = TypeAdapter(int | None)


def read(path: str, body: dict[str, Any]) -> ChatFields | CompletionFields:
    """The body's fields as vLLM reads them; ``pydantic.ValidationError`` where it refuses."""
    model = ChatFields if path == CHAT_PATH else CompletionFields
    return model.model_validate(body)


def flag(value: Any) -> bool:
    """A boolean field as vLLM reads it (``"false"`` is False); unreadable counts as False."""
    try:
        return bool(_FLAG.validate_python(value))
    except ValidationError:
        return False


def count(value: Any) -> int | None:
    """An integer field as vLLM reads it (``"5"`` and ``5.0`` are 5); None if unreadable."""
    try:
        return _COUNT.validate_python(value)
    except ValidationError:
        return None


def streams(body: dict[str, Any]) -> bool:
    """Whether vLLM answers this body with a stream."""
    return flag(body.get("stream"))
