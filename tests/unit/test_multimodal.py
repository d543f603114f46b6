"""The pure multimodal rules of docs/behaviour.md#encoders-and-rewriting: items, keys, batches,
matching, rewrite and the no-rewrite switch.

Each rule of the catalogue is one row (or more) of a table below.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest

from epd_flask.serving import multimodal as mm
from epd_flask.serving.multimodal import Encoded, ReportError

IMG_A = {"type": "image_url", "image_url": {"url": "https://media.invalid/a.png"}}
IMG_B = {"type": "image_url", "image_url": {"url": "https://media.invalid/b.png"}}
IMG_C = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}
AUDIO = {"type": "audio_url", "audio_url": {"url": "https://media.invalid/a.wav"}}
INPUT_AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "https://media.invalid/v.mp4"}}
TEXT = {"type": "text", "text": "describe"}
GRID = {"image_grid_thw": [1, 4, 4]}


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": list(parts)}], **extra}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- extraction and keys ------------------------------------------------------------------------

def test_extract_finds_every_media_type_in_order_across_messages() -> None:
    body = {"messages": [
        {"role": "user", "content": [TEXT, IMG_A, {"type": "image_embeds"}, "junk"]},
        {"role": "assistant", "content": "plain text"},
        {"role": "user", "content": [AUDIO, INPUT_AUDIO, VIDEO]},
        "not a message",
    ]}
    items = mm.extract(body)
    assert [(i.index, i.kind) for i in items] == [
        (0, "image_url"), (1, "audio_url"), (2, "input_audio"), (3, "video_url")]
    assert items[0].part is body["messages"][0]["content"][1]


def test_media_without_a_type_is_media_as_vllm_reads_it() -> None:
    """vLLM's simple forms (``{"image_url": "..."}``, no ``type``) are images to its chat
    parser, so the encode stage encodes them too, under the same key as the typed form."""
    bare = {"image_url": "https://media.invalid/a.png"}
    video = {"video_url": {"url": "https://media.invalid/v.mp4"}, "type": None}
    items = mm.extract(chat(TEXT, bare, "text", video, {"audio_url": None}))
    assert [(i.kind, i.key) for i in items] == [
        ("image_url", mm.extract(chat(IMG_A))[0].key),
        ("video_url", sha("https://media.invalid/v.mp4"))]
    out = mm.rewrite(chat(TEXT, bare), items[:1], {0: enc(items[0], GRID)})
    assert out["messages"][1]["content"][1]["type"] == "image_embeds"


@pytest.mark.parametrize("body", [{}, {"messages": "x"}, {"prompt": "hi"},
                                  {"messages": [{"role": "user", "content": "hi"}]}])
def test_extract_without_media_is_empty(body: dict[str, Any]) -> None:
    assert mm.extract(body) == []


@pytest.mark.parametrize("part, expected", [
    (IMG_A, sha("https://media.invalid/a.png")),
    ({"type": "image_url", "image_url": "https://media.invalid/a.png"},
     sha("https://media.invalid/a.png")),
    ({**IMG_A, "uuid": "client-id"}, "client-id"),  # a client-supplied uuid wins
    ({**IMG_A, "uuid": ""}, sha("https://media.invalid/a.png")),  # an empty one does not
    (INPUT_AUDIO, sha('{"input_audio":{"data":"UklGRg==","format":"wav"},'
                      '"type":"input_audio"}')),
])
def test_keys_are_content_derived(part: dict[str, Any], expected: str) -> None:
    assert mm.extract(chat(part))[0].key == expected


def test_same_media_same_key_across_requests_and_key_order() -> None:
    shuffled = {"input_audio": {"format": "wav", "data": "UklGRg=="}, "type": "input_audio"}
    first = mm.extract(chat(IMG_A, INPUT_AUDIO))
    second = mm.extract(chat(TEXT, copy.deepcopy(IMG_A), shuffled, request_id="other"))
    assert [i.key for i in first] == [i.key for i in second]
    assert mm.extract(chat(IMG_B))[0].key != first[0].key


# -- batches and encoder bodies -----------------------------------------------------------------

@pytest.mark.parametrize("parts, targets, max_batch, expected", [
    # images on the same encoder share one request, in order of first appearance
    ([IMG_A, IMG_B, IMG_C], ["e0", "e1", "e0"], 0, [("e0", [0, 2]), ("e1", [1])]),
    # the cap splits a batch; the next image opens a new one
    ([IMG_A, IMG_B, IMG_C], ["e0", "e0", "e0"], 2, [("e0", [0, 1]), ("e0", [2])]),
    # audio and video always go alone
    ([AUDIO, VIDEO, INPUT_AUDIO], ["e0", "e0", "e0"], 0,
     [("e0", [0]), ("e0", [1]), ("e0", [2])]),
    # the must-show shape: 5 images + 1 audio over 2 encoders = 3 requests
    ([IMG_A, IMG_B, IMG_C, IMG_A, IMG_B, AUDIO], ["e0", "e1"] * 3, 0,
     [("e0", [0, 2, 4]), ("e1", [1, 3]), ("e1", [5])]),
    ([IMG_A, IMG_B, IMG_C, IMG_A], ["e0"] * 4, 1, [("e0", [i]) for i in range(4)]),
])
def test_plan_batches(parts, targets, max_batch, expected) -> None:
    batches = mm.plan_batches(mm.extract(chat(*parts)), targets, max_batch)
    assert [(b.target, [i.index for i in b.items]) for b in batches] == expected


def test_encoder_body_carries_media_only_and_the_passthrough_fields() -> None:
    body = chat(TEXT, IMG_A, IMG_B, max_tokens=9, temperature=0, stream=True, priority=3,
                mm_processor_kwargs={"fps": 1}, media_io_kwargs={"video": {}}, session_id="s",
                kv_transfer_params={"x": 1})
    items = mm.extract(body)
    out = mm.encoder_body(body, items, send_uuids=True)
    assert out == {
        "model": "m",
        "messages": [{"role": "user", "content": [
            {**IMG_A, "uuid": items[0].key}, {**IMG_B, "uuid": items[1].key}]}],
        "stream": False, "mm_processor_kwargs": {"fps": 1}, "media_io_kwargs": {"video": {}},
        "priority": 3, "session_id": "s",
    }
    bare = mm.encoder_body({"messages": []}, items, send_uuids=False)  # rewrite_media off: no uuids
    assert bare["messages"][0]["content"] == [IMG_A, IMG_B] and "model" not in bare


def test_encoder_body_names_the_push_consumer_and_transfer_ids() -> None:
    items = mm.extract(chat(IMG_A, IMG_B, IMG_C))
    out = mm.encoder_body({}, items[1:], send_uuids=True, consumer_zmq="tcp://c:1",
                          transfer_ids={0: "t0", 1: "t1", 2: "t2"})
    assert out["ec_transfer_params"] == {
        "consumer_zmq": "tcp://c:1", "ec_items": [{"transfer_id": "t1"}, {"transfer_id": "t2"}]}


# -- matching -----------------------------------------------------------------------------------

def entry(indices: Any = None, metadata: Any = None, **handles: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"metadata": GRID if metadata is None else metadata}
    if indices is not None:
        out["item_indices"] = indices
    out.update(handles)
    return out


K = "KEY"  # stands for "the key the proxy sent for this item"
MATCH_ROWS = [
    # id, parts, report (K0/K1.. are replaced by the items' keys), kwargs, expected ec_keys
    ("no report matches nothing", [IMG_A, IMG_B], None, {}, {}),
    ("empty report matches nothing", [IMG_A, IMG_B], {}, {}, {}),
    ("by item_indices, any order", [IMG_A, IMG_B, IMG_C],
     {"h2": entry([2]), "h0": entry([0]), "h1": entry([1])}, {}, {0: "h0", 1: "h1", 2: "h2"}),
    ("one entry for a repeated item", [IMG_A, IMG_A], {"h": entry([0, 1])}, {}, {0: "h", 1: "h"}),
    ("by the key when there are no indices", [IMG_A, IMG_B],
     {"K1": entry(), "K0": entry()}, {}, {0: "K0", 1: "K1"}),
    ("indices first, then the key", [IMG_A, IMG_B],
     {"h": entry([0]), "K1": entry()}, {}, {0: "h", 1: "K1"}),
    ("single item, single entry under another key", [IMG_A], {"rehashed": entry()}, {},
     {0: "rehashed"}),
    ("single item: indices are not read", [IMG_A], {"rehashed": entry([7])}, {},
     {0: "rehashed"}),
    ("single item: its key among several entries", [IMG_A],
     {"other": entry(), "K0": entry()}, {}, {0: "K0"}),
    ("video with its audio, plain entries: stays raw", [VIDEO],
     {"v": entry([0]), "a": entry([0])}, {"audio_in_video": True}, {}),
    ("video with its audio, its key reported: matched", [VIDEO],
     {"K0": entry([0]), "a": entry([0])}, {"audio_in_video": True}, {0: "K0"}),
    ("no rewrite: no uuids sent, matched by index", [IMG_A, IMG_B],
     {"x": entry([1]), "y": entry([0])}, {"send_uuids": False}, {0: "y", 1: "x"}),
    ("no rewrite: single entry still matches", [IMG_A], {"x": entry()}, {"send_uuids": False},
     {0: "x"}),
]
MISMATCH_ROWS = [
    ("report is not an object", [IMG_A], ["x"], {}, "not a JSON object"),
    ("entry is not an object", [IMG_A], {"h": [0]}, {}, "not a JSON object"),
    ("index out of range", [IMG_A, IMG_B], {"h": entry([2])}, {}, "out of range"),
    ("negative index", [IMG_A, IMG_B], {"h": entry([-1])}, {}, "out of range"),
    ("boolean index", [IMG_A, IMG_B], {"h": entry([True])}, {}, "out of range"),
    ("string index", [IMG_A, IMG_B], {"h": entry(["0"])}, {}, "out of range"),
    ("indices not a list", [IMG_A, IMG_B], {"h": entry(0)}, {}, "not a list"),
    ("duplicate index across entries", [IMG_A, IMG_B],
     {"h": entry([0]), "g": entry([0, 1])}, {}, "reported twice"),
    ("an item nobody reported", [IMG_A, IMG_B], {"h": entry([0])}, {}, "media item 1"),
    ("unknown keys, no indices", [IMG_A, IMG_B], {"x": entry(), "y": entry()}, {},
     "media item 0"),
    ("single item, two unrelated entries", [IMG_A], {"x": entry(), "y": entry()}, {},
     "media item 0"),
    ("no rewrite: the key fallback is gone", [IMG_A, IMG_B], {"K0": entry(), "K1": entry()},
     {"send_uuids": False}, "media item 0"),
    ("video+audio without the switch", [VIDEO], {"v": entry(), "a": entry()}, {},
     "media item 0"),
    ("video+audio with push handles to forward", [VIDEO], {"v": entry(), "a": entry()},
     {"audio_in_video": True, "transfer_ids": {0: "t"}}, "media item 0"),
    ("video+audio whose entries carry connector handles", [VIDEO],
     {"v": entry(peer_port=1), "a": entry()}, {"audio_in_video": True}, "media item 0"),
    ("metadata not an object", [IMG_A], {"h": entry(metadata=[1, 2])}, {}, "metadata"),
]


def _with_keys(report: Any, items: list[mm.MediaItem]) -> Any:
    if not isinstance(report, dict):
        return report
    names = {f"K{i.index}": i.key for i in items}
    return {names.get(k, k): v for k, v in report.items()}


@pytest.mark.parametrize("parts, report, kwargs, expected",
                         [r[1:] for r in MATCH_ROWS], ids=[r[0] for r in MATCH_ROWS])
def test_match_batch(parts, report, kwargs, expected) -> None:
    items = mm.extract(chat(*parts))
    kwargs = {"send_uuids": True, **kwargs}
    got = mm.match_batch(items, _with_keys(report, items), **kwargs)
    names = {i.key: f"K{i.index}" for i in items}
    assert {i: names.get(e.ec_key, e.ec_key) for i, e in got.items()} == expected
    for index, enc in got.items():
        assert enc.uuid == (items[index].key if kwargs["send_uuids"] else None)
        assert enc.metadata == GRID


@pytest.mark.parametrize("parts, report, kwargs, message",
                         [r[1:] for r in MISMATCH_ROWS], ids=[r[0] for r in MISMATCH_ROWS])
def test_match_batch_refuses(parts, report, kwargs, message) -> None:
    items = mm.extract(chat(*parts))
    kwargs = {"send_uuids": True, **kwargs}
    with pytest.raises(ReportError, match=message):
        mm.match_batch(items, _with_keys(report, items), **kwargs)


def test_match_keeps_the_whole_entry_and_the_transfer_id() -> None:
    items = mm.extract(chat(IMG_A, IMG_B))
    report = {"h0": entry([0], peer_host="e", peer_port=7), "h1": entry([1], metadata={})}
    got = mm.match_batch(items[:2], report, send_uuids=True, transfer_ids={0: "t0", 1: "t1"})
    assert got[0].entry == report["h0"] and got[0].transfer_id == "t0"
    assert got[1].metadata == {} and got[1].transfer_id == "t1"


def test_match_uses_positions_within_the_batch() -> None:
    items = mm.extract(chat(IMG_A, IMG_B, IMG_C, AUDIO))
    got = mm.match_batch([items[1], items[2]], {"b": entry([0]), "c": entry([1])},
                         send_uuids=True)
    assert {i: e.ec_key for i, e in got.items()} == {1: "b", 2: "c"}


# -- rewrite ------------------------------------------------------------------------------------

def enc(item: mm.MediaItem, metadata: dict[str, Any] | None = None, ec_key: str | None = None,
        transfer_id: str | None = None) -> Encoded:
    meta = GRID if metadata is None else metadata
    key = ec_key or item.key
    return Encoded(item.key, key, meta, {"metadata": meta}, transfer_id)


def media_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in body["messages"][1]["content"] if p.get("type") != "text"]


def embeds(kind: str, metadata: dict[str, Any], uuid: str) -> dict[str, Any]:
    return {"type": kind, kind: metadata, "uuid": uuid}


REWRITE_ROWS = [
    # id, parts, per-item metadata (None: not reported), expected per media item
    ("image with metadata becomes image_embeds", [IMG_A], [GRID],
     ["image_embeds"]),
    ("each kind maps to its embeds type", [IMG_A, AUDIO, INPUT_AUDIO, VIDEO],
     [GRID, {"audio_feature_lengths": 9}, {"audio_feature_lengths": 3},
      {"video_grid_thw": [2, 4, 4]}],
     ["image_embeds", "audio_embeds", "audio_embeds", "video_embeds"]),
    ("empty metadata: raw media with its uuid", [IMG_A, IMG_B], [GRID, {}],
     ["image_embeds", "raw"]),
    ("not reported: raw media with its uuid", [IMG_A, IMG_B], [None, GRID],
     ["raw", "image_embeds"]),
    ("an audio item without metadata keeps the whole request raw", [IMG_A, AUDIO],
     [GRID, {}], ["raw", "raw"]),
    ("an unreported item keeps an audio request raw", [IMG_A, INPUT_AUDIO],
     [None, {"audio_feature_lengths": 3}], ["raw", "raw"]),
    ("real LLaVA: {} for every item, all raw", [IMG_A, IMG_B], [{}, {}], ["raw", "raw"]),
]


@pytest.mark.parametrize("parts, metas, expected", [r[1:] for r in REWRITE_ROWS],
                         ids=[r[0] for r in REWRITE_ROWS])
def test_rewrite(parts, metas, expected) -> None:
    body = chat(TEXT, *parts, max_tokens=5)
    items = mm.extract(body)
    encoded = {i.index: enc(i, m) for i, m in zip(items, metas, strict=True) if m is not None}
    out = mm.rewrite(body, items, encoded)
    got = media_of(out)
    for item, part, want, meta in zip(items, got, expected, metas, strict=True):
        if want == "raw":
            assert part == {**item.part, "uuid": item.key}
        else:
            assert part == embeds(want, meta, item.key)
    assert out["messages"][1]["content"][0] == TEXT and out["messages"][0] == body["messages"][0]
    assert out["max_tokens"] == 5 and "ec_transfer_params" not in out


@pytest.mark.parametrize("metadata, flat", [
    ({"image_grid_thw": [[1, 4, 4]]}, {"image_grid_thw": [1, 4, 4]}),
    ({"image_grid_thw": [1, 4, 4]}, {"image_grid_thw": [1, 4, 4]}),
    ({"audio_feature_lengths": 16}, {"audio_feature_lengths": 16}),
    ({"a": [[1], 2, [3, 4]], "b": "s"}, {"a": [1, 2, 3, 4], "b": "s"}),
])
def test_metadata_is_one_flat_vector_per_key(metadata, flat) -> None:
    body = chat(IMG_A)
    items = mm.extract(body)
    out = mm.rewrite(body, items, {0: enc(items[0], metadata)})
    assert media_of(out)[0]["image_embeds"] == flat


def test_rewrite_uses_the_client_uuid_and_never_mutates_the_body() -> None:
    body = chat(TEXT, {**IMG_A, "uuid": "mine"}, AUDIO, ec_transfer_params={"client": 1})
    before = copy.deepcopy(body)
    items = mm.extract(body)
    out = mm.rewrite(body, items, {0: enc(items[0]), 1: enc(items[1], {"n": 1})})
    assert body == before
    assert media_of(out)[0]["uuid"] == "mine"
    out = mm.attach_handles(out, {0: enc(items[0])}, rewritten=True)
    assert body == before


def test_transfer_ids_go_to_ec_items_with_the_reported_key() -> None:
    body = chat(IMG_A, IMG_B, ec_transfer_params={"keep": True})
    items = mm.extract(body)
    encoded = {0: enc(items[0], ec_key="h0", transfer_id="t0"),
               1: enc(items[1], {}, ec_key="h1", transfer_id="t1")}
    out = mm.rewrite(body, items, encoded)
    assert out["ec_transfer_params"] == {"keep": True, "ec_items": [
        {"mm_hash": "h0", "transfer_id": "t0"}, {"mm_hash": "h1", "transfer_id": "t1"}]}
    assert media_of(out)[0]["uuid"] == items[0].key  # the uuid the encoder was sent


def test_raw_audio_request_still_lists_transfer_ids() -> None:
    body = chat(IMG_A, AUDIO)
    items = mm.extract(body)
    out = mm.rewrite(body, items, {0: enc(items[0], transfer_id="t0")})
    assert [p["type"] for p in media_of(out)] == ["image_url", "audio_url"]
    assert out["ec_transfer_params"]["ec_items"] == [{"mm_hash": items[0].key,
                                                      "transfer_id": "t0"}]


def test_attach_handles_carries_each_entry_under_its_key() -> None:
    body = chat(IMG_A, IMG_B, ec_transfer_params={"ec_items": ["from rewrite"]})
    e0 = Encoded("u0", "h0", GRID, {"metadata": GRID, "peer_port": 1}, "t0")
    e1 = Encoded("u1", "h1", {}, {"metadata": {}, "item_indices": [1]}, None)
    out = mm.attach_handles(body, {1: e1, 0: e0}, rewritten=True)
    assert out["ec_transfer_params"] == {"ec_items": ["from rewrite"], "h0": e0.entry,
                                         "h1": e1.entry}
    assert mm.attach_handles(body, {}, rewritten=True) == body


def test_m7_keeps_the_media_and_adds_handles_and_push_transfers() -> None:
    body = chat(IMG_A, IMG_B)
    items = mm.extract(body)
    e0 = Encoded(None, "h0", GRID, {"metadata": GRID}, "t0")
    out = mm.attach_handles(body, {0: e0}, rewritten=False)
    assert out["messages"] == body["messages"]
    assert out["ec_transfer_params"] == {"h0": e0.entry, "ec_items": [
        {"mm_hash": "h0", "transfer_id": "t0"}]}
    assert items[0].part is body["messages"][1]["content"][0]
