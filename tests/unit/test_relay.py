"""What the SSE relay yields for each upstream read: all the events that read completed, as
one piece (one chunk frame and one send in gunicorn), never waiting for a later read and never
a partial event; and its per-event duties exact wherever the stream was cut: the events
counted for the chunks metric, the bytes, the usage rewrite."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from epd_flask.serving import relay, usage
from epd_flask.serving.context import RequestContext
from epd_flask.upstream.transport import Transport

#: A streamed chat answer as vLLM writes it: role chunk, tokens (one of them non-ASCII, so a
#: cut can fall inside a UTF-8 sequence), the finish chunk, the usage chunk, [DONE].
STREAM = b"".join(b"data: " + e + b"\n\n" for e in [
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}]}',
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"content":" \u00e9t\u00e9 \\"usage\\""},"logprobs":null,'
    '"finish_reason":null}]}'.encode(),
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop",'
    b'"stop_reason":null}]}',
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[],"usage":{"prompt_tokens":9,"total_tokens":12,"completion_tokens":3}}',
    b"[DONE]",
])
EVENTS = STREAM.count(b"\n\n")
#: The relay only reads it when no ``chunks`` are given; one for all, it is costly to build.
TRANSPORT = Transport()
SHORT = b'data: {"a":1}\n\ndata: {"usage":{"prompt_tokens":4}}\n\ndata: [DONE]\n\n'


class _Resp:
    deadline = None

    def close(self) -> None:
        pass


def _drive(pieces: list[bytes], rewrite: Callable[[bytes], bytes] | None = None
           ) -> tuple[list[bytes], list[bytes], RequestContext]:
    """The relay over these reads: what it yielded, what the client had been sent when the
    relay asked for each next read, and the request's counters."""
    out: list[bytes] = []
    sent_at_read: list[bytes] = []

    def reads() -> Iterator[bytes]:
        for piece in pieces:
            yield piece
            sent_at_read.append(b"".join(out))

    ctx = RequestContext("r", "/v1/chat/completions", {})
    out.extend(o for o in relay.sse(TRANSPORT, _Resp(), ctx,  # type: ignore[arg-type]
                                    chunks=reads(), rewrite=rewrite))
    return out, sent_at_read, ctx


def _check(stream: bytes, pieces: list[bytes], rewrite: Callable[[bytes], bytes] | None,
           want: bytes) -> None:
    out, sent_at_read, ctx = _drive(pieces, rewrite)
    assert b"".join(out) == want, pieces
    assert len(out) <= len(pieces)  # at most one piece per read
    read = b""
    for piece, sent in zip(pieces, sent_at_read, strict=False):
        read += piece
        whole = read[:read.rfind(b"\n\n") + 2] if b"\n\n" in read else b""
        # Every event this read completed was out before the next read, and nothing else.
        assert sent == (rewrite(whole) if rewrite and whole else whole), pieces
    assert ctx.chunks == stream.count(b"\n\n")
    assert ctx.bytes_out == len(want)


def test_one_cut_anywhere_in_a_real_stream() -> None:
    rewrite = partial(usage.rewrite_events, cached=5)
    rewritten = usage.rewrite_events(STREAM, 5)
    assert rewritten != STREAM and b'"prompt_tokens_details":{"cached_tokens":5}' in rewritten
    for cut in range(1, len(STREAM)):
        pieces = [STREAM[:cut], STREAM[cut:]]
        _check(STREAM, pieces, None, STREAM)
        _check(STREAM, pieces, rewrite, rewritten)


def test_two_cuts_anywhere_and_byte_by_byte() -> None:
    rewrite = partial(usage.rewrite_events, cached=2)
    rewritten = usage.rewrite_events(SHORT, 2)
    for a in range(1, len(SHORT)):
        for b in range(a, len(SHORT)):
            pieces = [p for p in (SHORT[:a], SHORT[a:b], SHORT[b:]) if p]
            _check(SHORT, pieces, None, SHORT)
            _check(SHORT, pieces, rewrite, rewritten)
    for stream, want in ((STREAM, STREAM), (SHORT, SHORT)):
        _check(stream, [stream[i:i + 1] for i in range(len(stream))], None, want)


def test_events_that_arrived_together_leave_as_one_piece() -> None:
    """Several events in one read: one yield, so one chunk frame and one send, with every
    event counted."""
    out, _, ctx = _drive([STREAM])
    assert out == [STREAM]
    assert ctx.chunks == EVENTS == 6
    halves = [STREAM[:len(STREAM) // 2], STREAM[len(STREAM) // 2:]]
    out, _, ctx = _drive(halves)
    assert len(out) == 2 and b"".join(out) == STREAM and ctx.chunks == EVENTS


def test_a_stream_cut_mid_event_keeps_its_whole_events_and_counts_only_them() -> None:
    """What was held of an unfinished event goes out at the end (it is decode's body) but is
    no event: the count stays the number of events that ended."""
    cut = STREAM.index(b"[DONE]") + 3
    out, _, ctx = _drive([STREAM[:cut]])
    assert b"".join(out) == STREAM[:cut]
    assert ctx.chunks == EVENTS - 1
