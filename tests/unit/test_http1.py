"""The upstream HTTP/1.1 exchange as an instance and the proxy's callers see it: the exact
request bytes, what each misbehaving answer turns into (class and client message, the same as
when urllib3 and http.client carried the calls), when a connection is kept for the next
request, and the answer's header fields."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import gevent
import pytest

from epd_flask import __version__
from epd_flask.core import errors
from epd_flask.upstream.transport import Transport
from tests.fakes import ConnectionHandler, read_request, upstreams

OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture
def server() -> Iterator[Callable[[ConnectionHandler], tuple[str, list[socket.socket]]]]:
    """``server(handler)``: a loopback listener running ``handler`` on each connection; gives
    its URL and the list of connections it accepted."""
    with upstreams() as start:
        yield lambda handler: ((up := start(raw=handler)).url, up.connections)


def answering(*answers: bytes, then_wait: float = 1.0,
              seen: list[bytes] | None = None) -> ConnectionHandler:
    """Answers the n-th request on a connection with ``answers[n]``."""
    def handle(conn: socket.socket) -> None:
        for raw in answers:
            request = read_request(conn)
            if not request:
                return
            if seen is not None:
                seen.append(request)
            conn.sendall(raw)
        gevent.sleep(then_wait)
    return handle


def call(transport: Transport, url: str, method: str = "POST", body: bytes | None = b"{}",
         headers: dict[str, str] | None = None) -> bytes:
    resp = transport.send(method, url + "/v1/completions", stage="decode",
                          headers=headers or {}, body=body, read_timeout=2)
    return transport.read_body(resp, "decode")


# -- the request as the instance receives it ------------------------------------------------

def test_the_request_bytes(server) -> None:
    seen: list[bytes] = []
    url, _ = server(answering(OK, OK, OK, seen=seen))
    port = url.rsplit(":", 1)[1]
    transport = Transport()
    call(transport, url, headers={"X-Request-Id": "abc", "Content-Type": "application/json"})
    call(transport, url, method="GET", body=None)
    call(transport, url, body=None)
    agent = f"User-Agent: epd-flask/{__version__}\r\nAccept-Encoding: identity\r\n".encode()
    assert seen == [
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nContent-Length: 2\r\n%s"
        b"X-Request-Id: abc\r\nContent-Type: application/json\r\n\r\n{}" % (port.encode(), agent),
        b"GET /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%s\r\n%s\r\n" % (port.encode(), agent),
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nContent-Length: 0\r\n%s\r\n"
        % (port.encode(), agent),
    ]
    transport.close()


@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\nb", "a\rb"])
def test_a_header_that_would_split_the_request_is_refused_unsent(server, value: str) -> None:
    seen: list[bytes] = []
    url, _ = server(answering(OK, seen=seen))
    transport = Transport()
    with pytest.raises(errors.BackendError) as info:
        call(transport, url, headers={"X-Custom": value})
    assert info.value.message == (f"decode instance {errors.instance_label(url)} failed: "
                                  "ValueError")
    gevent.sleep(0.05)
    assert seen == []
    transport.close()


# -- what each failure becomes --------------------------------------------------------------

def _reset(conn: socket.socket) -> None:
    """Reads the request, then closes with an RST (linger 0): the close is ``_run``'s."""
    read_request(conn)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01" + b"\x00" * 7)


