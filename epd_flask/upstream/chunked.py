"""HTTP/1.1 chunked transfer coding (RFC 9112 section 7.1), decoded incrementally.

Pure: fed whatever one socket read brought, it returns every payload byte in it at once, so
the relay forwards all the events that arrived together in one write.
"""

from __future__ import annotations

from urllib3.exceptions import ProtocolError

#: A chunk-size line (with extensions) longer than this is refused, like urllib3 does.
MAX_LINE = 4096
HEX_DIGITS = b"0123456789abcdefABCDEF"

_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


class Decoder:
    __slots__ = ("_buf", "_left", "_state")

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0
        self._state = _SIZE

    @property
    def done(self) -> bool:
        """The last chunk and the trailer section have been read."""
        return self._state == _DONE

    def feed(self, data: bytes) -> bytes:
        """The payload carried by ``data`` (possibly empty); framing split across reads is
        kept for the next call. Raises ``ProtocolError`` on a malformed stream."""
        if self._state == _DONE:
            raise ProtocolError("data after the end of a chunked body")
        buf = self._buf + data if self._buf else data
        end = len(buf)
        pos = 0
        out: list[bytes] = []
        state, left = self._state, self._left
        while True:
            if state == _DATA:
                if pos >= end:
                    break
                take = min(left, end - pos)
                out.append(buf[pos:pos + take])
                pos += take
                left -= take
                if left:
                    break
                state = _DATA_END
            if state == _DATA_END:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ProtocolError("a chunk's data is not followed by CRLF")
                pos += 2
                state = _SIZE
            if state == _SIZE:
                eol = buf.find(b"\n", pos)
                if eol < 0:
                    if end - pos > MAX_LINE:
                        raise ProtocolError("chunk size line too long")
                    break
                line = buf[pos:eol].split(b";", 1)[0].strip()
                if not line or line.strip(HEX_DIGITS):
                    raise ProtocolError(f"invalid chunk size {line[:40]!r}")
                left = int(line, 16)
                pos = eol + 1
                state = _DATA if left else _TRAILER
                continue
            if state == _TRAILER:
                eol = buf.find(b"\n", pos)
                if eol < 0:
                    if end - pos > MAX_LINE:
                        raise ProtocolError("trailer line too long")
                    break
                blank = eol == pos or (eol == pos + 1 and buf[pos] == 13)
                pos = eol + 1
                if blank:
                    state = _DONE
                    break
                continue
            break
        self._state, self._left = state, left
        self._buf = buf[pos:] if pos < end else b""
        if state == _DONE and self._buf:
            raise ProtocolError("data after the end of a chunked body")
        if len(out) == 1:
            return out[0]
        return b"".join(out)
