"""The transport's mapping of failures to the error taxonomy, against small fake servers on
loopback that misbehave in exactly one way each (refuse, never accept, never answer, answer an
error, answer garbage, cut a body short or frame it wrong), and chunked bodies however
they arrive."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import gevent
import pytest

from epd_flask.core import errors
from epd_flask.upstream.transport import Transport
from tests.fakes import ConnectionHandler, Handler, hints_then, read_request, response, upstreams
from tests.helpers import free_port


@pytest.fixture
def server() -> Iterator[Callable[[ConnectionHandler], str]]:
    """``server(handler)``: a listener on 127.0.0.1 whose every connection runs ``handler``."""
    with upstreams() as start:
        yield lambda handler: start(raw=handler).url


def answer(raw: bytes, then_wait: float = 0.0) -> ConnectionHandler:
    def handle(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(raw)
        gevent.sleep(then_wait)
    return handle


def silent(conn: socket.socket) -> None:
    read_request(conn)
    gevent.sleep(5)


def send(transport: Transport, url: str, read_timeout: float = 2.0, **kw):
    return transport.send("POST", url + "/v1/completions", stage="decode", headers={},
                          body=b"{}", read_timeout=read_timeout, **kw)


def test_a_refused_connection_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(errors.BackendUnavailable) as info:
        send(Transport(), url)
    assert info.value.status == 503 and info.value.stage == "decode"
    message = info.value.message
    assert message == f"decode instance {errors.instance_label(url)} is unreachable: " \
        "Connection refused"
    assert "127.0.0.1" not in message and url in str(info.value)  # the URL is for the logs


def test_a_listener_that_never_accepts_is_a_connect_timeout() -> None:
    """A full accept backlog drops SYNs: the connect itself times out (not the answer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):  # bounded: Linux's backlog of 0 holds one or two
            s = socket.socket()
            s.settimeout(0.2)
            fillers.append(s)
            try:
                s.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.skip("the kernel kept accepting into the backlog")
        with pytest.raises(errors.BackendUnavailable) as info:
            send(Transport(connect_timeout=0.2), f"http://127.0.0.1:{port}")
        assert "did not accept a connection within 0.2 s" in info.value.message
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_no_answer_within_the_read_timeout_names_the_stage(server) -> None:
    url = server(silent)
    with pytest.raises(errors.BackendTimeout) as info:
        send(Transport(), url, read_timeout=0.2)
    assert info.value.status == 504
    assert "did not answer within 0.2 s (decode timeout)" in info.value.message


def test_a_reply_that_is_not_http_is_unavailable(server) -> None:
    url = server(answer(b"SSH-2.0-OpenSSH_9.6\r\n"))
    with pytest.raises(errors.BackendUnavailable) as info:
        send(Transport(), url)
    assert info.value.retryable


def test_error_status_keeps_the_upstream_body(server) -> None:
    body = b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'
    url = server(answer(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)))
    transport = Transport()
    resp = send(transport, url)
    with pytest.raises(errors.BackendStatus) as info:
        transport.raise_for_status(resp, "prefill")
    assert info.value.status == 400 and info.value.body == body
    assert not info.value.retryable


def test_retryable_only_for_server_errors(server) -> None:
    url = server(answer(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nboom"))
    transport = Transport()
    resp = send(transport, url)
    with pytest.raises(errors.BackendStatus) as info:
        transport.raise_for_status(resp, "decode")
    assert info.value.retryable and info.value.status == 503 and info.value.body == b"boom"


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this much",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
], ids=["short content-length", "no last chunk", "bad chunk size"])
def test_a_body_cut_short_is_an_interrupted_stream(server, raw: bytes) -> None:
    url = server(answer(raw))
    transport = Transport()
    resp = send(transport, url)
    with pytest.raises(errors.StreamInterrupted) as info:
        transport.read_body(resp, "decode")
    assert "closed the connection mid-response" in info.value.message


def test_a_gap_between_chunks_past_the_chunk_timeout_names_it(server) -> None:
    url = server(answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"5\r\nhello\r\n", then_wait=2))
    transport = Transport()
    resp = send(transport, url, chunk_timeout=0.2)
    pieces = transport.iter_raw(resp, "decode")
    assert next(pieces) == b"hello"
    with pytest.raises(errors.BackendTimeout) as info:
        next(pieces)
    assert "sent nothing for 0.2 s between chunks (decode chunk timeout)" in info.value.message
    resp.close()


def test_a_complete_body_gives_its_connection_back_and_an_abandoned_one_closes_it(
        server) -> None:
    connections: list[socket.socket] = []
    closed_by_us = []

    def handle(conn: socket.socket) -> None:
        connections.append(conn)
        while request := read_request(conn):
            if b"/slow " in request:
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"3\r\none\r\n")
                closed_by_us.append(conn.recv(1) == b"")
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n")

    url = server(handle)
    transport = Transport()
    for _ in range(3):
        assert transport.read_body(send(transport, url), "decode") == b"onetwo"
    assert len(connections) == 1
    resp = transport.send("POST", url + "/slow", stage="decode", headers={}, body=b"{}",
                          read_timeout=2)
    assert next(transport.iter_raw(resp, "decode")) == b"one"
    resp.close()  # the instance is still writing: its connection must end
    assert transport.read_body(send(transport, url), "decode") == b"onetwo"
    assert len(connections) == 2 and closed_by_us == [True]
    transport.close()


