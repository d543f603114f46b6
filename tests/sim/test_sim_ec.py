"""The simulated EC path: what encoders publish and how a language model finds it."""

from __future__ import annotations

import requests

from epd_flask.sim import media
from tests.bodies import chat, image


def _chat(url: str, content, **extra) -> requests.Response:
    body = chat(content, **{"max_tokens": 2, **extra})
    return requests.post(url + "/v1/chat/completions", json=body, timeout=5)


def test_lm_uses_published_embeddings_and_encodes_the_rest(start_sim):
    enc, lm = start_sim(role="encode"), start_sim(role="prefill_decode")
    known, unknown = image(), image()
    ec = _chat(enc.url, [known]).json()["ec_transfer_params"]
    ((key, entry),) = ec.items()
    ref = {"type": "image_embeds", "image_embeds": entry["metadata"], "uuid": key}
    assert _chat(lm.url, [ref, known, unknown]).status_code == 200
    stats = lm.state.stats()
    assert stats["ec_embeds_resolved"] == 1
    assert (stats["media_from_ec"], stats["media_encoded_locally"]) == (1, 1)


def test_a_reference_to_nothing_is_vllms_500_and_a_wrong_size_is_counted(start_sim):
    enc, lm = start_sim(role="encode"), start_sim(role="decode")
    missing = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]},
               "uuid": "never-encoded"}
    resp = _chat(lm.url, [missing])
    assert resp.status_code == 500 and "never-encoded" in resp.json()["error"]["message"]
    assert lm.state.stats()["ec_embeds_unresolved"] == 1
    img = image()
    key = next(iter(_chat(enc.url, [img]).json()["ec_transfer_params"]))
    wrong = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 64, 64]},
             "uuid": key}
    assert _chat(lm.url, [wrong]).status_code == 200
    assert lm.state.stats()["ec_embeds_mismatched"] == 1


def test_processing_options_rehash_keys_and_video_audio_is_reported_twice(start_sim):
    enc = start_sim(role="encode")
    vid = {"type": "video_url", "video_url": {"url": "https://m.invalid/v.mp4"}, "uuid": "v1"}
    kwargs = {"use_audio_in_video": True}
    ec = _chat(enc.url, [vid], mm_processor_kwargs=kwargs).json()["ec_transfer_params"]
    video_key = media.rehash("v1", kwargs)
    assert set(ec) == {video_key, media.audio_of_video_key(video_key)}
    assert all(e["item_indices"] == [0] for e in ec.values())
    assert "video_grid_thw" in ec[video_key]["metadata"]


def test_push_transfer_ids_are_counted_on_both_sides(start_sim):
    enc, lm = start_sim(role="encode"), start_sim(role="prefill_decode")
    push = {"consumer_zmq": "tcp://127.0.0.1:1", "ec_items": [{"transfer_id": "t"}]}
    assert _chat(enc.url, [image()], ec_transfer_params=push).status_code == 200
    assert enc.state.stats()["ec_pushes"] == 1
    received = {"ec_items": [{"mm_hash": "k", "transfer_id": "t"}]}
    assert _chat(lm.url, "hi", ec_transfer_params=received).status_code == 200
    assert lm.state.stats()["ec_items_received"] == 1
