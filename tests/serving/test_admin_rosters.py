"""The admin API over real HTTP with a roster file that is too big or not a roster: 409 with
a reason that never quotes the file, and nothing written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.rosters import roster

KEY = "s3cret-admin"
SECRET = "hunter2-SECRET-do-not-print"


@pytest.fixture
def admin(sim, proxy, tmp_path: Path) -> Any:
    p, d = sim("prefill"), sim("decode")
    doc = roster([p], [d])
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(doc))
    path = tmp_path / "roster.yaml"
    path.symlink_to(good)

    def start(**config: Any) -> Any:
        return proxy(doc, roster_path=str(path), admin_api_key=KEY, **config)
    return start, path, good


def register(px: Any, port: int) -> requests.Response:
    return requests.post(px.url + "/instances", headers={"X-API-Key": KEY}, timeout=10,
                         json={"role": "decode", "url": f"http://10.0.0.1:{port}"})


@pytest.mark.parametrize("content", [
    f"db_password: {SECRET}\napi_token: {SECRET}\n",
    f"[default]\naws_secret_access_key = {SECRET}\n",
    f"password: {SECRET}\n\tnext: {SECRET}\n",
])
def test_a_roster_pointing_at_a_secret_is_409_without_its_content(admin, tmp_path,
                                                                  content) -> None:
    start, path, _ = admin
    px = start()
    secrets = tmp_path / "secrets.env"
    secrets.write_text(content)
    path.unlink()
    path.symlink_to(secrets)
    r = register(px, 9000)
    assert r.status_code == 409 and r.json()["error"]["code"] == "roster_file_invalid"
    print("\n" + r.json()["error"]["message"])
    assert SECRET not in r.text
    assert secrets.read_text() == content


def test_registrations_stop_at_the_instance_limit(admin, monkeypatch) -> None:
    start, _, good = admin
    px = start()
    monkeypatch.setenv("EPD_ROSTER_MAX_INSTANCES", "3")
    assert register(px, 9001).status_code == 201
    r = register(px, 9002)
    assert r.status_code == 409 and r.json()["error"]["code"] == "roster_too_large"
    assert "more than EPD_ROSTER_MAX_INSTANCES (3)" in r.json()["error"]["message"]
    assert len(yaml.safe_load(good.read_text())["instances"]) == 3


def test_an_oversized_roster_file_is_409_before_it_is_read(admin) -> None:
    start, _, good = admin
    px = start()
    with open(good, "ab") as fh:
        fh.truncate(50 * 1024 * 1024)
    r = register(px, 9003)
    assert r.status_code == 409 and "EPD_ROSTER_MAX_BYTES" in r.json()["error"]["message"]
