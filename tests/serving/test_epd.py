"""Encoder disaggregation (E+P+D, E+PD) through real HTTP against the simulated fleet."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

import pytest
import requests
from gevent.pywsgi import WSGIServer

from epd_flask.core.errors import instance_label
from tests.bodies import audio, image, multimodal, video
from tests.rosters import roster

MEDIA = ("image_url", "audio_url", "input_audio", "video_url")
EMBEDS = ("image_embeds", "audio_embeds", "video_embeds")
LOG_LINE = re.compile(r"request_id=(\S+) .*")


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return multimodal(*parts, **{"max_tokens": 4, "temperature": 0, **extra})


def post(px, body: dict[str, Any], **kw: Any) -> requests.Response:
    return requests.post(px.url + "/v1/chat/completions", json=body, timeout=20, **kw)


def completions(server) -> list[dict[str, Any]]:
    return [r for r in server.state.requests() if r["path"] == "/v1/chat/completions"]


def parts_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for m in record["body"]["messages"] if isinstance(m.get("content"), list)
            for p in m["content"]]


def media_parts(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in parts_of(record) if p["type"] in MEDIA + EMBEDS]


def timings(caplog, request_id: str) -> dict[str, float]:
    for rec in caplog.records:
        message = rec.getMessage()
        if rec.name == "epd_flask.requests" and f"request_id={request_id} " in message:
            return {k: float(v) for k, v in re.findall(r"(\w+)_ms=([\d.]+)", message)}
    raise AssertionError(f"no request log line for {request_id}")


def test_five_images_and_an_audio_fan_out_to_two_encoders_at_once(sim, proxy, caplog) -> None:
    slow, fast = 0.4, 0.25
    e0, e1 = sim("encode", ttft=slow), sim("encode", ttft=fast)
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e0, e1]))
    body = chat(image(), image(), image(), image(), image(), audio())
    sent = json.dumps(body)
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        r = post(px, body, headers={"X-Request-Id": "mm-fanout-1"})
    assert r.status_code == 200, r.text
    assert json.dumps(body) == sent  # the client's body was never touched

    # Round-robin from the first encoder: images 0, 2, 4 batch on e0; 1, 3 batch on e1; the
    # audio (item 5) goes alone to e1. Three calls, media only, each with its key as uuid.
    # e1's two calls run concurrently, so the order it records them in is not fixed.
    calls = completions(e0) + completions(e1)
    assert [len(media_parts(c)) for c in completions(e0)] == [3]
    assert sorted(len(media_parts(c)) for c in completions(e1)) == [1, 2]
    assert all(p["type"] in MEDIA and p["uuid"] for c in calls for p in parts_of(c))
    assert all(c["body"]["stream"] is False and "max_tokens" not in c["body"] for c in calls)
    # Children of the request's upstream id (never the client's), one per call.
    upstream = d.state.requests(1)[0]["headers"]["x-request-id"]
    assert all(c["headers"]["x-request-id"].startswith(upstream + ":") for c in calls)
    assert len({c["headers"]["x-request-id"] for c in calls}) == len(calls)

    # All three were in flight together: each lasts at least `fast`, and the last one
    # arrived before the first could have finished.
    arrivals = sorted(c["time"] for c in calls)
    assert arrivals[-1] - arrivals[0] < fast
    assert e1.state.stats()["max_in_flight"] == 2

    # The stage took about the slowest call, not the sum of the calls.
    t = timings(caplog, "mm-fanout-1")
    assert slow * 1000 <= t["encode"] < (slow + fast) * 1000 < (slow + 2 * fast) * 1000
    for stage in ("encode", "rewrite", "prefill", "decode_first_byte", "total"):
        assert stage in t, t
    assert t["total"] >= t["encode"] + t["prefill"]

    # Prefill and decode saw only embedding references, which they could resolve.
    for lm in (p, d):
        (record,) = completions(lm)
        kinds = [part["type"] for part in media_parts(record)]
        assert kinds == ["image_embeds"] * 5 + ["audio_embeds"]
        stats = lm.state.stats()
        assert stats["ec_embeds_resolved"] == 6 and stats["media_encoded_locally"] == 0
        assert stats["ec_embeds_mismatched"] == stats["ec_embeds_unresolved"] == 0
        assert stats["media_from_ec"] == 0
    decode_body = completions(d)[0]["body"]
    keys = [part["uuid"] for part in media_parts(completions(d)[0])]
    assert set(keys) <= set(decode_body["ec_transfer_params"])  # the encoders' entries
    assert decode_body["kv_transfer_params"]["remote_request_id"]
    assert d.state.stats()["kv_handles_valid"] == 1


@pytest.mark.parametrize("fault, status, code", [
    ({"fail_next": 1, "fail_status": 429}, 429, 429),
    ({"hang_next": 1}, 502, "upstream_timeout"),
])
def test_a_failing_encoder_fails_the_request_before_prefill_and_decode(
        sim, proxy, fault, status, code) -> None:
    """The encoder's own 4xx reaches the client; a stalled encoder is abandoned at the stage's
    deadline and reported as such. Neither goes to another encoder."""
    e0, e1 = sim("encode"), sim("encode", ttft=0.05)
    p, d = sim("prefill"), sim("decode")
    # A short stage deadline only where it is meant to fire: under load a 4xx can take longer.
    px = proxy(roster([p], [d], encoders=[e0, e1], decode_retries=2,
                      encoder_timeout=0.5 if "hang_next" in fault else 10.0))
    e0.state.inject(**fault)
    first, second, sound = image(), image(), audio()
    r = post(px, chat(first, second, sound))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    assert r.headers["X-Request-Id"]
    if "hang_next" in fault:
        assert instance_label(e0.url) in error["message"]
        assert "encoder_timeout" in error["message"] and e0.url not in error["message"]
    for lm in (p, d):
        assert lm.state.stats()["completions"] == 0
    # Not retried elsewhere: the healthy encoder saw at most its own share (the second image),
    # never e0's items. Whether its call reached it before the failure cancelled the fan-out is
    # a matter of scheduling.
    seen = [{k: v for k, v in part.items() if k != "uuid"}
            for call in completions(e1) for part in media_parts(call)]
    assert seen in ([], [second]), seen


@pytest.mark.parametrize("fault", [{"fail_next": 1, "fail_status": 500}, "stopped"])
def test_a_failed_encoder_call_goes_once_to_another_encoder(sim, proxy, fault) -> None:
    e0, e1 = sim("encode"), sim("encode")
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e0, e1], decode_retries=2))
    if fault == "stopped":
        e0.stop()
    else:
        e0.state.inject(**fault)
    # Three items: the images go to e0 and e1 one each, the audio to e0 (round-robin,
    # docs/behaviour.md#encoders-and-rewriting).
    r = post(px, chat(image(), image(), audio()))
    assert r.status_code == 200, r.text
    failed_calls = 1 if fault != "stopped" else 2
    assert px.services.pipeline.counters["retried_encode"] == failed_calls
    assert len(completions(e1)) == 1 + failed_calls  # its own call and the retried one(s)
    assert p.state.stats()["completions"] == 1 and d.state.stats()["completions"] == 1
    assert p.state.stats()["ec_embeds_resolved"] == 3  # every item encoded, none locally


def test_an_encoder_call_is_retried_once_only(sim, proxy) -> None:
    e0, e1 = sim("encode"), sim("encode")
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e0, e1], decode_retries=2))
    for e in (e0, e1):
        e.state.inject(fail_next=5, fail_status=503)
    r = post(px, chat(image()))
    assert r.status_code == 503, r.text
    assert e0.state.stats()["failed_injected"] + e1.state.stats()["failed_injected"] == 2
    assert p.state.stats()["completions"] == 0 and d.state.stats()["completions"] == 0


def test_the_same_image_gets_the_same_key_in_every_request(sim, proxy) -> None:
    enc = sim("encode")
    pd = sim("prefill_decode")
    px = proxy(roster(encoders=[enc], combined=[pd]))
    same = image()
    for body in (chat(same), chat(image(), same, max_tokens=2)):
        assert post(px, body).status_code == 200
    first, second = completions(enc)
    key = hashlib.sha256(same["image_url"]["url"].encode()).hexdigest()
    assert parts_of(first)[0]["uuid"] == key == parts_of(second)[1]["uuid"]
    assert parts_of(second)[0]["uuid"] != key
    lm_first, lm_second = completions(pd)
    assert media_parts(lm_first)[0]["uuid"] == key == media_parts(lm_second)[1]["uuid"]
    assert pd.state.stats()["ec_embeds_resolved"] == 3


def test_empty_metadata_keeps_raw_media_that_the_next_stage_finds_by_key(sim, proxy) -> None:
    """Real LLaVA reports ``"metadata": {}``: nothing to size placeholders with, so the item
    stays media, carrying the uuid the encoder stored it under."""
    enc = sim("encode", ec_metadata="empty")
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[enc]))
    body = chat(image(), audio())
    r = post(px, body)
    assert r.status_code == 200, r.text
    record = completions(p)[0]
    sent = [part for part in body["messages"][0]["content"] if part["type"] in MEDIA]
    got = media_parts(record)
    assert [{k: v for k, v in g.items() if k != "uuid"} for g in got] == sent
    # The image batch and the lone audio are concurrent calls: compare keys, not arrival order.
    encoder_uuids = [part["uuid"] for call in completions(enc) for part in media_parts(call)]
    assert sorted(g["uuid"] for g in got) == sorted(encoder_uuids)
    # real vLLM's shape: every entry forwarded under its key
    assert set(record["body"]["ec_transfer_params"]) == set(encoder_uuids)
    stats = p.state.stats()
    assert stats["media_from_ec"] == 2 and stats["media_encoded_locally"] == 0


def test_a_lone_audio_without_metadata_keeps_the_whole_request_raw(sim, proxy) -> None:
    grid, empty = sim("encode"), sim("encode", ec_metadata="empty")
    pd = sim("prefill_decode")
    px = proxy(roster(encoders=[grid, empty], combined=[pd]))
    # item 0 (image) -> grid encoder (has metadata), item 1 (audio) -> empty encoder
    r = post(px, chat(image(), audio()))
    assert r.status_code == 200, r.text
    got = media_parts(completions(pd)[0])
    assert [g["type"] for g in got] == ["image_url", "input_audio"]
    assert all(g["uuid"] for g in got)
    assert pd.state.stats()["media_from_ec"] == 2


def test_without_rewrite_the_next_stage_gets_the_original_media(sim, proxy) -> None:
    enc = sim("encode")
    pd = sim("prefill_decode")
    px = proxy(roster(encoders=[enc], combined=[pd], rewrite_media=False))
    body = chat(image(), image())
    assert post(px, body).status_code == 200
    assert all("uuid" not in part for part in media_parts(completions(enc)[0]))
    lm = completions(pd)[0]["body"]
    assert lm["messages"] == body["messages"]
    assert len(lm["ec_transfer_params"]) == 2  # the encoder's handles still travel
    assert pd.state.stats()["media_from_ec"] == 2  # both sides hashed the same content


def test_a_decode_retry_encodes_again_from_the_original_media(sim, proxy) -> None:
    enc = sim("encode")
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[enc], decode_retries=1))
    d.state.inject(fail_next=1, fail_status=500)
    body = chat(image(), image())
    r = post(px, body)
    assert r.status_code == 200, r.text
    first, second = completions(enc)
    assert parts_of(first) == parts_of(second)
    assert [part["type"] for part in parts_of(second)] == ["image_url", "image_url"]
    assert p.state.stats()["completions"] == 2
    assert d.state.stats()["ec_embeds_resolved"] == 2  # the successful attempt's


def test_mooncake_consumer_replica_is_named_to_encoders_and_to_the_request(sim, proxy) -> None:
    enc = sim("encode")
    pd = sim("prefill_decode", dp_size=2)
    addrs = ["tcp://127.0.0.1:17000", "tcp://127.0.0.1:17001"]
    px = proxy(roster(encoders=[enc], combined=[(pd, {"dp_size": 2, "ec_zmq_addrs": addrs})]))
    for _ in range(2):
        assert post(px, chat(image(), image())).status_code == 200
    assert post(px, chat()).status_code == 200  # no media: no pinning, no encoder call
    encoder_calls, lm_calls = completions(enc), completions(pd)
    assert len(encoder_calls) == 2
    ranks = []
    for call, lm in zip(encoder_calls, lm_calls, strict=False):
        push = call["body"]["ec_transfer_params"]
        rank = int(lm["headers"]["x-data-parallel-rank"])
        ranks.append(rank)
        assert push["consumer_zmq"] == addrs[rank]
        transfer_ids = [i["transfer_id"] for i in push["ec_items"]]
        got = lm["body"]["ec_transfer_params"]["ec_items"]
        assert [i["transfer_id"] for i in got] == transfer_ids and len(set(transfer_ids)) == 2
        assert [i["mm_hash"] for i in got] == [p["uuid"] for p in media_parts(call)]
    assert ranks == [0, 1]
    assert "x-data-parallel-rank" not in lm_calls[2]["headers"]
    assert enc.state.stats()["ec_pushes"] == 4 and pd.state.stats()["ec_items_received"] == 4


def test_video_with_its_audio_stays_raw_and_rehashed_keys_match_by_index(sim, proxy) -> None:
    enc = sim("encode")
    pd = sim("prefill_decode")
    px = proxy(roster(encoders=[enc], combined=[pd]))
    kwargs = {"use_audio_in_video": True}
    r = post(px, chat(video(), image(), image(), mm_processor_kwargs=kwargs))
    assert r.status_code == 200, r.text
    # the encoder rehashed every uuid with the processing options: images matched by index,
    # the video (reported twice, for its frames and its sound) kept as media
    kinds = [part["type"] for part in media_parts(completions(pd)[0])]
    assert kinds == ["video_url", "image_embeds", "image_embeds"]
    stats = pd.state.stats()
    assert stats["ec_embeds_resolved"] == 2 and stats["media_from_ec"] == 1


def test_encoder_rotation_and_batch_cap(sim, proxy) -> None:
    e0, e1 = sim("encode"), sim("encode")
    pd = sim("prefill_decode")
    px = proxy(roster(encoders=[e0, e1], combined=[pd], encoder_max_batch_size=2))
    for _ in range(3):
        assert post(px, chat(image())).status_code == 200
    # the rotation continues across requests: e0, e1, e0
    assert (len(completions(e0)), len(completions(e1))) == (2, 1)
    assert post(px, chat(*[image() for _ in range(5)])).status_code == 200
    # next item starts on e1: items 0, 2, 4 on e1 (capped at 2 per request), 1, 3 on e0
    assert [len(media_parts(c)) for c in completions(e1)[1:]] == [2, 1]
    assert [len(media_parts(c)) for c in completions(e0)[2:]] == [2]


def test_the_concurrency_bound_holds(sim, proxy) -> None:
    enc = sim("encode", ttft=0.05)
    pd = sim("prefill_decode")
    for bound, expected in ((1, 1), (8, 3)):
        enc.state.reset()
        px = proxy(roster(encoders=[enc], combined=[pd], encoder_concurrency=bound))
        assert post(px, chat(audio(), audio(), audio())).status_code == 200
        assert enc.state.stats()["max_in_flight"] == expected


def test_text_only_requests_skip_the_encoders(sim, proxy) -> None:
    enc = sim("encode")
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[enc]))
    assert post(px, chat()).status_code == 200
    assert requests.post(px.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         timeout=10).status_code == 200
    assert enc.state.stats()["completions"] == 0


def test_no_live_encoder_is_a_503_before_any_other_call(sim, proxy) -> None:
    enc = sim("encode")
    pd = sim("prefill_decode")
    px = proxy(roster(encoders=[enc], combined=[pd]))
    registry = px.services.registry
    for _ in range(registry.fail_threshold):
        registry.record_failure(enc.url, "test")
    r = post(px, chat(image()))
    assert r.status_code == 503 and "encode" in r.json()["error"]["message"]
    assert pd.state.stats()["completions"] == 0


@pytest.mark.parametrize("report", [
    {"a": {"item_indices": [5], "metadata": {}}},
    {"a": {"item_indices": [0], "metadata": {}}, "b": {"item_indices": [0], "metadata": {}}},
    {"a": {"metadata": {}}, "b": {"metadata": {}}},
])
def test_an_unmatchable_encoder_report_is_a_502(sim, proxy, report) -> None:
    def fake_encoder(environ, start_response):
        body = json.dumps({"choices": [], "ec_transfer_params": report}).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]

    server = WSGIServer(("127.0.0.1", 0), fake_encoder, log=None)
    server.start()
    try:
        pd = sim("prefill_decode")
        px = proxy(roster(encoders=[f"http://127.0.0.1:{server.server_port}"], combined=[pd]))
        r = post(px, chat(image(), image()))
    finally:
        server.stop()
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "bad_encoder_report"
    assert pd.state.stats()["completions"] == 0


def test_streamed_e_pd_request_relays_events_after_encoding(sim, proxy) -> None:
    enc = sim("encode", ttft=0.05)
    pd = sim("prefill_decode", token_delay=0.01)
    px = proxy(roster(encoders=[enc], combined=[pd]))
    r = post(px, chat(image(), audio(), stream=True, max_tokens=5))
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [b for b in r.content.decode().split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 6
    (record,) = completions(pd)
    assert record["body"]["stream"] is True
    assert [p["type"] for p in media_parts(record)] == ["image_embeds", "audio_embeds"]
    assert completions(enc)[0]["body"]["stream"] is False


def test_every_encoder_decision_is_in_the_log_line(sim, proxy, caplog) -> None:
    """Each media item's encoder is chosen by the encode role's policy and named in the
    request's log line, repeats in a row counted."""
    e1, e2 = sim("encode"), sim("encode")
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e1, e2]))
    with caplog.at_level(logging.INFO, logger="epd_flask.requests"):
        r = post(px, chat(image(), image(), image()), headers={"X-Request-Id": "three-images"})
    assert r.status_code == 200, r.text
    line = next(m for m in caplog.messages if "request_id=three-images " in m)
    assert "routing=decode:round_robin(rotation),prefill:round_robin(rotation)," in line
    assert "encode:round_robin(rotation)x3" in line


def test_a_prefill_consumer_replica_is_named_to_encoders_and_to_the_prefill(sim, proxy) -> None:
    """E+P+D with Mooncake EC consumers on the prefill: the prefill's policy picks the replica,
    its address goes to the encoders and its rank to the prefill; decode runs elsewhere and
    is never pinned."""
    enc = sim("encode")
    p, d = sim("prefill", dp_size=2), sim("decode")
    addrs = ["tcp://127.0.0.1:17100", "tcp://127.0.0.1:17101"]
    px = proxy(roster([(p, {"dp_size": 2, "ec_zmq_addrs": addrs})], [d], encoders=[enc]))
    for _ in range(2):
        assert post(px, chat(image())).status_code == 200
    pushes = [c["body"]["ec_transfer_params"]["consumer_zmq"] for c in completions(enc)]
    ranks = [int(c["headers"]["x-data-parallel-rank"]) for c in completions(p)]
    assert ranks == [0, 1] and pushes == [addrs[0], addrs[1]]
    assert all("x-data-parallel-rank" not in c["headers"] for c in completions(d))
    assert p.state.stats()["ec_items_received"] == 2
