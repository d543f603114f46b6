"""What an encoder sees in a chat request: the media items, the key each is stored under, and
the metadata an encoder hands the language model with it (``ec_transfer_params``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

MEDIA_TYPES = ("image_url", "audio_url", "input_audio", "video_url")
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


def _item(index: int, part: dict[str, Any]) -> MediaItem:
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
    return MediaItem(index=index, kind=kind, key=key, size=len(source))


def extract_items(messages: list[Any]) -> list[MediaItem]:
    """Media items of all messages' content lists, numbered in order of appearance."""
    items: list[MediaItem] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in MEDIA_TYPES:
                items.append(_item(len(items), part))
    return items


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


def ec_transfer_params(items: list[MediaItem], mode: str) -> dict[str, Any]:
    """``{key: {"item_indices": [...], "metadata": {...}}}``; a repeated item lists every index."""
    params: dict[str, Any] = {}
    for item in items:
        entry = params.get(item.key)
        if entry is None:
            params[item.key] = {"item_indices": [item.index],
                                "metadata": item_metadata(item, mode)}
        else:
            entry["item_indices"].append(item.index)
    return params
