"""Oversized and foreign rosters against a real gunicorn master: refused at start with the
reason and nothing echoed; on SIGHUP refused quickly, the last good roster kept, and the
workers serving throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.bodies import chat
from tests.e2e.conftest import ROOT
from tests.helpers import eventually, free_port
from tests.rosters import roster

pytestmark = pytest.mark.e2e

SECRET = "hunter2-SECRET-do-not-print"
CHAT = chat("hi", max_tokens=2)


def whole_log(gw) -> str:
    return gw.log.read_text(errors="replace")


def rejections(gw) -> list[str]:
    return [line for line in whole_log(gw).splitlines() if "REJECTED" in line]


def wait_for_rejection(gw, seen: int, words: str, started: float) -> tuple[float, int]:
    """Seconds until a rejection naming ``words`` is logged after the first ``seen``; and
    how many rejections are logged by then."""
    def logged() -> list[str]:
        found = rejections(gw)
        return found if any(words in line for line in found[seen:]) else []
    found = eventually(logged, started + 60 - time.monotonic(),
                       what=lambda: f"a rejection with {words!r} logged: {gw.tail()}")
    return time.monotonic() - started, len(found)


def test_oversized_and_foreign_rosters_are_refused_on_sighup(procs, tmp_path: Path) -> None:
    p, d = procs["sim"]("prefill"), procs["sim"]("decode")
    good = roster([p], [d])
    target = tmp_path / "good.yaml"
    target.write_text(yaml.safe_dump(good))
    path = tmp_path / "roster.yaml"
    path.symlink_to(target)
    gw = procs["gunicorn"](None, "-k", "gevent", roster_file=path,
                           env={"EPD_GRACEFUL_TIMEOUT": "5"})
    timings = {}

    # 1. A 100 MB file (the size is all that is read).
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:
        fh.write(b"# " + b"x" * 1000 + b"\n")
        fh.truncate(100 * 1024 * 1024)
    # 2. A roster of 2,000 instances, well-formed and small enough in bytes.
    many = tmp_path / "many.yaml"
    many.write_text("instances:\n" + "".join(
        f"  - {{role: decode, url: 'http://10.1.{n // 256}.{n % 256}:8000'}}\n"
        for n in range(2000)))
    assert many.stat().st_size < 256 * 1024
    # 3. A secrets file the link was pointed at by mistake.
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"[default]\naws_secret_access_key = {SECRET}\n")

    seen = 0
    for name, file, words in [
            ("100 MB file", big, "larger than EPD_ROSTER_MAX_BYTES"),
            ("2,000 instances", many, "more than EPD_ROSTER_MAX_INSTANCES (1024)"),
            ("secrets file", secrets, "not valid YAML at line")]:
        path.unlink()
        path.symlink_to(file)
        started = time.monotonic()
        os.kill(gw.proc.pid, signal.SIGHUP)
        timings[name], seen = wait_for_rejection(gw, seen, words, started)
        # The workers (old or new) keep serving from the last good roster.
        r = requests.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200, r.text
    assert SECRET not in whole_log(gw)
    time.sleep(0.5)  # gunicorn's queued reloads find each file read already: one line each
    log = whole_log(gw)
    for words in ("larger than EPD_ROSTER_MAX_BYTES", "more than EPD_ROSTER_MAX_INSTANCES",
                  "not valid YAML at line"):
        assert log.count(words) == 1, log
    print("\nSIGHUP -> rejection logged: " +
          ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
    assert timings["100 MB file"] < 5.0  # generous: a 100 MB parse took ~45 s

    # A good roster is adopted after all that.
    path.unlink()
    path.symlink_to(target)
    os.kill(gw.proc.pid, signal.SIGHUP)
    assert eventually(lambda: "reloaded: generation" in whole_log(gw), 20, interval=0.05)


def test_start_up_with_a_secrets_file_names_no_secret(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"db_password: {SECRET}\napi_token: {SECRET}\n")
    path = tmp_path / "roster.yaml"
    path.symlink_to(secrets)
    env = {**os.environ, "EPD_ROSTER": str(path), "PORT": str(free_port()),
           "EPD_WORKERS": "1", "EPD_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run([sys.executable, "-m", "gunicorn", "-k", "gevent", "wsgi:app"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "not a roster: its 2 top-level keys (lines 1, 2) are not a roster's" in out, out
    assert SECRET not in out