# -- chunked bodies --------------------------------------------------------------------------

EVENTS = [b'data: {"token": "caf\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]
BODY = (b"%x\r\n%s\r\n" % (len(EVENTS[0]), EVENTS[0])
        + b"%x;ext=1\r\n%s\r\n" % (len(EVENTS[1]), EVENTS[1])
        + b"0\r\nX-Trailer: yes\r\n\r\n")
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def in_slices(raw: bytes, size: int, pause: float = 0.002) -> ConnectionHandler:
    """Answers every request with ``raw``, written ``size`` bytes at a time."""
    def handle(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while read_request(conn):
            for i in range(0, len(raw), size):
                conn.sendall(raw[i:i + size])
                gevent.sleep(pause)
    return handle


def test_events_that_arrived_together_come_out_at_once(server) -> None:
    url = server(answer(CHUNKED_HEAD + BODY, then_wait=1))
    transport = Transport()
    resp = send(transport, url)
    assert list(transport.iter_raw(resp, "decode")) == [b"".join(EVENTS)]
    assert resp.complete
    transport.close()


@pytest.mark.parametrize("size", [1, 3, 7])
def test_framing_split_anywhere_decodes_the_same(server, size: int) -> None:
    url = server(in_slices(CHUNKED_HEAD + BODY, size))
    transport = Transport()
    for _ in range(2):  # and the connection is reused: the trailer was read to its end
        assert transport.read_body(send(transport, url), "decode") == b"".join(EVENTS)
    assert transport.lifecycle.opened == 1
    transport.close()


def test_a_chunk_is_forwarded_before_its_end_arrives(server) -> None:
    def handle(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(CHUNKED_HEAD + b"a\r\nhello")
        gevent.sleep(0.3)
        conn.sendall(b"world\r\n0\r\n\r\n")
        gevent.sleep(1)

    transport = Transport()
    resp = send(transport, server(handle))
    pieces = transport.iter_raw(resp, "decode")
    assert next(pieces) == b"hello"
    assert list(pieces) == [b"world"]
    transport.close()


@pytest.mark.parametrize("bad", [b"x\r\n", b"-1\r\n", b"0x5\r\nhello\r\n",
                                 b"5\r\nhelloXX\r\n", b"5" * 5000 + b"\r\n"])
def test_malformed_framing_is_an_interrupted_stream(server, bad: bytes) -> None:
    url = server(answer(CHUNKED_HEAD + bad, then_wait=1))
    transport = Transport()
    resp = send(transport, url)
    with pytest.raises(errors.StreamInterrupted):
        transport.read_body(resp, "decode")
    transport.close()


def test_a_large_body_arrives_whole(server) -> None:
    """Sent in slices with the loop handed back between them; the instance sees one body."""
    received = []

    def handle(conn: socket.socket) -> None:
        head = read_request(conn)
        header, _, body = head.partition(b"\r\n\r\n")
        length = int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += conn.recv(1 << 20)
        received.append(body)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    url = server(handle)
    body = bytes(range(256)) * (3 << 12)  # 3 MB
    transport = Transport()
    resp = transport.send("POST", url + "/v1/completions", stage="decode", headers={},
                          body=body, read_timeout=5)
    assert transport.read_body(resp, "decode") == b"ok"
    assert received == [body]


# -- interim (1xx) answers ------------------------------------------------------------------

def numbered(interim: bytes) -> Handler:
    """Answers every request with ``interim``, then (as a server that hints early and answers
    when done) ``200 answer-<n>``, ``n`` counting requests across connections."""
    count = iter(range(1, 1000))
    return hints_then(interim, lambda _request: response(
        body=b"answer-%d" % next(count), content_type="text/plain"), 0.05)


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


@pytest.mark.parametrize("interim", [
    EARLY_HINTS,
    EARLY_HINTS + EARLY_HINTS,
    b"HTTP/1.1 100 Continue\r\n\r\n" + b"HTTP/1.1 102 Processing\r\n\r\n",
])
def test_interim_answers_are_skipped_and_each_request_reads_its_own_answer(
        fake, interim: bytes) -> None:
    upstream = fake(numbered(interim))
    url = upstream.url
    transport = Transport()
    for n in (1, 2, 3):
        resp = send(transport, url)
        assert resp.status_code == 200
        assert transport.read_body(resp, "decode") == b"answer-%d" % n
    assert len(upstream.connections) == 1  # each exchange ended cleanly: the connection reused
    transport.close()


def test_a_101_is_a_failed_exchange_and_its_connection_is_never_reused(fake) -> None:
    upstream = fake(numbered(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"))
    url = upstream.url
    transport = Transport()
    for n in (1, 2):
        with pytest.raises(errors.BackendError) as failed:
            send(transport, url)
        assert failed.value.status == 502 and not failed.value.retryable
        assert "101 Switching Protocols" in failed.value.message
        assert len(upstream.connections) == n  # the next request never read this one's 200
    transport.close()


def test_endless_interim_answers_fail_the_exchange(server) -> None:
    url = server(answer(EARLY_HINTS * 40, then_wait=1))
    transport = Transport()
    with pytest.raises(errors.BackendError) as failed:
        send(transport, url)
    assert "interim answers" in failed.value.message
    transport.close()
