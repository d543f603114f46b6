"""The edge through real HTTP: serving API keys, body limits, content encodings, nesting, and
per-stage timeouts surfacing as client errors that name the stage."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib

import pytest
import requests

from tests.bodies import completion
from tests.rosters import roster

COMPLETION = completion(max_tokens=4)
KEYS = ("sk-serving-one-0123456789", "sk-serving-two-9876543210")
ADMIN = "admin-key-abcdefghijkl"


@pytest.fixture
def fleet(sim, proxy):
    def start(**config):
        p, d = sim("prefill"), sim("decode")
        return p, d, proxy(roster([p], [d]), **config)
    return start


def post(px, body: bytes | dict, headers: dict | None = None, path: str = "/v1/completions"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(px.url + path, data=data,
                         headers={"Content-Type": "application/json", **(headers or {})},
                         timeout=10)


@pytest.mark.parametrize(("auth", "code"), [
    (None, None),
    ("Bearer sk-wrong-key-000000000", "invalid_api_key"),
    ("Basic " + KEYS[0], None),
    ("Bearer " + ADMIN, "invalid_api_key"),
])
def test_serving_paths_need_one_of_the_keys(fleet, auth, code) -> None:
    p, d, px = fleet(api_keys=KEYS, admin_api_key=ADMIN)
    r = post(px, COMPLETION, {"Authorization": auth} if auth else {})
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert "sk-wrong-key-000000000" not in err["message"]  # never echoed whole
    assert requests.get(px.url + "/v1/models", timeout=10).status_code == 401
    assert p.state.stats()["completions"] == 0 and d.state.stats()["completions"] == 0


def test_a_good_key_is_served_and_stays_at_the_edge(fleet) -> None:
    _p, d, px = fleet(api_keys=KEYS, admin_api_key=ADMIN)
    for key in KEYS:
        r = post(px, COMPLETION, {"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    seen = d.state.requests(1)[0]["headers"]
    assert not any(k.lower() == "authorization" for k in seen)
    # Probes and load balancers need no key.
    px.services.prober.probe_all()  # readiness counts instances that answered a probe
    assert requests.get(px.url + "/health", timeout=10).status_code == 200
    assert requests.get(px.url + "/ready", timeout=10).status_code == 200


def test_admin_key_cannot_be_a_serving_key() -> None:
    from epd_flask.control.config import ProxyConfig

    with pytest.raises(ValueError, match="ADMIN_API_KEY"):
        ProxyConfig(api_keys=(ADMIN,), admin_api_key=ADMIN)


def test_declared_oversized_body_is_refused_before_it_is_sent(fleet) -> None:
    p, _d, px = fleet(max_body_bytes=1000)
    host, port = px.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        # Declares 1 GB, sends none of it: the answer must come without waiting for it.
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        started = time.monotonic()
        head = s.recv(65536)
        waited = time.monotonic() - started
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b"larger than this proxy accepts (1000 bytes)" in head
    assert waited < 5  # bounded by the socket timeout above, not by the 1 GB
    assert p.state.stats()["completions"] == 0


def test_chunked_body_is_cut_off_at_the_limit(fleet) -> None:
    _p, _d, px = fleet(max_body_bytes=1000)

    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    r = requests.post(px.url + "/v1/completions", data=chunks(),
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    small = requests.post(px.url + "/v1/completions", data=iter([json.dumps(COMPLETION).encode()]),
                          headers={"Content-Type": "application/json"}, timeout=10)
    assert small.status_code == 200, small.text


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_are_decoded(fleet, encoding: str) -> None:
    _p, d, px = fleet()
    raw = json.dumps(COMPLETION).encode()
    data = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    r = post(px, data, {"Content-Encoding": encoding})
    assert r.status_code == 200, r.text
    assert d.state.requests(1)[0]["body"]["prompt"] == "hello world"


def test_a_compression_bomb_is_413_not_a_worker_full_of_zeros(fleet) -> None:
    p, _d, px = fleet(max_body_bytes=1 << 20)
    bomb = gzip.compress(b'{"prompt": "' + b"0" * (64 << 20) + b'"}')
    assert len(bomb) < 200_000
    r = post(px, bomb, {"Content-Encoding": "gzip"})
    assert r.status_code == 413
    assert p.state.stats()["completions"] == 0


@pytest.mark.parametrize(("encoding", "body", "status"), [
    ("br", b"\x0b\x02\x80{}\x03", 415),
    ("gzip, gzip", gzip.compress(gzip.compress(b"{}")), 415),
    ("gzip", b"not gzip at all", 400),
])
def test_other_encodings_are_refused_explicitly(fleet, encoding, body, status) -> None:
    p, _d, px = fleet()
    r = post(px, body, {"Content-Encoding": encoding})
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert p.state.stats()["completions"] == 0


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_deep_nesting_is_a_client_error(fleet, depth: int) -> None:
    p, _d, px = fleet()
    nested = b'{"model": "tiny-llama", "prompt": "x", "extra": ' + b"[" * depth \
        + b"]" * depth + b"}"
    r = post(px, nested)
    assert r.status_code == 400
    assert "nested more than 64 levels" in r.json()["error"]["message"]
    assert p.state.stats()["completions"] == 0
    ok = post(px, {**COMPLETION, "extra": json.loads("[" * 60 + "]" * 60)})
    assert ok.status_code == 200


def test_prefill_timeout_names_the_stage(sim, proxy) -> None:
    p, d = sim("prefill", ttft=2.0), sim("decode")
    px = proxy(roster([p], [d], prefill_timeout=0.2, decode_retries=0))
    r = post(px, COMPLETION)
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["code"] == "upstream_timeout"
    assert err["message"].startswith("prefill instance") and "prefill timeout" in err["message"]
    assert d.state.stats()["completions"] == 0


def test_decode_first_byte_timeout_names_the_stage(sim, proxy) -> None:
    # A stream whose status line is late: vLLM sends it at once, so this decode is stuck.
    p, d = sim("prefill"), sim("decode", ttft=2.0)
    px = proxy(roster([p], [d], decode_timeout=0.2, decode_retries=0))
    d.state.inject(hang_next=1)
    r = post(px, {**COMPLETION, "stream": True})
    assert r.status_code == 504
    message = r.json()["error"]["message"]
    assert message.startswith("decode instance") and message.endswith("(decode timeout)")


def test_decode_first_byte_timeout_after_the_headers_names_the_stage(sim, proxy) -> None:
    # A streaming vLLM sends its headers at once and the first token later: the wait for it
    # is still the decode (first-byte) timeout; the status line is out, so it is told in band.
    p, d = sim("prefill"), sim("decode", ttft=2.0)
    px = proxy(roster([p], [d], decode_timeout=0.2, decode_retries=0))
    r = post(px, {**COMPLETION, "stream": True})
    event = json.loads(r.text.strip().removeprefix("data: "))
    assert event["error"]["code"] == "upstream_timeout"
    assert event["error"]["message"].endswith("sent no data within 0.2 s (decode timeout)")


def test_decode_silence_between_chunks_ends_the_stream_naming_the_stage(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode", token_delay=2.0)
    px = proxy(roster([p], [d], decode_chunk_timeout=0.2))
    r = post(px, {**COMPLETION, "stream": True})
    assert r.status_code == 200
    events = [b for b in r.text.split("\n\n") if b.startswith("data: ")]
    last = json.loads(events[-1][len("data: "):])
    assert len(events) >= 2 and "[DONE]" not in r.text
    assert last["error"]["code"] == "upstream_timeout"
    assert "between chunks (decode chunk timeout)" in last["error"]["message"]
