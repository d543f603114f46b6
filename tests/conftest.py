"""Shared fixtures: simulated instances and in-process proxies on free loopback ports.

The suite must run with gevent patching everything first
(``python -m gevent.monkey --module pytest``, which ``make test`` does): the proxy and the
simulators share this process's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gevent.monkey
import pytest

if not gevent.monkey.is_module_patched("socket"):
    raise pytest.UsageError(
        "run the tests with gevent patched from the start: "
        "`python -m gevent.monkey --module pytest` (or `make test`)"
    )

from gevent.pywsgi import WSGIServer

from epd_flask.app import create_app, services
from epd_flask.control.config import ProxyConfig
from epd_flask.control.roster import parse
from epd_flask.sim import SimConfig, SimServer
from tests.fakes import FakeUpstream, Handler, upstreams
from tests.helpers import NoDelayHandler
from tests.redisserver import redis_server  # noqa: F401  (a fixture: a real Redis)


class Proxy:
    """An epd-flask app served by gevent's WSGI server in this process."""

    def __init__(self, app: Any, server: WSGIServer) -> None:
        self.app = app
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_port}"

    @property
    def services(self) -> Any:
        return services(self.app)


@pytest.fixture
def sim() -> Iterator[Callable[..., SimServer]]:
    """Start simulated vLLM instances: ``sim(role="decode", token_delay=0.05)``."""
    started: list[SimServer] = []

    def start(role: str, **knobs: Any) -> SimServer:
        server = SimServer(SimConfig(role=role, **knobs)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def fake() -> Iterator[Callable[[Handler], FakeUpstream]]:
    """Start a hand-written upstream: ``fake(handler)`` (see ``tests/fakes.py``)."""
    with upstreams() as start:
        yield start


@pytest.fixture
def proxy() -> Iterator[Callable[..., Proxy]]:
    """Start a proxy over a roster document: ``proxy({"instances": [...]})``."""
    started: list[Proxy] = []

    def start(doc: dict[str, Any], probes: bool = False, **config: Any) -> Proxy:
        app = create_app(ProxyConfig(**config), parse(doc, "test roster"), seed=0)
        server = WSGIServer(("127.0.0.1", 0), app, log=None, handler_class=NoDelayHandler)
        server.start()
        services(app).listening_on([server.address])
        if probes:
            services(app).start()
        p = Proxy(app, server)
        started.append(p)
        return p

    yield start
    for p in started:
        services(p.app).stop()
        p.server.stop(timeout=1)
