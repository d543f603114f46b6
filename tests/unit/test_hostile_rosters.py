"""Rosters that are too big, too deep, or not rosters at all: refused with a reason that
never quotes the file, quickly, and without leaving anything behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from epd_flask.control import reload, settings
from epd_flask.control.roster import RosterError, RosterTooLarge, load, parse
from epd_flask.control.statedir import STATE_DIR_ENV

GOOD = "instances:\n  - {role: decode, url: 'http://127.0.0.1:8200'}\n"
SECRET = "hunter2-SECRET-do-not-print"

#: Files a roster path could be pointed at by mistake, each failing a different way.
NOT_ROSTERS = {
    "dotenv": f"DB_PASSWORD={SECRET}\nAPI_TOKEN={SECRET}\n",
    "ini": f"[default]\naws_secret_access_key = {SECRET}\n",
    "mapping": f"db_password: {SECRET}\napi_token: sk-live-{SECRET}\n",
    "tab": f"password: {SECRET}\n\tnext: {SECRET}\n",
    "tag": f"key: !!python/object:{SECRET} x\n",
    "quoted": f"password: \"{SECRET}\n",
    "list": f"- {SECRET}\n- {SECRET}\n",
    "pem": f"-----BEGIN PRIVATE KEY-----\n{SECRET}\n-----END PRIVATE KEY-----\n",
    "json": f'{{"password": "{SECRET}", "instances": [{{"url": "{SECRET}"}}]}}',
    # /etc/shadow: each line is one key (its last ':' ends it), the password hash in it.
    "shadow": f"root:$6${SECRET}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
}


class FakeArbiter:
    def __init__(self) -> None:
        self.log = logging.getLogger("test.master")


@pytest.mark.parametrize("name", sorted(NOT_ROSTERS))
def test_a_roster_path_pointing_at_another_file_never_echoes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        name: str) -> None:
    secrets = tmp_path / "secrets"
    secrets.write_text(NOT_ROSTERS[name])
    path = tmp_path / "roster.yaml"
    path.symlink_to(secrets)
    with pytest.raises(RosterError) as info:
        load(path)
    message = str(info.value)
    print(f"\n{name}: {message}")
    assert SECRET not in message and "sk-live" not in message
    # The master logs the rejection of a reload with the same reason.
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    monkeypatch.setenv("EPD_ROSTER", str(good))
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    reloader = reload.start(FakeArbiter())
    monkeypatch.setenv("EPD_ROSTER", str(path))
    with caplog.at_level(logging.INFO, logger="test.master"):
        reloader.refresh()
    assert "REJECTED" in caplog.text and SECRET not in caplog.text


def test_a_file_that_is_not_a_roster_is_described_by_its_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(NOT_ROSTERS["mapping"])
    with pytest.raises(RosterError) as info:
        load(path)
    assert str(info.value) == (
        f"{path}: not a roster: its 2 top-level keys (lines 1, 2) are not a roster's (not "
        "shown: the file may be something else); a roster has only 'settings', "
        "'discovery', 'tenants', 'instances'")
    path.write_text(NOT_ROSTERS["shadow"])
    with pytest.raises(RosterError, match=r"not a roster: its 2 top-level keys \(lines 1, 2\) "
                                          r"are not a roster's \(not shown"):
        load(path)
    # A roster with a misspelt key: named, since the file is a roster; or, when that was its
    # only key, the roster's own key it looks like.
    path.write_text("instances: []\nsetings: {probe_interval: 1}\n")
    with pytest.raises(RosterError, match=r"not a roster: unknown top-level key 'setings' "
                                          r"\(line 2\)"):
        load(path)
    path.write_text("# fleet\ninstance:\n  - {role: decode, url: 'http://h:1'}\n")
    with pytest.raises(RosterError, match=r"its top-level key \(line 2\) is not a roster's "
                                          r".*; line 2 looks like 'instances'; a roster has"):
        load(path)
    path.write_text(NOT_ROSTERS["tab"])
    with pytest.raises(RosterError, match=r"not valid YAML at line 2, column 1: found "
                                          r"character '\\t' that cannot start any token"):
        load(path)


def test_a_huge_file_is_refused_by_its_size_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    with open(path, "wb") as fh:  # 100 MB, sparse: only its size is real
        fh.truncate(100 * 1024 * 1024)
    started = time.monotonic()
    with pytest.raises(RosterTooLarge, match=r"104857600 bytes, larger than "
                                             r"EPD_ROSTER_MAX_BYTES \(262144\)"):
        load(path)
    elapsed = time.monotonic() - started
    print(f"\n100 MB roster refused in {elapsed * 1000:.2f} ms")
    assert elapsed < 1.0


def test_too_many_instances_are_refused_before_validation() -> None:
    doc = {"instances": [{"role": "decode", "url": f"http://10.0.{n // 256}.{n % 256}:8000"}
                         for n in range(10_000)]}
    started = time.monotonic()
    with pytest.raises(RosterTooLarge, match=r"10000 instances, more than "
                                             r"EPD_ROSTER_MAX_INSTANCES \(1024\)"):
        parse(doc, "big")
    print(f"\n10,000-instance roster refused in {(time.monotonic() - started) * 1000:.2f} ms")
    assert len(parse({"instances": doc["instances"][:1024]}).instances) == 1024


def test_the_limits_are_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.default("EPD_ROSTER_MAX_BYTES") == 256 * 1024
    assert settings.default("EPD_ROSTER_MAX_INSTANCES") == 1024
    path = tmp_path / "roster.yaml"
    path.write_text(GOOD + "  - {role: decode, url: 'http://127.0.0.1:8201'}\n")
    monkeypatch.setenv("EPD_ROSTER_MAX_INSTANCES", "1")
    with pytest.raises(RosterTooLarge, match="2 instances"):
        load(path)
    monkeypatch.setenv("EPD_ROSTER_MAX_INSTANCES", "2")
    monkeypatch.setenv("EPD_ROSTER_MAX_BYTES", "20")
    with pytest.raises(RosterTooLarge, match=r"EPD_ROSTER_MAX_BYTES \(20\)"):
        load(path)
    monkeypatch.setenv("EPD_ROSTER_MAX_BYTES", "4096")
    assert len(load(path).instances) == 2


def test_files_that_are_not_text_or_not_files(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_bytes(b"instances: []\n\xff\xfe")
    with pytest.raises(RosterError, match=r"not UTF-8 text \(byte 14\)"):
        load(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(RosterError, match="not a regular file"):
        load(fifo)  # would block forever if opened


@pytest.mark.parametrize("text", [
    "[" * 50_000 + "]" * 50_000,
    "instances: " + "{a: " * 50_000 + "1" + "}" * 50_000,
    "- " * 5_000 + "x\n",  # block sequences, one per "- ", on one line
])
def test_deep_nesting_is_a_roster_error_quickly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(RosterError, match="nested"):
        load(path)
    elapsed = time.monotonic() - started
    print(f"\n{len(text)}-byte deep roster refused in {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0


def test_a_deep_roster_stops_start_up_cleanly_and_leaves_no_state_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text("[" * 50_000 + "]" * 50_000)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("EPD_ROSTER", str(path))
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"cannot start epd-flask: .*nested more than"):
        reload.start(FakeArbiter())
    assert list(scratch.iterdir()) == []
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)

    def boom(path: Any) -> None:
        raise MemoryError
    monkeypatch.setattr(reload, "load", boom)  # whatever else stops start-up
    with pytest.raises(MemoryError):
        reload.start(FakeArbiter())
    assert list(scratch.iterdir()) == []


MASTER_SCRIPT = """
import logging, os, signal, sys, time
from epd_flask.control import reload
from epd_flask.control.roster import load

