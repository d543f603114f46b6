"""E+P+D with pushed embeddings against real vLLM: a tiny LLaVA encoder-only server pushes
each image's embedding over Mooncake (TCP, host buffers) to the prefill the encode request
names (``consumer_zmq``, one transfer id per item); the prefill, an ECMooncakeConnector
consumer, loads it instead of encoding, and hands the KV to the decode (MooncakeConnector).

vLLM 0.32's CPU build runs the V1 model runner (Model Runner V2 needs Triton), and that
runner hands the EC connector its loads only in a step that computes tokens. An idle prefill
therefore never loads the push its one request waits for, and fails the request once the
consumer's push wait runs out. The cases that prove the path keep the prefill computing
another request meanwhile; the last case pins the limit down, so the day vLLM lifts it this
module says so.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import gevent
import gevent.event
import pytest
import requests
import zmq.green as zmq

from tests.helpers import eventually
from tests.rosters import roster
from tests.vllm.checks import HTTP_TIMEOUT, METRICS_SETTLE_SECONDS, kv_delta, post
from tests.vllm.fleet import MODEL_NAME, VllmServer
from tests.vllm.test_encoder import image_chat

pytestmark = pytest.mark.vllm

REQUESTS_DONE = "vllm:request_success_total"
#: The tiny CLIP tower's 4 image tokens, each a row as wide as the language model (128).
EMBEDDING_SHAPE = [4, 128]
#: Tokens of one busy stream: it fits the 512-token context with its short prompt.
BUSY_TOKENS = 400
BUSY_ROUNDS = 50
CONTROL_TIMEOUT_MS = 10_000
#: A fleet's first push waits for the producer to start its transfer engine.
PUSH_LANDS_SECONDS = 120.0


@pytest.fixture(scope="module")
def epd(fleet):
    top = fleet.up("ec-mooncake")
    prefill = top.by_role("prefill")
    return SimpleNamespace(fleet=fleet, encoder=top.by_role("encode"), prefill=prefill,
                           decode=top.by_role("decode"),
                           consumer=f"tcp://127.0.0.1:{prefill.ec_control_port}")


@pytest.fixture(scope="module")
def proxy(epd):
    prefill = (epd.prefill, {"bootstrap_url": epd.prefill.bootstrap_url,
                             "ec_zmq_addrs": [epd.consumer]})
    return epd.fleet.proxy(roster([prefill], [epd.decode], encoders=[epd.encoder],
                                  connector="mooncake", decode_retries=0))


def _encoded(epd) -> float:
    return epd.encoder.metrics().get(REQUESTS_DONE, 0)


def _await_encoded(epd, count: float) -> None:
    """The encoder's request counter reaches ``count`` (it trails the answer) and stays
    there: one image, one encoder call."""
    eventually(lambda: _encoded(epd) >= count, METRICS_SETTLE_SECONDS,
               what="the encoder counting the proxy's request")
    assert _encoded(epd) == count


def _control(address: str, request: dict) -> dict:
    """One request to a Mooncake EC consumer's control channel (ZMQ REQ/REP, JSON)."""
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, CONTROL_TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, CONTROL_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_json(request)
        return sock.recv_json()
    finally:
        sock.close()
        context.term()


@contextlib.contextmanager
def busy(server: VllmServer) -> Iterator[None]:
    """Keep ``server`` computing tokens: two long greedy streams half a stream apart, each
    started again when it ends (at most ``BUSY_ROUNDS`` times), until the block ends. One is
    always mid-stream while the other restarts, so no step of the server goes idle."""
    stop, halfway = gevent.event.Event(), gevent.event.Event()
    body = {"model": MODEL_NAME, "prompt": "busy", "max_tokens": BUSY_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}

    def keep(first: bool) -> None:
        for _ in range(BUSY_ROUNDS):
            with requests.post(server.url + "/v1/completions", json=body, stream=True,
                               timeout=HTTP_TIMEOUT) as resp:
                assert resp.status_code == 200, resp.text
                chunks = 0
                for line in resp.iter_lines():
                    chunks += line.startswith(b"data: ")
                    if first and chunks == BUSY_TOKENS // 2:
                        halfway.set()
                    if stop.is_set():
                        return

    first = gevent.spawn(keep, True)
    eventually(lambda: halfway.is_set() or first.dead, HTTP_TIMEOUT,
               what="the first busy stream getting halfway")
    second = gevent.spawn(keep, False)
    try:
        yield
    finally:
        stop.set()
        gevent.joinall([first, second], timeout=HTTP_TIMEOUT)
        gevent.killall([first, second])
    for g in (first, second):
        if g.exception is not None:
            raise g.exception


