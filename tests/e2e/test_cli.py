"""The ``epd-flask`` command as an operator meets it: options generated from the settings'
declarations, bad input refused before anything binds, ``reload`` that never signals a
process it cannot vouch for."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import epd_flask
from epd_flask.control import cli, settings
from tests.helpers import children, free_port, stop_group

pytestmark = pytest.mark.e2e

COMMAND = str(Path(sys.executable).parent / "epd-flask")


def epd_flask_cmd(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in settings.ENV}
    return subprocess.run([COMMAND, *args], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=60)


def test_help_lists_every_setting_as_a_flag_with_its_variable_and_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags are the declarations: every variable but a key is one, shown with its
    variable and the README's default; keys are named as environment-only."""
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: a line per flag
    text = cli.build_parser().format_help()
    for var in settings.ENV.values():
        if var.secret:
            assert var.flag is None and var.name in text
            continue
        assert var.flag == "--" + var.name.removeprefix("EPD_").lower().replace("_", "-")
        shown = var.shown_default().replace("`", "") or "unset"
        entry = text[text.index(f"  {var.flag}"):text.index(f"(env {var.name};")]
        assert "(env " not in entry, entry
        assert f"(env {var.name}; default: {shown}" in text, var.name
    assert "--roster FILE" in text and "--bind HOST:PORT" in text and "--workers N" in text
    # Where the packaged example roster lies in this installation.
    assert f"{settings.DEFAULT_ROSTER})" in text


