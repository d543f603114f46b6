"""Media items of a chat request: find them, key them, batch them for encoders, match what
encoders report and rewrite the body for the next stage (docs/behaviour.md#encoders-and-rewriting).

Pure functions from dicts to dicts, no I/O. The client's body is never mutated, so a retry
(docs/behaviour.md#failover) re-encodes from the original media.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

MEDIA_TYPES = ("image_url", "audio_url", "input_audio", "video_url")
AUDIO_TYPES = frozenset({"audio_url", "input_audio"})
EMBEDS_TYPES = {
    "image_url": "image_embeds",
    "audio_url": "audio_embeds",
    "input_audio": "audio_embeds",
    "video_url": "video_embeds",
}
#: Request fields that change how media is processed, so the encoder must see them too.
ENCODER_PASSTHROUGH = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")
#: An entry with only these keys carries no connector handle of its own.
PLAIN_REPORT_KEYS = frozenset({"metadata", "item_indices"})
EC_PARAMS = "ec_transfer_params"

Body = dict[str, Any]
T = TypeVar("T")


class ReportError(ValueError):
    """An encoder's ``ec_transfer_params`` cannot be matched to the items it was sent."""


@dataclass(frozen=True)
class MediaItem:
    index: int  # position among the request's media items, in message order
    kind: str  # one of MEDIA_TYPES
    part: dict[str, Any] = field(repr=False)  # the content part as the client sent it
    key: str = ""  # the client's uuid, else content_key(part)


@dataclass(frozen=True)
class Batch(Generic[T]):
    """One encoder request: its target and the items it carries, in request order."""

    target: T
    items: tuple[MediaItem, ...]


@dataclass(frozen=True)
class Encoded:
    """What an encoder reported for one item, with what the proxy sent it."""

    uuid: str | None  # the uuid the encoder was sent (None without rewrite: no uuids)
    ec_key: str  # the key the encoder published under (it may rehash the uuid)
    metadata: dict[str, Any]
    entry: dict[str, Any]  # the whole reported entry: metadata plus connector handles
    transfer_id: str | None = None  # Mooncake EC push (docs/behaviour.md#routing)


def part_kind(part: Mapping[str, Any]) -> Any:
    """A content part's type as vLLM's chat parser reads it: its ``type``, else, for the simple
    forms vLLM accepts without one (``{"image_url": "https://..."}``), the media key present."""
    kind = part.get("type")
    if kind is None:
        for key in MEDIA_TYPES:
            if part.get(key) is not None:
                return key
    return kind


