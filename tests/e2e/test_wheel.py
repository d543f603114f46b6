"""The wheel alone runs the proxy: built from this tree, installed into a fresh virtualenv
outside the checkout, started with its ``epd-flask`` command from a directory that is not
the checkout, it serves a stream, reloads on ``epd-flask reload`` and stops cleanly.

No network: the wheel is built with this environment's setuptools (``--no-build-isolation``),
the fresh virtualenv sees this environment's site-packages for the dependencies through a
``.pth`` line (a plain path, so this environment's editable-install hook for ``epd_flask``
is not run there), and only the wheel is installed into it (``--no-deps --no-index``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import requests
import yaml

import epd_flask
from epd_flask.control import settings
from tests import rosters
from tests.bodies import chat_stream
from tests.e2e.conftest import ROOT, START_TIMEOUT
from tests.helpers import eventually, free_port

pytestmark = pytest.mark.e2e

CHAT = chat_stream("hello", max_tokens=8)
#: What a source checkout holds that is no part of a build.
NOT_SOURCE = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
              ".ruff_cache", ".hypothesis")


def build_wheel(work: Path) -> Path:
    """``pip wheel`` on a copy of the tree, so no build directory is left in the checkout and
    nothing stale in one can slip into the wheel."""
    src = work / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "--quiet", "--disable-pip-version-check",
                    "-w", str(work / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    [wheel] = (work / "dist").glob("epd_flask-*.whl")
    return wheel


def fresh_venv(path: Path, wheel: Path, env: dict[str, str]) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=60)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = path / "lib" / version / "site-packages"
    assert site.is_dir(), site
    (site / "epd-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = path / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--quiet", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, timeout=120, env=env, cwd=path)
    return path


def clean_env() -> dict[str, str]:
    """This environment without any setting and without PYTHONPATH (which could lead
    Python to the checkout)."""
    env = {k: v for k, v in os.environ.items()
           if k not in settings.ENV and not k.startswith("EPD_") and k != "PYTHONPATH"}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
    return found


def stream(url: str) -> list[bytes]:
    with requests.post(url + "/v1/chat/completions", json=CHAT, stream=True, timeout=30,
                       headers={"Connection": "close"}) as r:
        assert r.status_code == 200, r.text
        return [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]


def health(url: str) -> dict:
    try:
        r = requests.get(url + "/health", timeout=2, headers={"Connection": "close"})
    except requests.RequestException:
        return {}
    return r.json() if r.status_code == 200 else {}


def test_the_wheel_serves_reloads_and_stops_outside_the_checkout(tmp_path: Path,
                                                                 procs) -> None:
    started = time.monotonic()
    env = clean_env()
    wheel = build_wheel(tmp_path / "build")
    built = time.monotonic()
    venv = fresh_venv(tmp_path / "venv", wheel, env)
    installed = time.monotonic()
    run = tmp_path / "run"  # the server's working directory: no etc/, no wsgi.py, no checkout
    run.mkdir()
    assert not (tmp_path.resolve()).is_relative_to(ROOT)
    command = venv / "bin" / "epd-flask"

    def epd_flask_cmd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(command), *args], cwd=run, env=env, capture_output=True,
                              text=True, timeout=60)

    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import epd_flask, epd_flask.wsgi; print(epd_flask.__file__)"],
                           cwd=run, env=env, capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr
    assert epd_flask_cmd("--version").stdout.strip() == f"epd-flask {epd_flask.__version__}"
    # The packaged example roster is in the wheel and is the default.
    check = epd_flask_cmd("check-roster")
    assert check.returncode == 0, check.stderr
    packaged = check.stdout.split(": ")[1]
    assert Path(packaged).is_relative_to(venv) and Path(packaged).is_file()
    assert not Path(packaged).is_symlink()
    assert check.stdout.strip().endswith("1 prefill, 1 decode; connector nixl")

    prefill = procs["sim"]("prefill")
    decode = procs["sim"]("decode", "--output-tokens", "8", "--token-delay-ms", "5")
    roster = run / "roster.yaml"
    doc = rosters.roster([prefill], [decode])
    roster.write_text(yaml.safe_dump(doc))
    sims_up = time.monotonic()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pidfile = run / "epd-flask.pid"
    log = tmp_path / "epd-flask.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(command), "--roster", str(roster), "--bind", f"127.0.0.1:{port}",
             "--workers", "1", "--pidfile", str(pidfile), "--state-dir", str(run / "state"),
             "--keepalive", "2", "--graceful-timeout", "10"],
            cwd=run, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        eventually(lambda: health(url).get("ready") or server.poll() is not None,
                   START_TIMEOUT, interval=0.05, what="server up")
        assert server.poll() is None, log.read_text()
        up = time.monotonic()
        # `epd-flask` became the gunicorn master (exec: same pid), running the packaged
        # configuration and app with the fresh virtualenv's interpreter.
        assert int(pidfile.read_text()) == server.pid
        argv = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode().split("\0")
        assert Path(argv[0]).is_relative_to(venv), argv
        assert argv[1:-1] == ["-m", "gunicorn", "-c", "python:epd_flask.control.gunicorn_config",
                              "epd_flask.wsgi:app"], argv

        events = stream(url)
        assert events[-1] == b"[DONE]"
        tokens = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
        assert sum(1 for t in tokens if t) == 8

        # Reload: a second decode joins through the roster file and `epd-flask reload`.
        decode2 = procs["sim"]("decode", "--output-tokens", "8", "--token-delay-ms", "5")
        doc["instances"].append({"role": "decode", "url": decode2.url})
        roster.write_text(yaml.safe_dump(doc))
        workers = children(server.pid)
        assert len(workers) == 1
        reloaded = epd_flask_cmd("--pidfile", str(pidfile), "reload")
        assert reloaded.returncode == 0, reloaded.stderr
        assert f"pid {server.pid}" in reloaded.stdout
        eventually(lambda: health(url).get("instances", {}).get("decode") == {"live": 2,
                                                                              "evicted": 0},
                   START_TIMEOUT, interval=0.05, what="the new decode in /health")
        eventually(lambda: children(server.pid) and not children(server.pid) & workers,
                   START_TIMEOUT, interval=0.05, what="old worker replaced")
        assert stream(url)[-1] == b"[DONE]"
        assert server.poll() is None
        reloaded_at = time.monotonic()

        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0, log.read_text()[-3000:]
        stopped = time.monotonic()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert not pidfile.exists()
    gone = epd_flask_cmd("--pidfile", str(pidfile), "reload")
    assert gone.returncode == 1 and "no server running" in gone.stderr
    print(f"\nwheel built {built - started:.1f} s, venv + install {installed - built:.1f} s, "
          f"simulators up {sims_up - installed:.1f} s, epd-flask up {up - sims_up:.1f} s, "
          f"stream + reload {reloaded_at - up:.1f} s, "
          f"stop {stopped - reloaded_at:.1f} s; total {stopped - started:.1f} s")
