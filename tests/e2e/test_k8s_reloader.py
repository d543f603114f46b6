"""The roster-reloader sidecar of etc/k8s/deployment.yaml, run as written against a real
gunicorn: a changed roster is validated and reaches gunicorn by SIGHUP; a broken one is not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests import rosters
from tests.helpers import eventually, free_port, instances

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell")]

DEPLOYMENT = Path(__file__).resolve().parents[2] / "etc" / "k8s" / "deployment.yaml"


def sidecar() -> dict:
    pod = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "roster-reloader")


def swap_in(path: Path, doc: dict) -> None:
    """Replace the file in one step, as the kubelet's symlink flip does."""
    staged = path.with_suffix(".new")
    staged.write_text(yaml.safe_dump(doc))
    os.replace(staged, path)


def decode_urls(url: str) -> set[str]:
    return instances(url, "decode")


def test_reloader_sidecar_reloads_gunicorn_on_roster_change(procs, tmp_path: Path) -> None:
    container = sidecar()
    assert set(container["env"][i]["name"] for i in range(3)) == {"ROSTER_FILE", "PIDFILE",
                                                                    "POLL_SECONDS"}
    p, d1 = procs["sim"]("prefill"), procs["sim"]("decode")
    d2 = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}")  # listed only, never called
    pidfile = tmp_path / "gunicorn.pid"
    gw = procs["gunicorn"](rosters.roster([p], [d1]), "--pid", str(pidfile))
    roster = next(tmp_path.glob("roster-*.yaml"))
    log = tmp_path / "reloader.log"
    env = {**os.environ, "ROSTER_FILE": str(roster), "PIDFILE": str(pidfile),
           "POLL_SECONDS": "0.1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(log, "wb") as out:
        reloader = subprocess.Popen(container["command"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert decode_urls(gw.url) == {d1.url}
        old_workers = gw.workers()
        time.sleep(0.3)  # the reloader has read the starting roster
        changed_at = time.monotonic()
        swap_in(roster, rosters.roster([p], [d1, d2]))
        # Reloaded: the workers that served the old roster have all been replaced.
        assert eventually(lambda: not gw.workers() & old_workers, 15, interval=0.05)
        print(f"\nworkers replaced {(time.monotonic() - changed_at) * 1000:.0f} ms after the "
              "roster file was swapped")
        assert decode_urls(gw.url) == {d1.url, d2.url}

        swap_in(roster, {"instances": [{"role": "decode", "url": "not a url"}]})
        assert eventually(lambda: b"rejected" in log.read_bytes(), 10, interval=0.05)
        assert decode_urls(gw.url) == {d1.url, d2.url}
        assert gw.tail().count("Hang up") == 1  # the broken roster was never signalled
        assert reloader.poll() is None
    finally:
        reloader.terminate()
        reloader.wait(5)
