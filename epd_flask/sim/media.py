"""What an encoder sees in a chat request: the media items, the key each is stored under, and
the metadata an encoder hands the language model with it (``ec_transfer_params``); and what a
language model sees: raw media and ``*_embeds`` references to embeddings encoded elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

MEDIA_TYPES = ("image_url", "audio_url", "input_audio", "video_url")
EMBEDS_TYPES = ("image_embeds", "audio_embeds", "video_embeds")
#: Bytes of media data per grid cell edge step; only has to grow with the data, deterministically.
GRID_BYTES_PER_CELL = 256
VIDEO_FRAMES = 2


@dataclass(frozen=True)
class MediaItem:
    index: int  # position among the request's media items, in message order
    kind: str  # one of MEDIA_TYPES
    key: str  # the uuid the client gave, else a sha256 of the URL (or of the item's JSON)
    size: int  # length of the URL or data, the sim's proxy for the media's size


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def rehash(key: str, processor_kwargs: Any) -> str:
    """vLLM folds processing options into an item's hash, so with ``mm_processor_kwargs`` the
    key an engine stores under differs from the uuid it was given (on every engine alike)."""
    if not isinstance(processor_kwargs, dict) or not processor_kwargs:
        return key
    return hashlib.sha256(f"{key}\n{_canonical_json(processor_kwargs)}".encode()).hexdigest()


def audio_of_video_key(key: str) -> str:
    return hashlib.sha256(f"{key}#audio".encode()).hexdigest()


def _item(index: int, part: dict[str, Any], processor_kwargs: Any = None) -> MediaItem:
    kind = part["type"]
    payload = part.get(kind)
    url = None
    if isinstance(payload, str):
        url = payload
    elif isinstance(payload, dict) and isinstance(payload.get("url"), str):
        url = payload["url"]
    source = url if url is not None else _canonical_json(payload)
    uuid = part.get("uuid")
    key = uuid if isinstance(uuid, str) and uuid else hashlib.sha256(
        source.encode("utf-8")).hexdigest()
    return MediaItem(index=index, kind=kind, key=rehash(key, processor_kwargs),
                     size=len(source))


def _parts(messages: list[Any]) -> list[dict[str, Any]]:
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts.extend(p for p in content if isinstance(p, dict))
    return parts


def extract_items(messages: list[Any], processor_kwargs: Any = None) -> list[MediaItem]:
    """Media items of all messages' content lists, numbered in order of appearance."""
    items: list[MediaItem] = []
    for part in _parts(messages):
        if part.get("type") in MEDIA_TYPES:
            items.append(_item(len(items), part, processor_kwargs))
    return items


@dataclass(frozen=True)
class EmbedsRef:
    kind: str  # one of EMBEDS_TYPES
    key: str | None  # the uuid it names, as this engine would hash it; None: no uuid
    metadata: Any  # what the proxy sent to size the placeholders


def extract_embeds(messages: list[Any], processor_kwargs: Any = None) -> list[EmbedsRef]:
    """``*_embeds`` parts: references to embeddings another instance encoded."""
    refs = []
    for part in _parts(messages):
        kind = part.get("type")
        if kind in EMBEDS_TYPES:
            uuid = part.get("uuid")
            key = rehash(uuid, processor_kwargs) if isinstance(uuid, str) and uuid else None
            refs.append(EmbedsRef(kind, key, part.get(kind)))
    return refs


def item_metadata(item: MediaItem, mode: str) -> dict[str, Any]:
    """A plausible encoder output description; ``mode == "empty"`` mimics real LLaVA's ``{}``."""
    if mode == "empty":
        return {}
    side = 2 * max(1, math.isqrt(item.size // GRID_BYTES_PER_CELL))
    if item.kind == "image_url":
        return {"image_grid_thw": [1, side, side]}
    if item.kind == "video_url":
        return {"video_grid_thw": [VIDEO_FRAMES, side, side]}
    return {"audio_feature_lengths": side * side}


def ec_transfer_params(items: list[MediaItem], mode: str,
                       audio_in_video: bool = False) -> dict[str, Any]:
    """``{key: {"item_indices": [...], "metadata": {...}}}``; a repeated item lists every index.

    With ``use_audio_in_video`` a video's sound track is encoded as an item of its own, under
    a key of its own, reported for the same position.
    """
    params: dict[str, Any] = {}
    for item in items:
        entry = params.get(item.key)
        if entry is None:
            params[item.key] = {"item_indices": [item.index],
                                "metadata": item_metadata(item, mode)}
        else:
            entry["item_indices"].append(item.index)
        if audio_in_video and item.kind == "video_url":
            sound = MediaItem(item.index, "audio_url", audio_of_video_key(item.key), item.size)
            params.setdefault(sound.key, {"item_indices": [item.index],
                                          "metadata": item_metadata(sound, mode)})
    return params
