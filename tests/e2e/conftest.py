"""Real processes: simulators started with the console entry point, gunicorn with the gevent
worker exactly as operators run it, all on free loopback ports, all stopped afterwards."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest
import requests
import yaml

from tests.helpers import children, eventually, free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 20.0
#: Stops that ``Launcher.stop_all`` left running; the session's end waits for them.
STOPPING: list[gevent.Greenlet] = []


class Process:
    def __init__(self, argv: list[str], url: str, env: dict[str, str] | None = None,
                 cwd: Path = ROOT, log: Path | None = None) -> None:
        self._url = url
        #: Set by whoever started the process without waiting for it: the first read of
        #: ``url`` waits until it answers /health.
        self.starting = False
        self.log = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})},
                                     stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        self.ensure_up()
        return self._url

    def ensure_up(self) -> None:
        """Returns once the process answers /health if it was started without a wait."""
        if self.starting:
            self.starting = False
            self.wait_up()

    def wait_up(self, path: str = "/health") -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self._url} exited early: {self.tail()}")
            return requests.get(self._url + path, timeout=1).status_code == 200
        eventually(up, START_TIMEOUT, interval=0.05, ignoring=(requests.RequestException,),
                   what=lambda: f"{self._url} up: {self.tail()}")

    def stats(self) -> dict[str, Any]:
        return requests.get(self.url + "/sim/stats", timeout=5).json()

    def control(self, what: str, **doc: Any) -> None:
        requests.post(self.url + f"/sim/{what}", json=doc, timeout=5).raise_for_status()

    def workers(self) -> set[int]:
        """Pids of this process's children (a gunicorn master's workers); Linux /proc."""
        return children(self.proc.pid)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log and self.log.exists() \
            else ""

    def terminate(self) -> None:
        """Ask the process to stop gracefully, without waiting. Only the main process is
        signalled (as systemd's KillMode=mixed does): a gunicorn worker that gets SIGTERM
        from outside exits early, and a master busy in a reload would start another one."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


class Launcher:
    """Starts simulators and gunicorn masters on free ports, logs under ``log_dir``; stops
    them all at once (SIGTERM to every process first, so their graceful waits overlap).

    The simulators a test starts before its first gunicorn start side by side: each is
    waited for (answering /health) when its address is first read, and every one before a
    gunicorn starts. Those started later are waited for at once, as a test that restarts one
    times from there."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Process] = []
        self.serving = False  # a gunicorn was started

    def sim(self, role: str, *args: str, port: int | None = None) -> Process:
        port = port or free_port()
        p = Process([sys.executable, "-m", "epd_flask.sim.cli", "--role", role,
                     "--port", str(port), *args], f"http://127.0.0.1:{port}",
                    log=self.log_dir / f"sim-{role}-{port}.log")
        self.started.append(p)
        if self.serving:
            p.wait_up()
        else:
            p.starting = True
        return p

    def gunicorn(self, roster: dict[str, Any] | None, *args: str, workers: int = 1,
                 env: dict[str, str] | None = None, roster_file: Path | None = None,
                 port: int | None = None) -> Process:
        """Start gunicorn over ``roster`` (written to a file), or over an existing
        ``roster_file`` when ``roster`` is None. The master's state directory lives with the
        logs, so a master that had to be killed leaves nothing behind."""
        for q in self.started:
            q.ensure_up()  # a simulator still starting: up before gunicorn probes it
        self.serving = True
        port = port or free_port()
        if roster is not None:
            roster_file = roster_file or self.log_dir / f"roster-{port}.yaml"
            roster_file.write_text(yaml.safe_dump(roster))
        assert roster_file is not None
        p = Process([sys.executable, "-m", "gunicorn", *args, "wsgi:app"],
                    f"http://127.0.0.1:{port}", log=self.log_dir / f"gunicorn-{port}.log",
                    env={"EPD_ROSTER": str(roster_file), "PORT": str(port),
                         "EPD_WORKERS": str(workers),
                         "EPD_STATE_DIR": str(self.log_dir / f"state-{port}"), **(env or {})})
        self.started.append(p)
        p.wait_up()
        return p

    def stop_all(self) -> None:
        """SIGTERM to every process, then their graceful stops (a gunicorn worker notices
        its SIGTERM on a one-second tick) go on while the next test runs; the session's end
        waits for them and fails if one would not stop."""
        # A response the test dropped may still hold a kept-alive connection until the garbage
        # collector runs, and a stopping gunicorn worker waits for it (up to its keepalive).
        gc.collect()
        for p in reversed(self.started):
            p.terminate()
        STOPPING[:] = [g for g in STOPPING if not g.successful()]
        STOPPING.extend(gevent.spawn(p.stop) for p in reversed(self.started))
        self.started.clear()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gevent.joinall(STOPPING)
    stuck = [g.exception for g in STOPPING if g.exception is not None]
    STOPPING.clear()
    if stuck:
        session.config.get_terminal_writer().line(
            f"{len(stuck)} started processes would not stop: {stuck[0]!r}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[dict[str, Callable[..., Process]]]:
    launcher = Launcher(tmp_path)
    yield {"sim": launcher.sim, "gunicorn": launcher.gunicorn}
    launcher.stop_all()
