"""https instances verified against the configured CA bundle and only it, rotation without a
restart, mutual TLS, and a bundle that cannot be used stopping the start
(docs/behaviour.md#transport)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from epd_flask.app import create_app
from epd_flask.control.config import ProxyConfig
from epd_flask.control.roster import parse
from epd_flask.core.errors import instance_label
from epd_flask.sim import SimConfig, SimServer
from epd_flask.upstream.tls import TLSConfigError
from tests import rosters
from tests.bodies import completion
from tests.certs import issue, make_ca

pytest.importorskip("cryptography")

COMPLETION = completion(max_tokens=4)
SETTINGS = {"decode_retries": 0, "fail_threshold": 100}


def tls_sim(sim, role: str, cert, client_ca=None, **knobs):
    return sim(role, tls_cert=str(cert.cert_path), tls_key=str(cert.key_path),
               tls_client_ca=str(client_ca.cert_path) if client_ca else None, **knobs)


def complete(px) -> requests.Response:
    return requests.post(px.url + "/v1/completions", json=COMPLETION, timeout=10)


def test_https_instances_verified_against_the_bundle(sim, proxy, tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "a", "fleet-ca-a")
    server = issue(ca, tmp_path / "a", "instance")
    p, d = tls_sim(sim, "prefill", server), tls_sim(sim, "decode", server)
    assert p.url.startswith("https://")
    px = proxy(rosters.roster([p], [d], **SETTINGS), upstream_ca_bundle=str(ca.cert_path))
    r = complete(px)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    assert d.state.stats()["kv_handles_valid"] == 1


@pytest.mark.parametrize("what", ["another CA", "wrong host name", "system store"])
def test_an_instance_the_bundle_does_not_vouch_for_is_refused(
        sim, proxy, tmp_path: Path, what: str) -> None:
    trusted = make_ca(tmp_path / "a", "fleet-ca-a")
    if what == "another CA":
        server = issue(make_ca(tmp_path / "b", "rogue-ca-b"), tmp_path / "b", "instance")
    elif what == "wrong host name":
        server = issue(trusted, tmp_path / "a", "instance", names=("other.example",))
    else:
        # Without a bundle the system store is used: our private CA is not in it.
        server = issue(trusted, tmp_path / "a", "instance")
    d = tls_sim(sim, "prefill_decode", server)
    bundle = None if what == "system store" else str(trusted.cert_path)
    px = proxy(rosters.roster(combined=[d], **SETTINGS), upstream_ca_bundle=bundle)
    r = complete(px)
    assert r.status_code == 503
    err = r.json()["error"]
    assert "failed TLS verification" in err["message"]
    assert instance_label(d.url) in err["message"] and "127.0.0.1" not in err["message"]
    assert err["code"] == "upstream_unavailable"
    assert d.state.stats()["completions"] == 0


@pytest.mark.parametrize("how", ["symlink swap", "in place"])
def test_a_rotated_bundle_is_used_from_the_next_request(
        sim, proxy, tmp_path: Path, how: str) -> None:
    old_ca = make_ca(tmp_path / "old", "fleet-ca-2025")
    new_ca = make_ca(tmp_path / "new", "fleet-ca-2026")
    secret = tmp_path / "secret"
    secret.mkdir()
    bundle = secret / "ca.crt"
    if how == "symlink swap":
        # Kubernetes' projected secret layout: ca.crt -> ..data/ca.crt, ..data -> ..<stamp>
        for stamp, ca in (("..2025", old_ca), ("..2026", new_ca)):
            (secret / stamp).mkdir()
            (secret / stamp / "ca.crt").write_bytes(ca.cert_path.read_bytes())
        (secret / "..data").symlink_to("..2025")
        bundle.symlink_to("..data/ca.crt")
    else:
        bundle.write_bytes(old_ca.cert_path.read_bytes())

    d = tls_sim(sim, "prefill_decode", issue(old_ca, tmp_path / "old", "instance"))
    port = d.port
    px = proxy(rosters.roster(combined=[d], **SETTINGS), upstream_ca_bundle=str(bundle))
    assert complete(px).status_code == 200

    if how == "symlink swap":
        (secret / "..data_tmp").symlink_to("..2026")
        os.replace(secret / "..data_tmp", secret / "..data")
    else:
        bundle.write_bytes(new_ca.cert_path.read_bytes())

    # The old CA is no longer trusted, even for the connection kept alive to the instance.
    r = complete(px)
    assert r.status_code == 503 and "failed TLS verification" in r.json()["error"]["message"]

    # The instance comes back with a certificate from the new CA, on the same address.
    d.stop()
    new_server = issue(new_ca, tmp_path / "new", "instance")
    d2 = SimServer(SimConfig(role="prefill_decode", port=port,
                             tls_cert=str(new_server.cert_path),
                             tls_key=str(new_server.key_path))).start()
    try:
        r = complete(px)
        assert r.status_code == 200, r.text
        assert d2.state.stats()["completions"] == 1
    finally:
        d2.stop()


def test_mutual_tls_presents_the_configured_client_certificate(
        sim, proxy, tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca", "fleet-ca")
    clients_ca = make_ca(tmp_path / "clients", "proxy-clients-ca")
    d = tls_sim(sim, "prefill_decode", issue(ca, tmp_path / "ca", "instance"),
                client_ca=clients_ca)
    roster = rosters.roster(combined=[d], **SETTINGS)

    anonymous = proxy(roster, upstream_ca_bundle=str(ca.cert_path))
    assert complete(anonymous).status_code == 503
    assert d.state.stats()["completions"] == 0

    client = issue(clients_ca, tmp_path / "clients", "epd-flask", client=True)
    mutual = proxy(roster, upstream_ca_bundle=str(ca.cert_path),
                   upstream_client_cert=str(client.cert_path),
                   upstream_client_key=str(client.key_path))
    r = complete(mutual)
    assert r.status_code == 200, r.text
    assert d.state.stats()["completions"] == 1


@pytest.mark.parametrize(("content", "words"), [
    (None, "does not exist"),
    (b"not a certificate\n", "not a usable PEM CA bundle"),
    ("leaf", "holds no CA certificate"),
])
def test_an_unusable_bundle_stops_the_start(tmp_path: Path, content, words: str) -> None:
    path = tmp_path / "ca.crt"
    if content == "leaf":
        leaf = issue(make_ca(tmp_path, "ca"), tmp_path, "leaf")
        path.write_bytes(leaf.cert_path.read_bytes())
    elif content is not None:
        path.write_bytes(content)
    roster = parse({"instances": []})
    with pytest.raises(TLSConfigError) as info:
        create_app(ProxyConfig(upstream_ca_bundle=str(path)), roster)
    assert str(path) in str(info.value) and words in str(info.value)
