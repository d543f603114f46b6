"""Fixtures for the simulator tests: sims on 127.0.0.1 port 0, stopped after each test.

The root conftest insists on gevent patching; the sims run as greenlets in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest

from epd_flask.sim import SimConfig, SimServer

#: Polling bound for "eventually" assertions; every loop in these tests ends.
EVENTUALLY_SECONDS = 1.0
POLL_INTERVAL = 0.01


@pytest.fixture
def start_sim() -> Iterator[Callable[..., SimServer]]:
    servers: list[SimServer] = []

    def start(**fields: Any) -> SimServer:
        server = SimServer(SimConfig(**fields)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def eventually(check: Callable[[], bool], seconds: float = EVENTUALLY_SECONDS) -> bool:
    """Poll ``check`` until true or ``seconds`` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return check()
        gevent.sleep(POLL_INTERVAL)


@pytest.fixture
def wait_for() -> Callable[..., bool]:
    return eventually
