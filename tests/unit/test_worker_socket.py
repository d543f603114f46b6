"""The worker's client sockets write a stream's events with one plain ``send`` each, and are
otherwise gevent's: bytes whole and in order past a full buffer, the socket timeout, the
errors of a departed peer; a peer that takes no byte for the write timeout is reset."""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any

import gevent
import gevent.socket
import gevent.ssl
import pytest
from gunicorn.workers.ggevent import GeventWorker as StockGeventWorker

from epd_flask.web import worker

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'


class _Asks:
    """Counts the ``getsockopt`` calls gevent's ``sendall`` makes (one per call)."""

    __slots__ = ()
    calls: list[tuple[Any, ...]] = []

    def getsockopt(self, *args: Any) -> Any:
        self.calls.append(args)
        return super().getsockopt(*args)  # type: ignore[misc]


class _CountingStock(_Asks, gevent.socket.socket):
    __slots__ = ()


class _CountingLean(_Asks, worker.LeanSendSocket):
    __slots__ = ()


def _pair(cls: type | None = None, sndbuf: int | None = None) -> tuple[Any, Any]:
    a, b = gevent.socket.socketpair()
    if sndbuf is not None:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    worker.lean_client_socket(a)
    if cls is not None:
        a.__class__ = cls
    return a, b


def _tcp_pair() -> tuple[Any, Any]:
    """A lean client socket over loopback TCP (what a reset is made of) and its peer."""
    with gevent.socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        b = gevent.socket.socket()
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        b.connect(listener.getsockname())
        a, _ = listener.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    worker.lean_client_socket(a)
    return a, b


def test_an_event_is_sent_without_asking_the_kernel_for_the_buffer_size() -> None:
    for cls, asks in ((_CountingStock, 10), (_CountingLean, 0)):
        _Asks.calls = []
        a, b = _pair(cls)
        for _ in range(10):
            a.sendall(EVENT)
        assert b.recv(65536) == EVENT * 10
        assert len(_Asks.calls) == asks, cls
        a.close()
        b.close()


def test_more_than_the_buffers_hold_arrives_whole_and_in_order() -> None:
    a, b = _pair(sndbuf=4096)
    assert type(a) is worker.LeanSendSocket
    data = os.urandom(2 * 1024 * 1024)
    got = bytearray()

    def read() -> None:
        while len(got) < len(data) * 3:
            piece = b.recv(16384)
            if not piece:
                break
            got.extend(piece)
            gevent.sleep(0)

    reader = gevent.spawn(read)
    a.sendall(data)
    a.sendall(bytearray(data))  # not bytes: gevent's own sendall, unchanged
    a.sendall(memoryview(data))
    reader.join(timeout=20)
    assert bytes(got) == data * 3


def test_the_socket_timeout_still_bounds_a_send_the_peer_never_reads() -> None:
    a, b = _pair(sndbuf=4096)
    a.settimeout(0.2)
    with pytest.raises(TimeoutError):
        a.sendall(b"x" * (8 * 1024 * 1024))
    a.close()
    b.close()


def test_a_peer_that_takes_no_byte_for_the_write_timeout_is_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker.LeanSendSocket, "write_timeout", 0.3)
    a, b = _tcp_pair()
    with pytest.raises(worker.ClientWriteTimeout) as info:
        a.sendall(b"x" * (8 * 1024 * 1024))
    assert isinstance(info.value, ConnectionResetError)
    a.close()
    b.settimeout(5)
    with pytest.raises(ConnectionResetError):  # linger 0: the peer sees a reset, not an end
        while b.recv(1 << 20):
            pass
    b.close()


def test_a_slow_reader_is_served_past_the_write_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeout restarts with every byte taken: a reader slower than the whole write but
    never idle for the timeout gets every byte."""
    monkeypatch.setattr(worker.LeanSendSocket, "write_timeout", 0.3)
    a, b = _pair(sndbuf=4096)
    data = os.urandom(256 * 1024)
    got = bytearray()

    def read_slowly() -> None:
        while len(got) < len(data):
            got.extend(b.recv(16 * 1024))
            gevent.sleep(0.05)

    reader = gevent.spawn(read_slowly)
    started = gevent.get_hub().loop.now()
    a.sendall(data)
    reader.join(timeout=20)
    assert bytes(got) == data
    assert gevent.get_hub().loop.now() - started > 0.3  # longer than the timeout in all
    a.close()
    b.close()


def test_a_departed_peer_raises_what_gevent_raises() -> None:
    raised = []
    for lean in (False, True):
        a, b = gevent.socket.socketpair()
        if lean:
            worker.lean_client_socket(a)
        b.close()
        with pytest.raises(OSError) as info:
            a.sendall(EVENT)
        raised.append(type(info.value))
        a.close()
        with pytest.raises(OSError) as info:
            a.sendall(EVENT)
        raised.append(type(info.value))
    assert raised[:2] == raised[2:]
    assert raised[0] is BrokenPipeError


def test_only_plain_sockets_are_made_lean() -> None:
    a, b = gevent.socket.socketpair()
    ctx = ssl.create_default_context()
    wrapped = ctx.wrap_socket(a, do_handshake_on_connect=False, server_hostname="localhost")
    assert isinstance(wrapped, gevent.ssl.SSLSocket)
    worker.lean_client_socket(wrapped)
    assert type(wrapped) is gevent.ssl.SSLSocket
    wrapped.close()
    b.close()


def test_the_worker_hands_gunicorn_a_lean_client_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type] = []
    monkeypatch.setattr(StockGeventWorker, "handle",
                        lambda self, listener, client, addr: seen.append(type(client)))
    w = worker.GeventWorker.__new__(worker.GeventWorker)
    w._connections = {}  # type: ignore[assignment]
    w._listeners = {}  # type: ignore[assignment]
    w.worker_connections = 10
    a, b = gevent.socket.socketpair()
    w.handle(None, a, ("127.0.0.1", 1))
    assert seen == [worker.LeanSendSocket]
    a.close()
    b.close()