@pytest.mark.parametrize("handler, kind, words", [
    (answering(b"SSH-2.0-OpenSSH_9.6\r\n"), errors.BackendUnavailable,
     "is unreachable: ProtocolError"),
    (answering(b"", then_wait=0), errors.BackendUnavailable, "is unreachable: ProtocolError"),
    (answering(b"HTTP/1.1 200 OK\r\nContent-Le", then_wait=0), errors.BackendUnavailable,
     "is unreachable: ProtocolError"),
    (_reset, errors.BackendUnavailable, "is unreachable: Connection reset by peer"),
    (answering(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"),
     errors.BackendError, "answered 101 Switching Protocols to a request that asked for no "
                          "upgrade"),
], ids=["not http", "closed without answering", "closed mid-head", "reset", "101"])
def test_each_failure_keeps_its_class_and_message(server, handler: ConnectionHandler,
                                                  kind: type, words: str) -> None:
    url, _ = server(handler)
    transport = Transport()
    with pytest.raises(errors.BackendError) as info:
        call(transport, url)
    assert type(info.value) is kind
    assert info.value.message == f"decode instance {errors.instance_label(url)} {words}"
    assert info.value.stage == "decode"
    transport.close()


def test_a_total_deadline_bounds_the_wait_for_the_head(server) -> None:
    url, _ = server(answering(b"HTTP/1.1 200 OK\r\n", then_wait=2))
    transport = Transport()
    with pytest.raises(errors.BackendTimeout) as info:
        transport.send("POST", url, stage="prefill", headers={}, body=b"{}", read_timeout=5,
                       total_timeout=0.2)
    assert info.value.message == (f"prefill instance {errors.instance_label(url)} did not "
                                  "finish within 0.2 s (prefill total timeout)")
    transport.close()


def test_a_reused_connection_cut_after_part_of_the_answer_is_not_replayed(server) -> None:
    """The server read the request and began to answer: sending it again could run it
    twice. (Only a connection that dies before any byte of the answer is replayed.)"""
    def handle(conn: socket.socket) -> None:
        answering(OK, then_wait=0)(conn)
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        gevent.sleep(0.2)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01" + b"\x00" * 7)

    url, accepted = server(handle)
    transport = Transport()
    assert call(transport, url) == b"ok"
    with pytest.raises(errors.BackendUnavailable) as info:
        call(transport, url)
    assert info.value.message == (f"decode instance {errors.instance_label(url)} is "
                                  "unreachable: Connection reset by peer")
    assert len(accepted) == 1 and transport.lifecycle.replayed == 0
    transport.close()


# -- when a connection carries the next request ---------------------------------------------

@pytest.mark.parametrize("first, reused", [
    (OK, True),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", True),
    (b"HTTP/1.1 204 No Content\r\n\r\n", True),
    (OK + b"HTTP/1.1 200 OK\r\n", False),  # more than the answer: the stream is out of step
], ids=["keep-alive", "connection close", "http/1.0", "http/1.0 keep-alive", "204",
        "trailing bytes"])
def test_a_connection_is_reused_only_when_the_server_keeps_it(server, first: bytes,
                                                              reused: bool) -> None:
    def handle(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(first)
        if reused:
            answering(OK)(conn)
        else:
            gevent.sleep(1)

    url, accepted = server(handle)
    transport = Transport()
    call(transport, url)
    assert call(transport, url) == b"ok"
    assert len(accepted) == (1 if reused else 2)
    transport.close()


def test_a_body_delimited_by_the_connection_end_is_read_to_it(server) -> None:
    def handle(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nfirst ")
        gevent.sleep(0.05)
        conn.sendall(b"second")

    url, accepted = server(handle)
    transport = Transport()
    assert call(transport, url) == b"first second"
    assert call(transport, url) == b"first second"
    assert len(accepted) == 2
    transport.close()


# -- the answer's header fields -------------------------------------------------------------

def test_header_fields_by_any_spelling_and_in_the_order_sent(server) -> None:
    url, _ = server(answering(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nX-Trace:  a \r\n"
        b"Vary: Accept\r\nvary: Origin\r\nContent-Length: 2\r\n\r\n{}"))
    transport = Transport()
    resp = transport.send("POST", url, stage="decode", headers={}, body=b"{}", read_timeout=2)
    assert resp.headers.get("Content-Type") == "application/json"
    assert resp.headers.get("VARY") == "Accept, Origin"
    assert resp.headers.get("missing", "") == ""
    assert "CONTENT-LENGTH" in resp.headers and len(resp.headers) == 4
    assert list(resp.headers.items()) == [("content-type", "application/json"), ("X-Trace", "a "),
                                    ("Vary", "Accept"), ("Vary", "Origin"),
                                    ("Content-Length", "2")]
    assert transport.read_body(resp, "decode") == b"{}"
    transport.close()


@pytest.mark.parametrize("url, host", [
    ("http://example.com/v1/x", "example.com"),
    ("http://example.com:80/v1/x", "example.com"),
    ("https://example.com:443/v1/x", "example.com"),
    ("http://example.com:8000/v1/x", "example.com:8000"),
    ("https://example.com:80/v1/x", "example.com:80"),
    ("http://[::1]:8000/v1/x", "[::1]:8000"),
    ("http://example.com./v1/x", "example.com"),
])
def test_the_host_header_as_http_client_wrote_it(url: str, host: str) -> None:
    """No default port, brackets around an IPv6 address, no trailing dot."""
    transport = Transport()
    pool, target = transport._pool(url)
    assert pool.host_header == host and target == "/v1/x"
    transport.close()


# -- the wait for each read -----------------------------------------------------------------

def trickle(events: int, gap: float) -> ConnectionHandler:
    """A chunked answer, one piece every ``gap`` seconds, as decode's tokens."""
    def handle(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for n in range(events):
            gevent.sleep(gap)
            conn.sendall(b"3\r\n%03d\r\n" % n)
        conn.sendall(b"0\r\n\r\n")
        gevent.sleep(1)
    return handle


def test_a_wait_shorter_than_the_chunk_timeout_leaves_nothing_armed(server) -> None:
    """Each read's timer ends with the read: pieces 0.05 s apart for ~0.6 s under a 0.2 s
    chunk timeout all arrive, and the connection is kept for the next request."""
    url, accepted = server(trickle(12, 0.05))
    transport = Transport()
    resp = transport.send("POST", url, stage="decode", headers={}, body=b"{}", read_timeout=2,
                          chunk_timeout=0.2)
    assert b"".join(transport.iter_raw(resp, "decode")) == b"".join(
        b"%03d" % n for n in range(12))
    resp.close()
    gevent.sleep(0.3)  # past a timer that a read left running
    url2, _ = server(answering(OK))
    assert call(transport, url2) == b"ok"
    assert len(accepted) == 1
    transport.close()


def test_a_read_that_waits_builds_no_gevent_timeout(server, monkeypatch) -> None:
    """A stream waits once per relayed token: the wait is a plain loop timer, not gevent's
    ``Timeout`` object (and its unused exception) made for every read."""
    made: list[float] = []
    start_new = gevent.Timeout._start_new_or_dummy

    def counting(timeout: float | None = None, *args: object) -> gevent.Timeout:
        made.append(timeout or 0.0)
        return start_new(timeout, *args)

    url, _ = server(trickle(5, 0.02))
    transport = Transport()
    resp = transport.send("POST", url, stage="decode", headers={}, body=b"{}", read_timeout=2,
                          chunk_timeout=1)
    monkeypatch.setattr(gevent.Timeout, "_start_new_or_dummy", counting)
    assert len(b"".join(transport.iter_raw(resp, "decode"))) == 15
    assert made == []
    resp.close()
    transport.close()


def test_a_read_waits_its_whole_timeout_after_the_loop_was_held(server) -> None:
    """The wait is timed from when it starts, not from the event loop's last turn (which
    is older when the relay held the loop): 0.4 s of work, then a piece 0.2 s later under a
    0.5 s chunk timeout arrives."""
    def handle(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
        gevent.sleep(0.6)
        conn.sendall(b"3\r\ntwo\r\n0\r\n\r\n")
        gevent.sleep(1)

    url, _ = server(handle)
    transport = Transport()
    resp = transport.send("POST", url, stage="decode", headers={}, body=b"{}", read_timeout=2,
                          chunk_timeout=0.5)
    pieces = transport.iter_raw(resp, "decode")
    assert next(pieces) == b"one"
    held = time.monotonic() + 0.4
    while time.monotonic() < held:  # the loop held, as by a long piece of work
        pass
    assert next(pieces) == b"two"
    resp.close()
    transport.close()
