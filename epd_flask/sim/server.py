"""Running a sim: the gevent WSGI server (plus the Mooncake bootstrap server for a Mooncake
prefill), started without blocking and stopped with its open connections.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from typing import Any

import gevent
from gevent.event import Event
from gevent.pool import Pool
from gevent.pywsgi import LoggingLogAdapter, WSGIHandler, WSGIServer
from gevent.socket import wait_read

from . import pacing
from .app import SimApp
from .bootstrap import BootstrapApp
from .config import SimConfig
from .state import SimState

logger = logging.getLogger(__name__)

#: How long ``stop`` lets handlers finish before killing them (hanging ones never finish).
STOP_GRACE_SECONDS = 0.2


class SimWSGIServer(WSGIServer):
    """Knows its open client connections, so ``close_connections`` can end them all."""

    def __init__(self, *args: Any, state: SimState | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_sockets: set[Any] = set()
        self.state = state

    def close_connections(self) -> None:
        for sock in list(self.open_sockets):
            pacing.hang_up(sock)


class SimHandler(WSGIHandler):
    """Hands the app the client socket (to notice hang-ups) and the headers as sent."""

    _requests_read = 0

    def handle(self) -> None:
        sock = self.socket
        # pywsgi writes the head and the body separately; with Nagle on, the body waits for
        # the client's delayed ACK (~40 ms per response on Linux), and SSE chunks bunch up.
        with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to tune
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.open_sockets.add(sock)
        state = self.server.state
        if state is not None:
            state.count("connections_opened")
        try:
            super().handle()
        finally:
            self.server.open_sockets.discard(sock)

    def read_requestline(self) -> str:
        """Like uvicorn under vLLM: after a response, wait at most ``keepalive_timeout`` for
        the next request, then close. A request that arrives as the timer fires is lost with
        the connection, which is the race a client's keep-alive handling must survive."""
        state = self.server.state
        idle = state.config.keepalive_timeout if state is not None else 0
        if idle and self._requests_read:
            pending = getattr(self.socket, "pending", None)
            if not (pending and pending()):
                try:
                    wait_read(self.socket.fileno(), timeout=idle,
                              timeout_exc=TimeoutError("keep-alive expired"))
                except TimeoutError:
                    state.count("keepalive_closes")
                    return ""
        self._requests_read += 1
        return super().read_requestline()

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        environ["sim.socket"] = self.socket
        # pywsgi sends the status line with the first body write; vLLM (uvicorn) sends it as
        # soon as the stream opens, before the first token. Writing b"" flushes it.
        environ["sim.flush_headers"] = lambda: self.write(b"")
        headers = getattr(self, "headers", None)
        if headers is not None:
            environ["sim.raw_headers"] = list(headers.items())
        return environ


def _wsgi_server(host: str, port: int, app: Any, name: str,
                 state: SimState | None = None) -> SimWSGIServer:
    tls: dict[str, Any] = {}
    if state is not None and state.config.tls_cert:
        tls["ssl_context"] = server_tls_context(state.config)
    return SimWSGIServer(
        (host, port),
        app,
        handler_class=SimHandler,
        # A pool (unbounded) so stop() can kill handlers stuck in hangs or long streams.
        spawn=Pool(),
        log=None,  # access logs would cost more than the zero-latency answers themselves
        error_log=LoggingLogAdapter(logging.getLogger(f"{__name__}.{name}"), logging.ERROR),
        state=state,
        **tls,
    )


def server_tls_context(config: SimConfig) -> ssl.SSLContext:
    """https for the sim: its certificate, and a client certificate required when a client
    CA is configured (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)  # type: ignore[arg-type]
    if config.tls_client_ca:
        context.load_verify_locations(cafile=config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class SimServer:
    """One simulated vLLM server. ``start()`` returns at once; ``stop()`` closes everything."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.state = SimState(config or SimConfig())
        self.config = self.state.config
        self._server: SimWSGIServer | None = None
        self._bootstrap: SimWSGIServer | None = None
        self._stopped = Event()

    def start(self) -> SimServer:
        cfg = self.config
        self.state.open_kv_events()
        self._server = _wsgi_server(cfg.host, cfg.port, SimApp(self.state), "api", self.state)
        self._server.start()
        if cfg.bootstrap_port is not None and cfg.role == "prefill":
            self._bootstrap = _wsgi_server(
                cfg.host, cfg.bootstrap_port,
                BootstrapApp(self.state.rank_engine_ids, self.state.transfers), "bootstrap")
            self._bootstrap.start()
        self._stopped.clear()
        logger.info("sim %s (%s) listening on %s, engine %s%s", cfg.role, cfg.model, self.url,
                    self.state.engine_id,
                    f", bootstrap {self.bootstrap_url}" if self._bootstrap else "")
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the sim is not started")
        return self._server.server_port

    @property
    def url(self) -> str:
        return f"{self.config.scheme}://{self.config.host}:{self.port}"

    @property
    def bootstrap_url(self) -> str | None:
        if self._bootstrap is None:
            return None
        return f"http://{self.config.host}:{self._bootstrap.server_port}"

    def serve_forever(self) -> None:
        """Start if needed and block this greenlet until ``stop()``."""
        if self._server is None or self._server.closed:
            self.start()
        self._stopped.wait()

    def stop(self) -> None:
        for server in (self._bootstrap, self._server):
            if server is not None and not server.closed:
                server.close()  # no new connections
                # Clients see EOF at once; hangs and paced streams notice and end.
                server.close_connections()
                server.stop(timeout=STOP_GRACE_SECONDS)
        self.state.close_kv_events()
        self._stopped.set()
        gevent.sleep(0)  # let killed handlers run their cleanup before we return

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
