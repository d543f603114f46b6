"""Upstream TLS settings under gunicorn: an unusable CA bundle stops the start with a message
that names it."""

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
pytest.importorskip("cryptography")


def test_a_missing_ca_bundle_stops_gunicorn_with_a_clear_message(tmp_path: Path) -> None:
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump({"instances": []}))
    missing = tmp_path / "no-such-ca.pem"
    env = {**os.environ, "EPD_ROSTER": str(roster), "PORT": str(free_port()),
           "EPD_WORKERS": "1", "EPD_UPSTREAM_CA_BUNDLE": str(missing)}
    proc = subprocess.run([sys.executable, "-m", "gunicorn", "wsgi:app"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"CA bundle {missing} does not exist" in proc.stderr