def test_encoder_pushes_into_the_named_consumer_by_hand(epd):
    """The encoder reserves space on the consumer named in its request, writes the embedding
    there under the transfer id it was given, and reports that id; the consumer (kept busy)
    answers from it exactly as a server that encodes the image itself."""
    body = image_chat(seed=21)
    transfer = uuid.uuid4().hex
    enc = post(epd.encoder.url, "/v1/chat/completions", {**body, "ec_transfer_params": {
        "consumer_zmq": epd.consumer, "ec_items": [{"transfer_id": transfer}]}})
    assert enc.status == 200, enc.raw
    (mm_hash, entry), = enc.json["ec_transfer_params"].items()
    assert entry == {"item_indices": [0], "metadata": {}, "transfer_id": transfer}

    def landed_push() -> dict | None:
        answer = _control(epd.consumer, {"op": "status", "transfer_id": transfer})
        return answer if answer["ok"] and (answer["result"] or {}).get("ready") else None
    landed = eventually(landed_push, PUSH_LANDS_SECONDS, what="the push landing")
    assert landed["result"]["mm_hash"] == mm_hash
    assert landed["result"]["shape"] == EMBEDDING_SHAPE

    with busy(epd.prefill):
        reply = post(epd.prefill.url, "/v1/chat/completions", {**body, "ec_transfer_params": {
            mm_hash: entry, "ec_items": [{"mm_hash": mm_hash, "transfer_id": transfer}]}})
    assert reply.status == 200, reply.raw
    assert reply.text == post(epd.decode.url, "/v1/chat/completions", body).text


@pytest.mark.parametrize("stream", [False, True], ids=["chat", "chat-stream"])
def test_proxy_runs_e_p_d_with_pushed_embeddings(epd, proxy, stream):
    """Through the proxy: one encoder call per image, the prefill takes the pushed embedding
    (it never encodes: see the idle case), decode pulls every prompt token's KV from it, and
    the answer is the one a server encoding the image itself gives."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = image_chat(seed=30 + stream, **extra)
    encoded_before, decode_before = _encoded(epd), epd.decode.metrics()

    with busy(epd.prefill):
        reply = post(proxy.url, "/v1/chat/completions", body)

    assert reply.status == 200, reply.raw
    usage = reply.events[-2]["usage"] if stream else reply.json["usage"]
    pulled = kv_delta(epd.decode, decode_before, usage["prompt_tokens"])
    assert pulled.external == usage["prompt_tokens"] and pulled.local == 0, pulled
    _await_encoded(epd, encoded_before + 1)
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    assert reply.text == post(epd.decode.url, "/v1/chat/completions", plain).text


def test_an_idle_prefill_never_loads_its_push(epd, proxy):
    """vLLM's limit on this machine (see the module's docstring): with nothing else to
    compute, the prefill neither loads the pushed embedding nor encodes the image itself,
    and fails the request after its push wait; the proxy relays that failure."""
    encoded_before = _encoded(epd)
    log_before = len(epd.prefill.log_text())

    reply = post(proxy.url, "/v1/chat/completions", image_chat(seed=40))

    assert reply.status == 500, reply.raw
    assert json.loads(reply.raw)["error"]["code"] == 500
    _await_encoded(epd, encoded_before + 1)
    log = epd.prefill.log_text()[log_before:]
    assert "failed with an internal error during generation" in log
    assert "that never arrived" not in log  # the push did arrive: it was never loaded
