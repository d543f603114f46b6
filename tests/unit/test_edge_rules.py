"""Edge rules as plain functions: keys, body limits, encodings, nesting, settings."""

from __future__ import annotations

import gzip
import io

import pytest

from epd_flask.control.config import ProxyConfig
from epd_flask.core import errors
from epd_flask.web import edge


def test_bearer_parsing() -> None:
    assert edge.bearer_token("Bearer abc") == "abc"
    assert edge.bearer_token("bearer   abc ") == "abc"
    assert edge.bearer_token("Basic abc") is None
    assert edge.bearer_token("Bearer ") is None
    assert edge.bearer_token(None) is None


def test_keyring_accepts_only_listed_keys() -> None:
    ring = edge.KeyRing(["k1-aaaaaaaa", "k2-bbbbbbbb"])
    ring.check("Bearer k2-bbbbbbbb")
    with pytest.raises(errors.Unauthorized) as info:
        ring.check("Bearer k1-aaaaaaaX")
    assert info.value.status == 401 and info.value.code == "invalid_api_key"
    assert "k1-aaaaaaaX" not in info.value.message
    edge.KeyRing([]).check(None)  # disabled: everything passes


def test_read_capped_stops_at_the_limit() -> None:
    assert edge.read_capped(io.BytesIO(b"x" * 100).read, 100) == b"x" * 100
    with pytest.raises(errors.PayloadTooLarge):
        edge.read_capped(io.BytesIO(b"x" * 101).read, 100, step=7)


def test_decode_body_identity_and_gzip() -> None:
    assert edge.decode_body(b"{}", None, 10) == b"{}"
    assert edge.decode_body(b"{}", "identity", 10) == b"{}"
    assert edge.decode_body(gzip.compress(b"{}"), "GZIP", 10) == b"{}"
    with pytest.raises(errors.ClientError) as info:
        edge.decode_body(gzip.compress(b"{}")[:-4], "gzip", 10)
    assert info.value.status == 400
    with pytest.raises(errors.PayloadTooLarge):
        edge.decode_body(gzip.compress(b"0" * 50), "gzip", 49)


def test_check_depth_counts_containers() -> None:
    edge.check_depth({"a": [{"b": []}]}, 4)
    with pytest.raises(errors.ClientError):
        edge.check_depth({"a": [{"b": []}]}, 3)
    edge.check_depth({"a": "[[[[[[", "b": 1}, 1)


def test_settings_from_the_environment(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# serving keys\nsk-file-1\n\nsk-file-2\n")
    cfg = ProxyConfig.from_env({
        "EPD_API_KEYS": "sk-env-1, sk-env-2", "EPD_API_KEYS_FILE": str(keys),
        "EPD_UPSTREAM_IDLE_TIMEOUT": "2.5", "EPD_UPSTREAM_KEEPALIVE": "off",
        "EPD_ADMIN_PREFIX": "/_admin", "EPD_INSTANCE_NETWORKS": "10.0.0.0/8",
        "EPD_MAX_JSON_DEPTH": "32",
    })
    assert cfg.api_keys == ("sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2")
    assert cfg.upstream_idle_timeout == 2.5 and cfg.upstream_keepalive is False
    assert cfg.admin_prefix == "/_admin" and cfg.instance_networks == ("10.0.0.0/8",)
    assert cfg.max_json_depth == 32 and cfg.instance_schemes == ("http", "https")


@pytest.mark.parametrize(("env", "words"), [
    ({"EPD_UPSTREAM_KEEPALIVE": "maybe"}, "EPD_UPSTREAM_KEEPALIVE"),
    ({"EPD_UPSTREAM_IDLE_TIMEOUT": "0"}, "EPD_UPSTREAM_IDLE_TIMEOUT"),
    ({"EPD_ADMIN_PREFIX": "admin"}, "EPD_ADMIN_PREFIX"),
    ({"EPD_ADMIN_PREFIX": "/v1/admin"}, "EPD_ADMIN_PREFIX"),
    ({"EPD_API_KEYS": "same", "ADMIN_API_KEY": "same"}, "ADMIN_API_KEY"),
    ({"EPD_API_KEYS_FILE": "/nonexistent/keys"}, "EPD_API_KEYS_FILE"),
    ({"EPD_UPSTREAM_CLIENT_KEY": "/k.pem"}, "EPD_UPSTREAM_CLIENT_CERT"),
])
def test_bad_settings_are_refused_with_their_name(env, words) -> None:
    with pytest.raises(ValueError, match=words):
        ProxyConfig.from_env(env)
