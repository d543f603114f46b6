"""The upstream header parser builds what http.client's email-based one builds, and is used."""

from __future__ import annotations

import http.client
import io

import pytest

from epd_flask.upstream import pools, responsehead

BLOCKS = [
    b"",
    b"content-type: application/json\r\ncontent-length: 12\r\n",
    b"Date: Tue, 01 Dec 2026 15:00:00 GMT\r\nserver: uvicorn\r\nx-request-id:  ab c \t\r\n",
    b"set-cookie: a=1\r\nset-cookie: b=2\r\nSet-Cookie: c\r\n",
    b"empty:\r\nblank:   \r\nlf-only: yes\n",
    b"folded: one\r\n two\r\nnext: x\r\n",
    b" leading: space\r\nx: y\r\n",
    b"no colon here\r\nx: y\r\n",
    b"From nobody Tue Dec  1\r\nx: y\r\n",
    b"latin: caf\xe9\r\nx: y\r\n",
    b"cr: a\rb\r\nx: y\r\n",
    b"nel: a\x85b\r\n",
    b"vt: a\x0bb\r\n",
    b"name with space: v\r\n",
    b"colon:in:value: v:w\r\n",
]


def _state(msg: http.client.HTTPMessage) -> dict[str, object]:
    """Everything the message holds; defects (which compare by identity) by their types."""
    return {**vars(msg), "defects": [type(d) for d in msg.defects]}


@pytest.mark.parametrize("block", BLOCKS)
def test_same_message_as_http_client(block: bytes) -> None:
    raw = block + b"\r\nBODY"
    ours_fp, theirs_fp = io.BytesIO(raw), io.BytesIO(raw)
    ours = responsehead.parse_headers(ours_fp)
    theirs = http.client.parse_headers(theirs_fp)
    assert type(ours) is type(theirs)
    assert _state(ours) == _state(theirs)
    for name in ("content-type", "CONTENT-LENGTH", "set-cookie", "x", "missing", "nel"):
        assert ours.get(name) == theirs.get(name)
        assert ours.get(name, "none") == theirs.get(name, "none")
        assert ours[name] == theirs[name]
        assert ours.get_all(name) == theirs.get_all(name)
    assert ours.items() == theirs.items()
    assert ours_fp.read() == theirs_fp.read() == b"BODY"


def test_limits_still_apply() -> None:
    many = b"".join(b"x%d: y\r\n" % i for i in range(http.client._MAXHEADERS + 1))
    with pytest.raises(http.client.HTTPException):
        responsehead.parse_headers(io.BytesIO(many + b"\r\n"))
    with pytest.raises(http.client.LineTooLong):
        responsehead.parse_headers(io.BytesIO(b"x: " + b"a" * 70000 + b"\r\n\r\n"))


class _Sock:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(io.BytesIO(self.data))


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 100 Continue\r\nx: 1\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nok",
    b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nfolded: a\r\n b\r\ncontent-length: 2\r\n\r\nok",
])
def test_response_reads_as_http_clients(raw: bytes) -> None:
    ours = responsehead.LeanHTTPResponse(_Sock(raw), method="POST")  # type: ignore[arg-type]
    theirs = http.client.HTTPResponse(_Sock(raw), method="POST")  # type: ignore[arg-type]
    ours.begin()
    theirs.begin()
    for attr in ("status", "reason", "version", "chunked", "length", "will_close"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert _state(ours.msg) == _state(theirs.msg)
    assert ours.read() == theirs.read()


def test_upstream_connections_use_it() -> None:
    for cls in (pools.ReplayingHTTPConnection, pools.ReplayingHTTPSConnection):
        assert issubclass(cls.response_class, responsehead.LeanHTTPResponse)


def test_plain_blocks_skip_the_email_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(lines: list[bytes]) -> None:
        raise AssertionError(f"went through the email parser: {lines!r}")

    monkeypatch.setattr(responsehead, "_stdlib_parse", refuse)
    for block in BLOCKS[:5]:
        raw = block + b"\r\n"
        assert _state(responsehead.parse_headers(io.BytesIO(raw))) == _state(
            http.client.parse_headers(io.BytesIO(raw)))


@pytest.mark.parametrize("block", BLOCKS[:5])
def test_urllib3_reads_the_same_fields(block: bytes) -> None:
    from urllib3 import HTTPHeaderDict
    from urllib3.util.response import assert_header_parsing

    raw = block + b"\r\n"
    ours = responsehead.parse_headers(io.BytesIO(raw))
    theirs = http.client.parse_headers(io.BytesIO(raw))
    assert_header_parsing(ours)
    assert HTTPHeaderDict(ours.items()) == HTTPHeaderDict(theirs.items())
    assert list(ours.items()) == list(theirs.items())
