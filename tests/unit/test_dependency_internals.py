"""The private parts of gevent, urllib3 and gunicorn the hot path relies on, checked where a
change would otherwise go unnoticed.

setup.cfg bounds each of these dependencies below its next major version (prometheus_client,
a 0.x package, below its next minor); this is what to run against a new release before moving
a bound. Parts checked elsewhere, through behaviour: prometheus_client's multiprocess value
class (tests/unit/test_mpvalues.py) and file format (tests/unit/test_mpdir.py), the gevent
worker's ``timeout_ctx`` and ``handle`` and its class swap after ``post_fork``
(tests/e2e/test_slow_clients.py, both worker classes), the client socket's class swap
(tests/unit/test_worker_socket.py), urllib3's liveness check (tests/unit/test_pools_liveness.py)
and the pool sweep (tests/serving/test_keepalive.py).
"""

from __future__ import annotations

import _socket
import inspect
import socket
from collections.abc import Iterator

import gevent
import gevent.queue
import gevent.socket
import pytest
from gunicorn.workers.ggevent import GeventWorker as StockGeventWorker

from epd_flask.serving.clientwatch import peer_closed
from epd_flask.upstream.pools import Lifecycle, RetiringHTTPConnectionPool
from epd_flask.web.worker import GeventWorker, LeanSendSocket


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_gevent_socket_wraps_a_non_blocking_socket_and_its_read_watcher(pair) -> None:
    """``http1._recv``, ``LeanSendSocket.sendall``, the liveness peek and the client-departure
    check call ``_sock`` directly; ``http1._wait_readable`` waits on ``_read_event`` through
    ``hub.wait`` and leaves a second reader (a watcher already in use) to ``_wait``."""
    a, b = pair
    assert type(a) is gevent.socket.socket
    assert isinstance(a._sock, _socket.socket) and a._sock.gettimeout() == 0.0
    assert a.hub is gevent.get_hub()
    watcher = a._read_event
    assert watcher.callback is None  # nobody waits: http1 may use it with its own timer
    reader = gevent.spawn(a.recv, 1)
    gevent.sleep(0.01)
    assert watcher.callback is not None  # a reader waits: http1 defers to gevent's _wait
    b.sendall(b"x")
    assert reader.get(timeout=5) == b"x"
    assert watcher.callback is None
    b.sendall(b"y")
    with gevent.Timeout(5):
        a._wait(a._read_event)  # returns once readable, consuming nothing
    assert a._sock.recv(1) == b"y"


def test_a_loop_timer_takes_a_priority_and_starts_from_now() -> None:
    """``http1._wait_readable``'s timeout: ``loop.timer(seconds, priority=-1)`` started with
    ``update=True``, as gevent's own ``Timeout`` is."""
    fired: list[bool] = []
    timer = gevent.get_hub().loop.timer(0.01, priority=-1)
    timer.start(fired.append, True, update=True)
    try:
        gevent.sleep(0.1)
    finally:
        timer.close()
    assert fired == [True]


def test_the_departure_check_peeks_without_waiting_or_consuming(pair) -> None:
    """``clientwatch.peer_closed`` peeks at the raw socket (``_sock``): through gevent's ``recv`` a
    peek at an idle client would wait for its next byte."""
    a, b = pair
    with gevent.Timeout(2):
        assert peer_closed(a) is False
        b.sendall(b"next request")
        assert peer_closed(a) is False
        assert a.recv(64) == b"next request"
        b.close()
        assert peer_closed(a) is True


def test_a_client_socket_can_become_lean_in_place(pair) -> None:
    """``lean_client_socket`` swaps the class of gunicorn's accepted socket: gevent's socket
    class must keep a layout a slot-less subclass shares."""
    a, b = pair
    a.__class__ = LeanSendSocket
    a.sendall(b"through _sock")
    assert b.recv(64) == b"through _sock"


def test_a_urllib3_pool_hands_out_and_takes_back_connections_as_pools_py_expects() -> None:
    """``http1.exchange`` takes a connection with ``_get_conn`` and gives it back with
    ``_put_conn``; ``pools._Retiring`` overrides both and ``_new_conn``; the sweep reads the
    queue's ``queue`` in place, which urllib3 fills with ``maxsize`` placeholders (None)."""
    pool = RetiringHTTPConnectionPool("127.0.0.1", 9, maxsize=3, lifecycle=Lifecycle())
    try:
        assert isinstance(pool.pool, gevent.queue.LifoQueue)
        assert list(pool.pool.queue) == [None, None, None]
        conn = pool._get_conn()
        assert conn.lifecycle is pool.lifecycle  # made by our _new_conn
        assert list(pool.pool.queue) == [None, None]
        pool._put_conn(conn)
        assert pool.pool.queue[-1] is conn and conn.idle_since is not None
        assert pool._get_conn() is conn  # last in, first out
        pool._put_conn(conn)
        assert pool.sweep() == 0
    finally:
        pool.close()


def test_gunicorn_calls_the_worker_hooks_the_header_deadline_overrides() -> None:
    """``web.worker.GeventWorker`` overrides gunicorn's ``handle(listener, client, addr)``,
    ``handle_request(...)`` (a request's ``Expect: 100-continue``), ``load_wsgi()`` and
    ``timeout_ctx()`` (the context gunicorn reads each request's head in); the end-to-end
    proofs that gunicorn still calls them are tests/e2e/test_slow_clients.py,
    test_expect_continue.py and test_idle_connections.py."""
    for name in ("handle", "handle_request", "load_wsgi", "timeout_ctx"):
        assert list(inspect.signature(getattr(GeventWorker, name)).parameters) == \
            list(inspect.signature(getattr(StockGeventWorker, name)).parameters), name
    assert GeventWorker.__mro__[1] is StockGeventWorker  # adopt() swaps a forked stock worker


def test_a_gunicorn_request_marks_an_expected_100_continue_and_can_be_closed() -> None:
    """``web.worker.take_expectation`` reads and clears ``_expected_100_continue`` on
    gunicorn's parsed request (gunicorn then sends no ``100 Continue`` itself), and a reply
    given without reading the body calls ``force_close()`` on it."""
    from gunicorn.http.message import Request

    assert Request._expected_100_continue is False
    assert callable(Request.force_close)
