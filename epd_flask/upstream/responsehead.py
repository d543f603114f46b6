"""An upstream response's header block, read without the ``email`` package.

http.client hands the header lines of every response to ``email.parser`` (a feed parser built
for mail): ~36 us per response on the benchmark machine, two responses per non-stream request,
about a twentieth of the worker's CPU per request in the a32 profile (docs/benchmarks.md). The
header blocks vLLM and uvicorn send are plain ``name: value`` lines; for those this module
builds the very ``HTTPMessage`` the feed parser would (same fields, same order, same values,
empty payload, no defects) in ~6 us. Any other line (folded, no colon, a character outside
printable ASCII and tab, a bare CR) sends the whole block through http.client's own parser, so
whatever it makes of odd input, it still makes.
"""

from __future__ import annotations

import http.client
import re
import types
from typing import Any, BinaryIO

# A field name as the feed parser recognises one (printable ASCII but ':'), then the value
# (leading blanks dropped, as compat32 does), then the line end.
_PLAIN_FIELD = re.compile(rb"([\x21-\x39\x3b-\x7e]+):[\t ]*([\t\x20-\x7e]*)\r?\n")
# The blank line (or the end of the stream) that ends the block; http.client keeps it.
_END = (b"\r\n", b"\n", b"")


def parse_headers(fp: BinaryIO) -> http.client.HTTPMessage:
    """``http.client.parse_headers``, equal in result; its line and count limits apply."""
    lines = http.client._read_headers(fp)  # type: ignore[attr-defined]
    fields = []
    for line in lines:
        if line in _END:
            break
        match = _PLAIN_FIELD.fullmatch(line)
        if match is None:
            return _stdlib_parse(lines)
        fields.append(match.groups())
    msg = http.client.HTTPMessage()
    for name, value in fields:
        msg[name.decode("ascii")] = value.decode("ascii")
    msg.set_payload("")
    return msg


def _stdlib_parse(lines: list[bytes]) -> http.client.HTTPMessage:
    import email.parser

    text = b"".join(lines).decode("iso-8859-1")
    return email.parser.Parser(_class=http.client.HTTPMessage).parsestr(text)


def _begin_with_lean_headers() -> Any:
    """http.client's own ``HTTPResponse.begin`` (status line, 1xx skipping, framing and
    keep-alive decisions, whatever this Python's version does there), with this module's
    ``parse_headers`` in place of the one it looks up in its module."""
    begin = http.client.HTTPResponse.begin
    scope = {**vars(http.client), "parse_headers": parse_headers}
    return types.FunctionType(begin.__code__, scope, begin.__name__, begin.__defaults__,
                              begin.__closure__)


class LeanHTTPResponse(http.client.HTTPResponse):
    """The response class of the upstream connections (``pools.py``)."""

    begin = _begin_with_lean_headers()
