"""A real Redis server for the tests (Debian's ``redis-server``), on a free loopback port, with
nothing saved to disk; stopped with the test. With CI=true a missing ``redis-server`` fails
the tests that need it rather than skipping them (``.ci/run`` installs it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import eventually, free_port, stop_group

REQUIRED = os.environ.get("CI") == "true"
BINARY = shutil.which("redis-server", path=f"{os.environ.get('PATH', '')}:/usr/bin:/usr/sbin")


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert BINARY, "redis-server is not installed"
        self.proc = subprocess.Popen(
            [BINARY, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        eventually(self.ping, what=f"redis-server answering on port {self.port}")
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if BINARY is None:
        if REQUIRED:
            pytest.fail("redis-server is not installed, and CI=true requires the tests that "
                        "use it")
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
