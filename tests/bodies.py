"""The request bodies tests send (to the proxy, the simulator, real vLLM): one builder per
kind, so a test writes out only the fields it is about and every other field is the same
everywhere. A body whose odd shape is the point of its test stays written out in that test."""

from __future__ import annotations

import base64
import os
from typing import Any

MODEL = "tiny-llama"
STORY = "tell me a story"
PROMPT = "hello world"
LOOK = "what is this?"


def chat(content: str | list[Any] = STORY, **fields: Any) -> dict[str, Any]:
    """A chat completion of one user message; ``fields`` add to the body or replace its own
    (``model=...``)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def conversation(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A chat completion of several messages (a system prompt, earlier turns)."""
    return {"model": MODEL, "messages": messages, **fields}


def chat_stream(content: str | list[Any] = STORY, **fields: Any) -> dict[str, Any]:
    return chat(content, stream=True, **fields)


def completion(prompt: str | list[Any] = PROMPT, **fields: Any) -> dict[str, Any]:
    """A completion of ``prompt``; ``fields`` as for ``chat``."""
    return {"model": MODEL, "prompt": prompt, **fields}


def completion_stream(prompt: str | list[Any] = PROMPT, **fields: Any) -> dict[str, Any]:
    return completion(prompt, stream=True, **fields)


def multimodal(*media: dict[str, Any], words: str = LOOK, **fields: Any) -> dict[str, Any]:
    """A chat whose one message is a question (``words``) and the media parts to answer it
    about, in that order."""
    return chat([text(words), *media], **fields)


# -- content parts ----------------------------------------------------------------------------

def text(words: str) -> dict[str, Any]:
    return {"type": "text", "text": words}


def image(url: str | None = None, size: int = 1200) -> dict[str, Any]:
    """An ``image_url`` part: ``url``, or else a fresh data URL of ``size`` random bytes, so
    one test's encodings never satisfy another's lookups."""
    if url is None:
        url = f"data:image/png;base64,{base64.b64encode(os.urandom(size)).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def audio(size: int = 600) -> dict[str, Any]:
    """A fresh ``input_audio`` part (inline data, no URL)."""
    data = base64.b64encode(os.urandom(size)).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def video() -> dict[str, Any]:
    """A fresh ``video_url`` part."""
    return {"type": "video_url",
            "video_url": {"url": f"https://media.invalid/{os.urandom(8).hex()}.mp4"}}
