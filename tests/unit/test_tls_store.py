"""The trust store re-reads its files only when they change, and fails closed."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_flask.upstream.tls import TLSConfigError, TLSFiles, TrustStore
from tests.certs import make_ca

pytest.importorskip("cryptography")


def test_context_is_cached_until_the_file_changes_then_fails_closed(tmp_path: Path) -> None:
    a, b = make_ca(tmp_path / "a", "ca-a"), make_ca(tmp_path / "b", "ca-b")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(a.cert_path.read_bytes())
    store = TrustStore(TLSFiles(str(bundle)))
    first = store.current()
    assert store.current() is first and store.generation == 1
    names = [dict(x[0] for x in c["subject"])["commonName"] for c in first.get_ca_certs()]
    assert names == ["ca-a"]

    bundle.write_bytes(b.cert_path.read_bytes())
    second = store.current()
    assert second is not first and store.generation == 2
    assert [dict(x[0] for x in c["subject"])["commonName"] for c in second.get_ca_certs()] \
        == ["ca-b"]
    assert second.minimum_version.name == "TLSv1_2" and second.check_hostname

    bundle.write_bytes(b"garbage\n")
    for _ in range(2):  # the failure is cached, not re-parsed, and never falls back
        with pytest.raises(TLSConfigError, match="not a usable PEM CA bundle"):
            store.current()
    bundle.unlink()
    with pytest.raises(TLSConfigError, match="does not exist"):
        store.current()
