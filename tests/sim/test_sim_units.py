"""Pure parts of the sim: handles, text, media keys, the prefix cache, config and the CLI."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import requests

from epd_flask.sim import SimConfig, SimServer, handles, kvcache, media, textgen, wire
from epd_flask.sim.cli import build_parser, config_from_args


def test_signed_request_id_round_trip():
    rid = handles.remote_request_id("s", "eng", "cmpl-0123456789abcdef", False, 81)
    assert rid.startswith("cmpl-0123456789abcdef-0-") and len(rid.rsplit("-", 1)[1]) == 8
    params = {"do_remote_prefill": True, "remote_engine_id": "eng", "remote_request_id": rid,
              "remote_block_ids": [[1]], "remote_host": "h", "remote_port": 1,
              "remote_num_tokens": 81}
    assert handles.classify("s", params, 81) == handles.VALID
    assert handles.classify("s", params, 80) == handles.INVALID
    assert handles.classify("t", params, 81) == handles.INVALID
    del params["remote_request_id"]
    assert handles.classify("s", params, 81) == handles.INCOMPLETE
    assert handles.classify("s", None, 81) == handles.ABSENT


def test_generation_is_a_deterministic_prefix():
    long = textgen.generate("some prompt", 20)
    assert textgen.generate("some prompt", 5) == long[:5]
    assert textgen.generate("other prompt", 20) != long
    assert textgen.generate("x", 0) == []
    assert any(len(p.encode()) > len(p) for p in textgen.VOCAB)


def test_token_estimate():
    assert textgen.count_tokens("") == 1
    assert textgen.count_tokens("abcd") == 1 and textgen.count_tokens("abcde") == 2
    assert textgen.count_tokens("世界") == 2  # six UTF-8 bytes
    one = textgen.render_chat([{"role": "user", "content": "hi"}])
    two = textgen.render_chat([{"role": "user", "content": "hi"}] * 2)
    assert textgen.count_tokens(two) > textgen.count_tokens(one)


def test_media_keys():
    items = media.extract_items([
        {"role": "system", "content": "plain"},
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}},
                                     {"type": "audio_url", "audio_url": {"url": "a"},
                                      "uuid": "u"}]},
    ])
    assert [(i.index, i.kind) for i in items] == [(0, "video_url"), (1, "audio_url")]
    assert items[1].key == "u"
    assert "video_grid_thw" in media.item_metadata(items[0], "grid")


def test_prefix_cache_counts_whole_leading_blocks():
    cache = kvcache.PrefixCache(capacity=100)
    text = "x" * 200  # 50 tokens: three full blocks
    assert cache.lookup_and_insert(text, 50) == 0
    assert cache.lookup_and_insert(text, 50) == 48
    assert cache.lookup_and_insert(text[:64], 16) == 0  # the last token is never cached
    assert cache.lookup_and_insert("y" + text, 51) == 0


def test_wire_usage_and_fingerprint():
    assert wire.usage(3, 2)["prompt_tokens_details"] is None
    assert wire.usage(3, 2, 16)["prompt_tokens_details"] == {"cached_tokens": 16}
    assert wire.fingerprint("2033d88b-a27f-47b8-a92d-42c4256519c1") == "vllm-0.32.0-2033d88b"


def test_config_validation_and_engine_ids():
    with pytest.raises(ValueError):
        SimConfig(role="nope")
    with pytest.raises(ValueError):
        SimConfig(output_tokens=-1)
    cfg = SimConfig(role="decode")
    assert SimServer(cfg).state.engine_id != SimServer(cfg).state.engine_id
    assert SimServer(SimConfig(engine_id="fixed")).state.engine_id == "fixed"


def test_cli_arguments_map_to_config():
    args = build_parser().parse_args(
        ["--role", "prefill", "--port", "0", "--ttft-ms", "250", "--token-delay-ms", "50",
         "--output-tokens", "4", "--bootstrap-port", "0", "--dp-size", "2",
         "--ec-metadata", "empty", "--model", "m"])
    cfg = config_from_args(args)
    assert (cfg.role, cfg.ttft, cfg.token_delay, cfg.output_tokens) == ("prefill", 0.25, 0.05, 4)
    assert (cfg.bootstrap_port, cfg.dp_size, cfg.ec_metadata, cfg.model) == (0, 2, "empty", "m")


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "epd_flask.sim", "--help"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert "--token-delay-ms" in out.stdout and "--fail-next" in out.stdout


def test_cli_serves_and_exits_cleanly_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd_flask.sim", "--role", "decode", "--port", "0",
         "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()  # printed once listening
        url = banner.split(" on ", 1)[1].split()[0]
        assert requests.get(url + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
