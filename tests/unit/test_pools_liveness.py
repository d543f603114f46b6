"""A reused upstream connection is judged alive or dead without a trip through the hub, and
exactly as urllib3 would judge it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import urllib3.connection

from epd_flask.upstream.pools import ReplayingHTTPConnection
from tests.helpers import eventually


@pytest.fixture
def pair() -> Iterator[tuple[ReplayingHTTPConnection, socket.socket]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn = ReplayingHTTPConnection("127.0.0.1", listener.getsockname()[1], timeout=2)
    conn.connect()
    server, _ = listener.accept()
    listener.close()
    yield conn, server
    conn.close()
    server.close()


def _urllib3_says(conn: ReplayingHTTPConnection) -> bool:
    return super(ReplayingHTTPConnection, conn).is_connected


def test_an_idle_open_connection_is_alive_without_polling(pair, monkeypatch) -> None:
    conn, _ = pair
    with monkeypatch.context() as m:
        m.setattr(urllib3.connection, "wait_for_read", _no_poll)
        assert conn.is_connected is True
    assert _urllib3_says(conn) is True


def _no_poll(*args: object, **kw: object) -> bool:
    raise AssertionError("polled through the hub")


@pytest.mark.parametrize("server_does", ["close", "send", "reset"])
def test_a_connection_the_server_closed_or_wrote_to_is_not_reused(pair, server_does) -> None:
    conn, server = pair
    if server_does == "close":
        server.close()
    elif server_does == "send":
        server.sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
    else:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        server.close()
    eventually(lambda: not conn.is_connected, interval=0.01)  # the FIN/RST/bytes to arrive
    assert conn.is_connected is False
    assert _urllib3_says(conn) is False


def test_no_socket_is_not_connected() -> None:
    assert ReplayingHTTPConnection("127.0.0.1", 9).is_connected is False
