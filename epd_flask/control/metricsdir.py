"""The directory where every gunicorn worker writes its metrics (prometheus_client's
multiprocess mode): prepared fresh by the master before it forks, cleaned of dead workers.

Standard library only: the gunicorn master imports this, and importing prometheus_client would
load ``ssl`` there. ``mark_process_dead`` does what the library's function of that name does.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile

from epd_flask.control import settings

ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus_client's multiprocess gauge modes whose series die with their process
# (multiprocess._LIVE_GAUGE_MULTIPROCESS_MODES; a test pins the two lists together).
LIVE_GAUGE_MODES = ("liveall", "livesum", "livemax", "livemin", "livemostrecent")
OWNED_MARKER = ".epd-flask-owned"


def prepare(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """Point ``PROMETHEUS_MULTIPROC_DIR`` at an empty directory, before any worker exists.

    An operator's directory is emptied of earlier runs' files (stale counters would be summed
    in); without one, a private temporary directory is made and ``cleanup`` removes it.
    """
    env = os.environ if environ is None else environ
    path = settings.read(ENV, env)
    if path:
        os.makedirs(path, exist_ok=True)
        for stale in glob.glob(os.path.join(path, "*.db")):
            os.remove(stale)
    else:
        path = tempfile.mkdtemp(prefix="epd-flask-metrics-")
        with open(os.path.join(path, OWNED_MARKER), "w"):
            pass
        env[ENV] = path
    return path


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """Drop a dead worker's live gauges (in-flight and the like); its counters stay summed."""
    path = path or settings.read(ENV)
    if not path:
        return
    for mode in LIVE_GAUGE_MODES:
        for name in glob.glob(os.path.join(path, f"gauge_{mode}_{pid}.db")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)


def cleanup(path: str | None = None) -> None:
    """Remove the directory if ``prepare`` made it; an operator's directory is left alone."""
    path = path or settings.read(ENV)
    if path and os.path.exists(os.path.join(path, OWNED_MARKER)):
        shutil.rmtree(path, ignore_errors=True)
