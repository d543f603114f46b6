"""A bad environment variable stops gunicorn before it listens, with one message naming the
variable (the declarations in epd_flask/control/settings.py check it in the master)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import ROOT
from tests.helpers import eventually, free_port

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("name", "value", "message"), [
    # gunicorn's own setting: parsed once, in the master, by the declaration.
    ("EPD_WORKER_CONNECTIONS", "lots", "EPD_WORKER_CONNECTIONS must be a whole number, got "
                                       "'lots'"),
    # Read by the master's hook and by each worker's app: refused before any worker starts.
    ("EPD_LOG_FORMAT", "xml", "EPD_LOG_FORMAT must be one of logfmt, json, got 'xml'"),
])
def test_a_bad_variable_stops_gunicorn_naming_it(tmp_path: Path, name: str, value: str,
                                                 message: str) -> None:
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump({"instances": []}))
    env = {**os.environ, "EPD_ROSTER": str(roster), "PORT": str(free_port()),
           "EPD_WORKERS": "1", "EPD_STATE_DIR": str(tmp_path / "state"), name: value}
    proc = subprocess.run([sys.executable, "-m", "gunicorn", "wsgi:app"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"ValueError: {message}" in proc.stderr
    assert "Booting worker" not in proc.stderr


def test_each_master_has_a_control_socket_of_its_own(procs, tmp_path: Path) -> None:
    """Two masters of one user: gunicorn's default control socket is one path per user, so
    the second would take it over and the first's stop would remove it. Each answers on its
    own (in its state directory), and outlives the other's stop."""
    from gunicorn.ctl.client import ControlClient

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": ""}
    roster = {"instances": [{"role": "prefill_decode", "url": f"http://127.0.0.1:{free_port()}"}]}
    first, second = (procs["gunicorn"](roster, env=env) for _ in range(2))
    sockets = {}
    for master in (first, second):
        assert eventually(lambda m=master: "Control socket listening at" in m.tail(), 20)
        line = next(x for x in master.log.read_text().splitlines()
                    if "Control socket listening at" in x)
        sockets[master.proc.pid] = line.rsplit("listening at ", 1)[1].strip()
    assert len(set(sockets.values())) == 2, sockets
    for pid, path in sockets.items():
        assert eventually(lambda p=path: os.path.exists(p), 10)
        with ControlClient(path, timeout=10) as client:
            assert client.send_command("show stats")["pid"] == pid
    first.stop()
    with ControlClient(sockets[second.proc.pid], timeout=10) as client:
        assert client.send_command("show stats")["pid"] == second.proc.pid
    assert not (home / ".gunicorn").exists()
