"""Upstream answers the proxy must not take at face value, through real HTTP: bodies too big to
hold, handles and usage no prefill could have sent, redirects and answers of the wrong kind;
and client-facing errors that name a stage and an instance label, never an internal address."""

from __future__ import annotations

import json
import logging
import os
import socket

import gevent
import pytest
import requests

from epd_flask.core.errors import instance_label
from tests.bodies import chat, completion, image
from tests.fakes import response, serve_and_wait
from tests.helpers import free_port
from tests.rosters import roster

COMPLETION = completion(max_tokens=4)
MB = 1024 * 1024
PIECE = 64 * 1024


def post(px, body: dict, path: str = "/v1/completions") -> requests.Response:
    return requests.post(px.url + path, json=body, timeout=20)


def prefill_answer(**extra) -> bytes:
    doc = {"id": "cmpl-1", "object": "text_completion", "model": "tiny-llama",
           "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    doc.update(extra)
    return json.dumps(doc).encode()


def answering(raw: bytes):
    def handle(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(raw)
    return handle


def cut_after(raw: bytes):
    def handle(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(raw)
        conn.shutdown(socket.SHUT_RDWR)
    return handle


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- bounded reads -----------------------------------------------------------------------------

def _endless_json(size: int):
    """A JSON answer of ``size`` bytes, generated as it is sent (the fake holds none of it)."""
    def handle(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % size)
        conn.sendall(b'{"pad": "')
        filler = b"x" * PIECE
        left = size - 11
        try:
            while left > 0:
                conn.sendall(filler[:left])
                left -= PIECE
            conn.sendall(b'"}')
        except OSError:
            pass  # the proxy stopped reading: what this test wants
    return handle


def test_a_50_mb_prefill_answer_fails_the_stage_without_being_held(sim, proxy, fake) -> None:
    p, d = fake(_endless_json(50 * MB)), sim("decode")
    px = proxy(roster([p], [d], decode_retries=0))
    baseline = rss_bytes()
    peak = [baseline]
    done: list[bool] = []

    def watch() -> None:
        while not done:
            peak[0] = max(peak[0], rss_bytes())
            gevent.sleep(0.005)

    watcher = gevent.spawn(watch)
    r = post(px, COMPLETION)
    done.append(True)
    watcher.join()
    grew = (peak[0] - baseline) / MB
    print(f"\n50 MB prefill answer: {r.status_code} {r.json()['error']['code']}; "
          f"RSS {baseline / MB:.0f} MB, at most +{grew:.1f} MB while it was refused")
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_answer_too_large"
    assert err["message"] == (f"prefill instance {instance_label(p.url)} answered more than "
                              f"{8 * MB} bytes (EPD_MAX_UPSTREAM_BODY_BYTES)")
    assert grew < 40  # reading it whole (and joining it) took 200 MB
    assert d.state.stats()["completions"] == 0


def test_an_oversized_encoder_answer_fails_the_encode_stage(sim, proxy, fake) -> None:
    e, p, d = fake(_endless_json(20 * MB)), sim("prefill"), sim("decode")
    px = proxy(roster([p], [d], encoders=[e], decode_retries=0), max_upstream_body_bytes=MB)
    r = post(px, chat([image(size=600)], max_tokens=2), path="/v1/chat/completions")
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_answer_too_large"
    assert f"encode instance {instance_label(e.url)} answered more than {MB} bytes" \
        in err["message"]
    assert p.state.stats()["completions"] == 0 and d.state.stats()["completions"] == 0


# -- what the proxy uses from prefill's answer -------------------------------------------------

GOOD_HANDLES = {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": "e1", "remote_request_id": "r1",
                "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.9", "remote_port": 5600,
                "tp_size": 1}


@pytest.mark.parametrize("answer, why", [
    (prefill_answer(kv_transfer_params={**GOOD_HANDLES, "remote_port": "5600; rm"}),
     "remote_port is not a port number"),
    (prefill_answer(kv_transfer_params={**GOOD_HANDLES, "remote_block_ids": "all"}),
     "remote_block_ids is not a list of block ids"),
    (prefill_answer(kv_transfer_params={**GOOD_HANDLES, "remote_engine_id": {"x": 1}}),
     "remote_engine_id is not a string"),
    (prefill_answer(usage={"prompt_tokens": 3, "completion_tokens": 1,
                           "prompt_tokens_details": {"cached_tokens": 10 ** 30}}),
     "usage.prompt_tokens_details.cached_tokens (10000000000000000000000000000"),
], ids=["port", "block ids", "engine id", "cached_tokens 10^30"])
def test_prefill_answers_no_prefill_could_send_fail_the_stage(sim, proxy, fake, answer,
                                                              why) -> None:
    p, d = fake(answering(response(body=answer))), sim("decode")
    px = proxy(roster([p], [d], decode_retries=0))
    r = post(px, COMPLETION)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "bad_prefill_answer" and why in err["message"]
    assert err["message"].startswith(f"prefill instance {instance_label(p.url)} ")
    assert d.state.stats()["completions"] == 0  # decode never got the handles


def test_sane_cached_tokens_still_reach_the_client(sim, proxy, fake) -> None:
    answer = prefill_answer(usage={"prompt_tokens": 3, "completion_tokens": 1,
                                   "prompt_tokens_details": {"cached_tokens": 2}})
    p, d = fake(answering(response(body=answer))), sim("decode")
    px = proxy(roster([p], [d], decode_retries=0))
    r = post(px, COMPLETION)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


# -- redirects and answers of the wrong kind ---------------------------------------------------

REDIRECT = response("307 Temporary Redirect", extra="Location: http://10.1.2.3:8200/v1/x\r\n")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_redirect_from_decode_is_a_502_and_its_location_stays_inside(sim, proxy, fake,
                                                                     stream) -> None:
    p, d = sim("prefill"), fake(answering(REDIRECT))
    px = proxy(roster([p], [d], decode_retries=0))
    r = post(px, {**COMPLETION, "stream": stream})
    assert r.status_code == 502 and "Location" not in r.headers
    err = r.json()["error"]
    assert err["code"] == "upstream_redirect"
    assert err["message"] == f"decode instance {instance_label(d.url)} answered a redirect (307)"
    assert "10.1.2.3" not in r.text


def test_a_redirect_on_a_pass_through_route_is_a_502(sim, proxy, fake) -> None:
    p, d = sim("prefill"), fake(answering(REDIRECT))
    px = proxy(roster([p], [d], decode_retries=0))
    r = requests.get(px.url + "/v1/models", timeout=10, allow_redirects=False)
    assert r.status_code == 502 and "Location" not in r.headers and "10.1.2.3" not in r.text


@pytest.mark.parametrize("stream, answer", [
    (False, response(body=b"<html>gateway</html>", content_type="text/html")),
    (True, response(body=prefill_answer())),
    (False, response(body=b"data: [DONE]\n\n", content_type="text/event-stream")),
], ids=["html for json", "json for a stream", "events for json"])
def test_an_answer_of_the_wrong_kind_from_decode_is_a_502(sim, proxy, fake, stream,
                                                        answer) -> None:
    p, d = sim("prefill"), fake(answering(answer))
    px = proxy(roster([p], [d], decode_retries=0))
    r = post(px, {**COMPLETION, "stream": stream})
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_bad_answer"
    assert err["message"].startswith(f"decode instance {instance_label(d.url)} answered 200")


# -- no internal address in what the client reads ----------------------------------------------

def _failures(sim, fake):
    """(name, roster settings, prefill, decode, body) for every way a leg fails."""
    dead = type("Dead", (), {"url": f"http://127.0.0.1:{free_port()}"})()
    yield "decode unreachable", {}, sim("prefill"), dead, COMPLETION
    yield "prefill unreachable", {}, dead, sim("decode"), COMPLETION
    yield "decode 500", {}, sim("prefill"), fake(answering(response(
        "500 Internal Server Error", b"boom", content_type="text/plain"))), COMPLETION
    yield "decode silent", {"decode_timeout": 0.3}, sim("prefill"), fake(
        serve_and_wait(b"", 5)), {**COMPLETION, "stream": True}
    yield "prefill non-JSON", {}, fake(answering(response(body=b"nope"))), sim("decode"), \
        COMPLETION
    yield "decode cut", {}, sim("prefill"), fake(cut_after(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n{")), \
        COMPLETION


def test_no_client_error_names_an_internal_address(sim, proxy, fake, caplog) -> None:
    caplog.set_level(logging.INFO)
    for name, settings, p, d, body in _failures(sim, fake):
        px = proxy(roster([p], [d], decode_retries=0, **settings))
        r = post(px, body)
        assert r.status_code >= 500, (name, r.text)
        for url in (p.url, d.url):
            port = url.rsplit(":", 1)[1]
            assert port not in r.text and "127.0.0.1" not in r.text, (name, r.text)
        failed = p if name.startswith("prefill") else d
        assert instance_label(failed.url) in r.text, (name, r.text)
        assert failed.url.split("//")[1] in caplog.text, name  # operators still see it
