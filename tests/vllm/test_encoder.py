"""E+PD against real vLLM: a tiny LLaVA encoder-only server computes the image embedding, the
language model server loads it (ECExampleConnector, shared files) instead of encoding.

The first case does the proxy's job by hand, proving the real pair works here; the second goes
through the proxy's encoder stage.
"""

from __future__ import annotations

import base64
import random
import struct
import zlib
from types import SimpleNamespace

import pytest

from epd_flask.sim import SimConfig, SimServer
from tests.bodies import chat, completion, completion_stream, image, text
from tests.helpers import eventually
from tests.rosters import roster
from tests.sim.wireshape import body_shape
from tests.vllm.checks import METRICS_SETTLE_SECONDS, post

pytestmark = pytest.mark.vllm

EMBEDDING_LOADED = "Success load encoder cache for hash {}"
REQUESTS_DONE = "vllm:request_success_total"
SIDE = 28  # the tiny CLIP tower's input size


def png_data_url(seed: int) -> str:
    """A 28x28 RGB PNG of seeded noise, written by hand (no imaging library needed)."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + bytes(rng.randrange(256) for _ in range(SIDE * 3))
                    for _ in range(SIDE))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", SIDE, SIDE, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_chat(seed: int, **extra) -> dict:
    return chat([image(png_data_url(seed)), text("what is in this picture")],
                **{"max_tokens": 6, "temperature": 0, **extra})


@pytest.fixture(scope="module")
def epd(fleet):
    top = fleet.up("encoder")
    return SimpleNamespace(fleet=fleet, encoder=top.by_role("encode"),
                           lm=top.by_role("prefill_decode"))


@pytest.fixture(scope="module")
def proxy(epd):
    return epd.fleet.proxy(roster(encoders=[epd.encoder], combined=[epd.lm], decode_retries=0))


def _encoded(epd) -> float:
    return epd.encoder.metrics().get(REQUESTS_DONE, 0)


def test_real_encoder_feeds_the_lm_by_hand(epd):
    body = image_chat(seed=1)
    enc = post(epd.encoder.url, "/v1/chat/completions", body)
    assert enc.status == 200, enc.raw
    params = enc.json["ec_transfer_params"]
    (mm_hash, entry), = params.items()
    assert entry == {"item_indices": [0], "metadata": {}}
    assert enc.json["choices"][0]["message"]["content"] == ""
    assert enc.json["usage"]["completion_tokens"] == 0

    reply = post(epd.lm.url, "/v1/chat/completions", {**body, "ec_transfer_params": params})
    assert reply.status == 200, reply.raw
    assert EMBEDDING_LOADED.format(mm_hash) in epd.lm.log_text()


@pytest.mark.parametrize("stream", [False, True], ids=["chat", "chat-stream"])
def test_proxy_runs_the_encoder_stage(epd, proxy, stream):
    """Through the proxy, the encoder encodes the image (its request counter, read over
    HTTP, moves by exactly one: one image, one call) and the LM loads that embedding from
    the shared store rather than encoding the image itself."""
    extra = {"stream": True} if stream else {}
    encoded_before = _encoded(epd)
    log_before = len(epd.lm.log_text())

    reply = post(proxy.url, "/v1/chat/completions", image_chat(seed=10 + stream, **extra))

    assert reply.status == 200, reply.raw
    assert reply.text
    eventually(lambda: _encoded(epd) > encoded_before, METRICS_SETTLE_SECONDS,
               what="the encoder counting the proxy's request")
    assert _encoded(epd) == encoded_before + 1
    loaded = epd.lm.log_text()[log_before:]
    assert "Success load encoder cache for hash" in loaded


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/chat/completions", image_chat(seed=3), id="image"),
    pytest.param("/v1/chat/completions", image_chat(seed=4, stream=True), id="image-stream"),
    pytest.param("/v1/chat/completions",
                 image_chat(seed=5, stream=True, stream_options={"include_usage": True}),
                 id="image-stream-usage"),
    pytest.param("/v1/chat/completions",
                 chat("text only", max_tokens=1), id="text-only"),
    pytest.param("/v1/completions", completion("hi", max_tokens=2), id="completion-text"),
    pytest.param("/v1/completions", completion_stream("hi", max_tokens=2),
                 id="completion-text-stream"),
])
def test_sim_encoder_matches_real_encoder(epd, path, body):
    """The simulated encoder (metadata {} like LLaVA) answers in the real encoder's shape."""
    sim = SimServer(SimConfig(role="encode", ec_metadata="empty")).start()
    try:
        real, simulated = post(epd.encoder.url, path, body), post(sim.url, path, body)
    finally:
        sim.stop()
    assert simulated.status == real.status, (real.raw, simulated.raw)
    ctype = real.headers.get("content-type", "")
    assert simulated.headers.get("content-type") == ctype
    assert body_shape(simulated.raw.decode(), ctype) == body_shape(real.raw.decode(), ctype)