class Arbiter:
    log = logging.getLogger("master")

reloader = reload.start(Arbiter())
reloader.install_hup_handler()
def slow_load(path):
    time.sleep(1.0)  # a roster at the size limit, parsed by PyYAML on a loaded host
    return load(path)
reload.load = slow_load
with open(os.environ["EPD_ROSTER"], "a") as fh:
    fh.write("  - {role: decode, url: 'http://127.0.0.1:8201'}\\n")
started = time.monotonic()
os.kill(os.getpid(), signal.SIGHUP)  # the handler runs before the next line
returned = time.monotonic() - started
while reloader.handoff.generation < 2 and time.monotonic() - started < 10:
    time.sleep(0.01)
print(f"{returned:.4f} {time.monotonic() - started:.4f} {reloader.handoff.generation}")
"""


def test_the_sighup_handler_returns_before_the_roster_is_parsed(tmp_path: Path) -> None:
    """The master's SIGHUP handler wakes a thread and returns; the parse runs there, so the
    master is never held inside a signal handler (gunicorn's own loop, its worker
    replacement, keep running)."""
    path = tmp_path / "roster.yaml"
    path.write_text(GOOD)
    env = {**os.environ, "EPD_ROSTER": str(path), STATE_DIR_ENV: str(tmp_path / "state")}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run([sys.executable, "-c", MASTER_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=30, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    returned, adopted, generation = done.stdout.split()
    print(f"\nSIGHUP handler returned in {float(returned) * 1000:.1f} ms; roster adopted "
          f"{float(adopted) * 1000:.0f} ms after the signal")
    assert int(generation) == 2
    assert float(returned) < float(adopted) and float(returned) < 0.5
