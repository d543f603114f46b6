"""``epd-flask register`` against real etcd (docs/behaviour.md#discovery): a record under a
lease while the instance's /health answers, withdrawn on failure and on SIGTERM, gone with its
lease when the registrant is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epd_flask.fleet.sources.etcdsource import member_key
from tests.helpers import eventually
from tests.membership import Etcd, needs_etcd

pytestmark = [pytest.mark.e2e, needs_etcd]
PREFIX = "/register-test/"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def register(etcd: Etcd, url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "epd_flask.control.cli", "register", "--etcd", etcd.url,
         "--prefix", PREFIX, "--role", "decode", "--url", url, "--ttl", "3",
         "--interval", "0.2", "--fail-threshold", "2", *extra],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def stored(etcd: Etcd, url: str) -> Any:
    return etcd.client.get(member_key(PREFIX, url))


def test_register_follows_health_and_withdraws_on_sigterm(
        etcd: Etcd, sim: Any, tmp_path: Path) -> None:
    decode = sim("decode")
    decode.state.inject(health_fail=True)  # not ready yet: nothing is registered
    proc = register(etcd, decode.url, tmp_path / "register.log", "--kv-events",
                    "tcp://127.0.0.1:5557", "--models", "a,b")
    try:
        assert not eventually(lambda: stored(etcd, decode.url) is not None, 1.0)
        decode.state.inject(health_fail=False)
        assert eventually(lambda: stored(etcd, decode.url) is not None)
        kv = stored(etcd, decode.url)
        assert kv.lease != 0
        assert json.loads(kv.value) == {"role": "decode", "url": decode.url,
                                        "kv_events": "tcp://127.0.0.1:5557",
                                        "models": ["a", "b"]}
        decode.state.inject(health_fail=True)  # two failed checks: withdrawn
        assert eventually(lambda: stored(etcd, decode.url) is None)
        decode.state.inject(health_fail=False)  # healthy again: back
        assert eventually(lambda: stored(etcd, decode.url) is not None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert stored(etcd, decode.url) is None  # withdrawn before it exited
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_killed_registrant_record_goes_with_its_lease(
        etcd: Etcd, sim: Any, tmp_path: Path) -> None:
    decode = sim("decode")
    proc = register(etcd, decode.url, tmp_path / "register.log")
    try:
        assert eventually(lambda: stored(etcd, decode.url) is not None)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert stored(etcd, decode.url) is not None  # still leased
        assert eventually(lambda: stored(etcd, decode.url) is None, seconds=6)  # ttl 3
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_register_refuses_a_bad_record(etcd: Etcd) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "epd_flask.control.cli", "register", "--etcd", etcd.url,
         "--prefix", PREFIX, "--role", "decode", "--url", "ftp://x", "--ttl", "3"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "http:// or https://" in out.stderr
