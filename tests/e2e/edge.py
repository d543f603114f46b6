"""Real nginx in front of test gunicorns, running the shipped etc/nginx.conf.

The shipped file is used as is except for the lines an operator edits too: the upstream's
``server`` lines (pointed at the test's gunicorn ports) and the ``listen`` line (a free loopback
port). Everything nginx needs besides (pid, logs, temp paths) lives in a generated wrapper under
the test's directory, so nothing outside it is touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import requests

from tests.helpers import eventually, free_port, stop_group

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONF = ROOT / "etc" / "nginx.conf"
START_TIMEOUT = 10.0
NGINX_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin",
                                     "/usr/local/nginx/sbin"])

_UPSTREAM = re.compile(r"(upstream\s+epd_flask\s*\{)(.*?)(\n\})", re.S)
_UPSTREAM_SERVER = re.compile(r"^(\s*)server\s+\S+(.*;)$", re.M)
_LISTEN = re.compile(r"^(\s*)listen\s+[^;]+;", re.M)


def nginx_binary() -> str | None:
    return shutil.which("nginx", path=NGINX_SEARCH_PATH)


def derive_conf(shipped: str, upstreams: list[str], listen_port: int) -> str:
    """The shipped server config with its upstream servers and listen address replaced.

    The shipped file lists several hosts; they are replaced in order (extra shipped lines are
    dropped, the first line's parameters are reused for extra test hosts). Fails loudly if
    the shipped file no longer has the shape this relies on, rather than testing something
    else.
    """
    match = _UPSTREAM.search(shipped)
    assert match, "etc/nginx.conf has no `upstream epd_flask { ... }` block"
    body = match.group(2)
    shipped_servers = _UPSTREAM_SERVER.findall(body)
    assert len(shipped_servers) >= 2, "etc/nginx.conf's upstream should list several hosts"
    indent, params = shipped_servers[0]
    lines = [f"{indent}server {hostport}{params}" for hostport in upstreams]
    first = _UPSTREAM_SERVER.search(body)
    assert first is not None
    body = _UPSTREAM_SERVER.sub("", body)
    body = body[:first.start()] + "\n".join(lines) + body[first.start():]
    conf = shipped[:match.start(2)] + body + shipped[match.end(2):]
    conf, listens = _LISTEN.subn(rf"\1listen 127.0.0.1:{listen_port};", conf)
    assert listens == 1, f"etc/nginx.conf should have one listen line, found {listens}"
    return conf


def wrapper_conf(workdir: Path, server_conf: Path) -> str:
    """A complete nginx.conf that includes the derived server config."""
    temp = {name: workdir / name for name in ("client_body", "proxy", "fastcgi", "uwsgi",
                                              "scgi")}
    for path in temp.values():
        path.mkdir(exist_ok=True)
    # As root, nginx workers would drop to `nobody`, which cannot enter pytest's 0700 dirs.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""daemon off;
master_process on;
worker_processes 1;
{user}pid {workdir}/nginx.pid;
error_log {workdir}/error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log {workdir}/access.log;
    client_body_temp_path {temp['client_body']};
    proxy_temp_path {temp['proxy']};
    fastcgi_temp_path {temp['fastcgi']};
    uwsgi_temp_path {temp['uwsgi']};
    scgi_temp_path {temp['scgi']};
    include {server_conf};
}}
"""


class Nginx:
    """One nginx master in the foreground (``daemon off``), stopped with its process group."""

    def __init__(self, binary: str | None, workdir: Path, upstreams: list[str]) -> None:
        assert binary, "nginx is not installed, and CI=true requires the tests through it"
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        server_conf = workdir / "epd-flask.conf"
        server_conf.write_text(derive_conf(SHIPPED_CONF.read_text(), upstreams, self.port))
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(wrapper_conf(workdir, server_conf))
        argv = [binary, "-p", str(workdir), "-c", str(self.conf), "-e", str(self.error_log)]
        check = subprocess.run([*argv, "-t", "-q"], capture_output=True, text=True, timeout=20)
        assert check.returncode == 0, f"nginx -t rejected the shipped config: {check.stderr}"
        self.log = open(workdir / "nginx.out", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_up()

    @property
    def error_log(self) -> Path:
        return self.workdir / "error.log"

    def errors(self) -> str:
        return self.error_log.read_text(errors="replace") if self.error_log.exists() else ""

    def _wait_up(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited early: {self.errors()[-3000:]}")
            requests.get(self.url + "/nginx-started", timeout=1)
            return True
        eventually(up, START_TIMEOUT, interval=0.05, ignoring=(requests.RequestException,),
                   what=lambda: f"nginx up: {self.errors()[-3000:]}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        stop_group(self.proc)
        self.log.close()