def content_key(part: Mapping[str, Any]) -> str:
    """A cache key from the item's content: its URL, else its canonical JSON.

    Content-derived and never per-request, so the same media in two requests shares one key
    and the encoder cache keeps serving it.
    """
    payload = part.get(part_kind(part) or "")
    url = payload if isinstance(payload, str) else (
        payload.get("url") if isinstance(payload, dict) else None)
    if isinstance(url, str) and url:
        source = url
    else:
        source = json.dumps({k: v for k, v in part.items() if k != "uuid"}, sort_keys=True,
                            separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def extract(body: Mapping[str, Any]) -> list[MediaItem]:
    """Every media item in ``messages[*].content`` lists, in order."""
    items: list[MediaItem] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part_kind(part) if isinstance(part, dict) else None
            if kind in MEDIA_TYPES:
                uuid = part.get("uuid")
                key = uuid if isinstance(uuid, str) and uuid else content_key(part)
                items.append(MediaItem(len(items), kind, part, key))
    return items


def plan_batches(items: Sequence[MediaItem], targets: Sequence[T],
                 max_batch: int = 0) -> list[Batch[T]]:
    """Group items by their assigned encoder: images to one encoder share a request of at
    most ``max_batch`` items (0: unlimited); audio and video go one per request."""
    if len(items) != len(targets):
        raise ValueError("every item needs exactly one target")
    order: list[tuple[T, list[MediaItem]]] = []
    open_images: dict[Any, list[MediaItem]] = {}
    for item, target in zip(items, targets, strict=True):
        if item.kind != "image_url":
            order.append((target, [item]))
            continue
        group = open_images.get(target)
        if group is None or (max_batch and len(group) >= max_batch):
            group = open_images[target] = []
            order.append((target, group))
        group.append(item)
    return [Batch(target, tuple(group)) for target, group in order]


def encoder_body(body: Mapping[str, Any], items: Sequence[MediaItem], *, send_uuids: bool,
                 consumer_zmq: str | None = None,
                 transfer_ids: Mapping[int, str] | None = None) -> Body:
    """One encoder request: the media only (no text), the model, no streaming.

    With ``send_uuids`` each item carries its key so the encoder publishes under the same key
    the next stage will ask for. With a push consumer (docs/behaviour.md#routing) the encoder
    learns its control address and one transfer id per item, in item order.
    """
    content = [{**i.part, "uuid": i.key} if send_uuids else i.part for i in items]
    out: Body = {}
    if "model" in body:
        out["model"] = body["model"]
    out["messages"] = [{"role": "user", "content": content}]
    out["stream"] = False
    for name in ENCODER_PASSTHROUGH:
        if name in body:
            out[name] = body[name]
    if consumer_zmq is not None:
        ids = transfer_ids or {}
        out[EC_PARAMS] = {"consumer_zmq": consumer_zmq,
                          "ec_items": [{"transfer_id": ids[i.index]} for i in items]}
    return out


def match_batch(items: Sequence[MediaItem], params: Any, *, send_uuids: bool,
                audio_in_video: bool = False,
                transfer_ids: Mapping[int, str] | None = None) -> dict[int, Encoded]:
    """Pair each item of one batch with the entry its encoder reported.

    By ``item_indices`` (positions in the batch) first, else by the key the item was sent,
    else the single entry of a single-item batch. A video whose audio was encoded with it
    (two plain entries, no push handles) stays raw. Anything else unmatched, and indices out
    of range or repeated, raise ``ReportError``. An empty report matches nothing.
    """
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ReportError("ec_transfer_params is not a JSON object")
    if not params:
        return {}
    for key, entry in params.items():
        if not isinstance(entry, dict):
            raise ReportError(f"the entry for {key!r} is not a JSON object")
    ids = transfer_ids or {}
    by_index: dict[int, str] = {}
    if len(items) > 1:
        for key, entry in params.items():
            indices = entry.get("item_indices")
            if indices is None:
                continue
            if not isinstance(indices, list):
                raise ReportError(f"item_indices of {key!r} is not a list")
            for position in indices:
                if type(position) is not int or not 0 <= position < len(items):
                    raise ReportError(f"item index {position!r} is out of range for a batch "
                                      f"of {len(items)}")
                if position in by_index:
                    raise ReportError(f"item index {position} is reported twice")
                by_index[position] = key
    out: dict[int, Encoded] = {}
    for position, item in enumerate(items):
        uuid = item.key if send_uuids else None
        key = by_index.get(position)
        if key is None:
            if uuid is not None and uuid in params:
                key = uuid
            elif len(items) == 1 and len(params) == 1:
                key = next(iter(params))
            elif (item.kind == "video_url" and audio_in_video and len(params) == 2
                  and item.index not in ids
                  and all(e.keys() <= PLAIN_REPORT_KEYS for e in params.values())):
                continue
            else:
                raise ReportError(f"no reported entry matches media item {item.index} "
                                  f"({item.kind})")
        entry = params[key]
        metadata = entry.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ReportError(f"metadata of {key!r} is not a JSON object")
        out[item.index] = Encoded(uuid, key, metadata, entry, ids.get(item.index))
    return out


def flatten_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """One flat vector per key: the next stage stacks items, so a per-item ``[[1, 4, 4]]``
    becomes ``[1, 4, 4]``; scalars stay scalars."""
    return {k: [x for v in value for x in (v if isinstance(v, list) else [v])]
            if isinstance(value, list) else value for k, value in metadata.items()}


def rewrite(body: Mapping[str, Any], items: Sequence[MediaItem],
            encoded: Mapping[int, Encoded]) -> Body:
    """The next stage's body: each item with metadata becomes a ``<kind>_embeds``
    reference under its uuid; the rest stay raw media but carry the uuid the encoder got, so
    the next stage finds the embedding by that key. If any audio item cannot be rewritten,
    every item stays raw (audio processors count other modalities' placeholders too).
    Push transfer ids go to ``ec_transfer_params.ec_items``.
    """
    if not items:
        return dict(body)
    raw_request = any(i.kind in AUDIO_TYPES for i in items) and any(
        i.index not in encoded or not encoded[i.index].metadata for i in items)
    transfers: list[dict[str, str]] = []
    messages = []
    position = 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        new_content = []
        for part in content:
            if not (isinstance(part, dict) and part_kind(part) in MEDIA_TYPES):
                new_content.append(part)
                continue
            item = items[position]
            position += 1
            enc = encoded.get(item.index)
            uuid = (enc.uuid or enc.ec_key) if enc else item.key
            if enc is not None and enc.metadata and not raw_request:
                kind = EMBEDS_TYPES[item.kind]
                new_content.append({"type": kind, kind: flatten_metadata(enc.metadata),
                                    "uuid": uuid})
            else:
                new_content.append({**part, "uuid": uuid})
            if enc is not None and enc.transfer_id is not None:
                transfers.append({"mm_hash": enc.ec_key, "transfer_id": enc.transfer_id})
        messages.append({**message, "content": new_content})
    out = {**body, "messages": messages}
    if transfers:
        out[EC_PARAMS] = {**_client_ec_params(body), "ec_items": transfers}
    return out


def attach_handles(body: Mapping[str, Any], encoded: Mapping[int, Encoded], *,
                   rewritten: bool) -> Body:
    """Carry each reported entry (the connector's handle) to the next stage under its key.

    Without a rewrite (``rewrite_media: false``) the push transfer ids are added here, since
    ``rewrite`` did not.
    """
    handles: dict[str, Any] = {}
    for index in sorted(encoded):
        handles[encoded[index].ec_key] = encoded[index].entry
    if not rewritten:
        transfers = [{"mm_hash": encoded[i].ec_key, "transfer_id": encoded[i].transfer_id}
                     for i in sorted(encoded) if encoded[i].transfer_id is not None]
        if transfers:
            handles["ec_items"] = transfers
    if not handles:
        return dict(body)
    return {**body, EC_PARAMS: {**_client_ec_params(body), **handles}}


def _client_ec_params(body: Mapping[str, Any]) -> dict[str, Any]:
    params = body.get(EC_PARAMS)
    return dict(params) if isinstance(params, dict) else {}
