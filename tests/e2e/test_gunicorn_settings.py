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
from tests.helpers import free_port

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
