"""Fixtures for the simulator tests: sims on 127.0.0.1 port 0, stopped after each test.

The root conftest insists on gevent patching; the sims run as greenlets in this process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from epd_flask.sim import SimConfig, SimServer


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