def test_version_is_the_package_and_distribution_version(tmp_path: Path) -> None:
    out = epd_flask_cmd("--version", cwd=tmp_path)
    assert out.returncode == 0
    assert out.stdout.strip() == f"epd-flask {epd_flask.__version__}"
    assert importlib.metadata.version("epd-flask") == epd_flask.__version__


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
    (["--workers", "many"], {},
     "argument --workers: EPD_WORKERS must be a whole number, got 'many'"),
    (["--admin-api-key=k"], {}, "unrecognized arguments: --admin-api-key=k"),
    ([], {"EPD_LOG_FORMAT": "xml"}, "EPD_LOG_FORMAT must be one of logfmt, json, got 'xml'"),
    (["reload", "extra"], {}, "unrecognized arguments: extra"),
    (["--body-timeout", "inf"], {},
     "argument --body-timeout: EPD_BODY_TIMEOUT must be a finite number of seconds, got 'inf'"),
    (["--port", "99999"], {}, "argument --port: PORT must be at most 65535, got 99999"),
])
def test_bad_flags_and_values_are_usage_errors(tmp_path: Path, args: list[str],
                                               env: dict[str, str], message: str) -> None:
    out = epd_flask_cmd(*args, cwd=tmp_path, **env)
    assert out.returncode == 2
    assert f"epd-flask: error: {message}" in out.stderr


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize(("roster", "names"), [
    (None, ["cannot read roster file"]),
    ({"instances": [{"role": "decoder", "url": "http://127.0.0.1:9"}]},
     ["instances[0] (http://127.0.0.1:9) field 'role'"]),
    ({"settings": {"probe_interval": -1}, "instances": []},
     ["settings field 'probe_interval'"]),
    ("instances: [", ["not valid YAML"]),
])
def test_a_missing_or_broken_roster_stops_it_before_binding(tmp_path: Path, roster: object,
                                                            names: list[str]) -> None:
    path = tmp_path / "roster.yaml"
    if isinstance(roster, dict):
        path.write_text(yaml.safe_dump(roster))
    elif isinstance(roster, str):
        path.write_text(roster)
    port = free_port()
    pidfile = tmp_path / "pid"
    out = epd_flask_cmd("--roster", str(path), "--bind", f"127.0.0.1:{port}", "--workers", "1",
                        "--pidfile", str(pidfile), cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith(f"epd-flask: cannot start: {path}: "), out.stderr
    for name in names:
        assert name in out.stderr
    assert "Traceback" not in out.stderr and "Listening" not in out.stderr
    assert not pidfile.exists() and _port_is_free(port)


def test_reload_with_no_running_server_says_so_and_signals_nothing(tmp_path: Path) -> None:
    out = epd_flask_cmd("reload", cwd=tmp_path)
    assert out.returncode == 1 and "no pidfile named" in out.stderr
    pidfile = tmp_path / "gunicorn.pid"
    out = epd_flask_cmd("reload", cwd=tmp_path, EPD_PIDFILE=str(pidfile))
    assert out.returncode == 1
    assert f"no server running: {pidfile} does not exist" in out.stderr
    # A stale pidfile: its process has exited.
    dead = subprocess.Popen(["true"])
    dead.wait()
    pidfile.write_text(f"{dead.pid}\n")
    out = epd_flask_cmd("reload", "--pidfile", str(pidfile), cwd=tmp_path)
    assert out.returncode == 1
    assert f"no server running: pid {dead.pid} in {pidfile} has exited" in out.stderr
    # A pid reused by some other process: SIGHUP would kill it, so it is not sent; neither to
    # one whose command line merely contains "gunicorn".
    for argv in (["sleep", "30"], [sys.executable, "-c", "import time; time.sleep(30)",
                                   "gunicorn", "--pidfile", str(pidfile)]):
        other = subprocess.Popen(argv)
        try:
            pidfile.write_text(f"{other.pid}\n")
            out = epd_flask_cmd("--pidfile", str(pidfile), "reload", cwd=tmp_path)
            assert out.returncode == 1 and "is not an epd-flask master" in out.stderr, argv
            time.sleep(0.2)
            assert other.poll() is None, argv
        finally:
            other.kill()
            other.wait()


def test_reload_signals_the_master_and_never_a_worker(tmp_path: Path) -> None:
    """A pidfile naming one of the master's workers (a pid the master once had, reused) is
    refused: a worker stops on SIGHUP. The master's own pid reloads."""
    port, pidfile = free_port(), tmp_path / "gunicorn.pid"
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump({"instances": [
        {"role": "prefill_decode", "url": f"http://127.0.0.1:{free_port()}"}]}))
    log = (tmp_path / "server.log").open("wb")
    clean = {k: v for k, v in os.environ.items() if k not in settings.ENV}
    server = subprocess.Popen(
        [COMMAND, "--port", str(port), "--pidfile", str(pidfile), "--workers", "1",
         "--roster", str(roster), "--state-dir", str(tmp_path / "state")],
        cwd=tmp_path, env=clean, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and children(server.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        (worker,) = children(server.pid)
        assert int(pidfile.read_text()) == server.pid
        stale = tmp_path / "stale.pid"
        stale.write_text(f"{worker}\n")
        out = epd_flask_cmd("--pidfile", str(stale), "reload", cwd=tmp_path)
        assert out.returncode == 1, out.stderr
        assert f"is a worker of the epd-flask master {server.pid}" in out.stderr
        assert worker in children(server.pid)
        out = epd_flask_cmd("--pidfile", str(pidfile), "reload", cwd=tmp_path)
        assert out.returncode == 0 and f"SIGHUP sent to the master (pid {server.pid})" \
            in out.stdout, out.stderr
        while "Hang up" not in (tmp_path / "server.log").read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "Hang up" in (tmp_path / "server.log").read_text()
    finally:
        stop_group(server)
        log.close()



def test_options_after_the_separator_go_to_gunicorn(tmp_path: Path) -> None:
    """After `--`, gunicorn's own options: --check-config makes it load the packaged
    configuration and app, then exit without binding."""
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump({"instances": []}))
    ok = epd_flask_cmd("--roster", str(roster), "--workers", "1", "--", "--check-config",
                       cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = epd_flask_cmd("--roster", str(roster), "--", "--bogus", cwd=tmp_path)
    assert bad.returncode == 2 and "gunicorn: error: unrecognized arguments: --bogus" \
        in bad.stderr
    wrong = epd_flask_cmd("check-roster", str(roster), "--", "--check-config", cwd=tmp_path)
    assert wrong.returncode == 2 and "are for gunicorn" in wrong.stderr
