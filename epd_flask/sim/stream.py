"""Playing an answer as vLLM's SSE stream: one write per chunk, paced by TTFT and the
inter-token delay, with the accounting of how the stream ended (completed, aborted by the
client, dropped by an injected fault).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import logprobs as lp
from . import pacing, wire
from .roles import Answer
from .state import SimState

logger = logging.getLogger(__name__)

Event = tuple[float, bytes]  # (seconds to wait before it, the bytes of one SSE event)


def plan_events(
    answer: Answer, *, chat: bool, include_usage: bool, model: str, fingerprint: str,
    ttft: float, token_delay: float, logprobs: int | None = None,
) -> list[Event]:
    """The SSE events of ``answer`` in order, each with the delay that precedes it."""
    rid, created = answer.request_id, int(time.time())
    chunk = wire.chat_chunk if chat else wire.completion_chunk
    # The last content chunk carries the fingerprint unless a usage chunk follows.
    final_fp = None if include_usage else fingerprint
    events: list[Event] = []
    delay = ttft
    if chat:
        for index in range(len(answer.pieces)):
            events.append((delay, wire.sse(wire.chat_role_chunk(rid, created, model, index))))
            delay = 0.0
    steps = max((len(p) for p in answer.pieces), default=0)
    offsets = [0] * len(answer.pieces)
    # An answer that ends at once (EOS first) still gets its finish chunk; an encoder-only
    # server's (no generation at all) gets none: real vLLM sends the role chunk (chat), the
    # usage chunk if asked, and [DONE].
    if steps == 0 and not answer.encoder_only:
        for index, reason in enumerate(answer.finish_reasons):
            events.append((delay, wire.sse(chunk(rid, created, model, index, "", reason,
                                                 final_fp))))
            delay = 0.0
    for step in range(steps):
        for index, pieces in enumerate(answer.pieces):
            if step >= len(pieces):
                continue
            last = step == len(pieces) - 1
            reason = answer.finish_reasons[index] if last else None
            events.append((delay, wire.sse(chunk(
                rid, created, model, index, pieces[step], reason, final_fp if last else None,
                _chunk_logprobs(pieces[step], step, offsets[index], chat, logprobs)))))
            offsets[index] += len(pieces[step])
            delay = 0.0
        delay = token_delay
    if include_usage:
        usage = wire.usage(answer.prompt_tokens, answer.completion_tokens, detailed=False)
        events.append((0.0, wire.sse(wire.usage_chunk(rid, created, model, chat, usage,
                                                      fingerprint))))
    events.append((0.0, wire.DONE))
    return events


def _chunk_logprobs(piece: str, position: int, offset: int, chat: bool,
                    k: int | None) -> dict[str, Any] | None:
    if k is None:
        return None
    if chat:
        return lp.chat_logprobs([piece], k, first_position=position)
    return lp.completion_logprobs([piece], k, first_offset=offset, first_position=position)


class StreamBody:
    """The WSGI response iterable of one stream: ``first_at`` (when given) is the monotonic
    time before which nothing is sent, read again while waiting (the engine's prefill queue
    may move it later); the events' own delays follow it.

    With ``record`` (the request's entry in /sim/requests), the first chunk's timing is added
    to it: ``first_token_ms``, when the cost model put the first token, after the request
    arrived, and ``first_token_late_ms``, how much later than that the chunk went out (the
    sim's own lateness on a busy machine, which a bench must tell from the engine's queue).

    A class, not a bare generator, because the server calls ``close()`` even when it never
    started iterating (client gone before the first write), and the in-flight count must drop
    exactly once whatever happens.
    """

    def __init__(
        self, events: list[Event], state: SimState, sock: Any | None,
        drop_after: int | None = None, flush_headers: Callable[[], None] | None = None,
        request_id: str | None = None, first_at: Callable[[], float] | None = None,
        record: dict[str, Any] | None = None,
    ) -> None:
        self._events = events
        self._first_at = first_at
        self._record = record
        self._request_id = request_id
        self._state = state
        self._sock = sock
        self._drop_after = drop_after
        self._flush_headers = flush_headers
        self._outcome: str | None = None
        state.count("streams_started")

    def __iter__(self) -> Iterator[bytes]:
        if self._flush_headers is not None:
            self._flush_headers()
        if self._first_at is not None and pacing.wait_until_or_gone(self._sock, self._first_at):
            pacing.hang_up(self._sock)
            self._finish("aborted")
            return
        if self._first_at is not None and self._record is not None:
            late = time.monotonic() - self._first_at()
            planned = time.time() - late - self._record["time"]
            self._record["first_token_ms"] = round(planned * 1000, 3)
            self._record["first_token_late_ms"] = round(late * 1000, 3)
        for sent, (delay, payload) in enumerate(self._events):
            if self._drop_after is not None and sent >= self._drop_after:
                pacing.hang_up(self._sock)
                self._finish("dropped")
                return
            if pacing.wait_or_gone(self._sock, delay):
                pacing.hang_up(self._sock)
                self._finish("aborted")
                return
            yield payload
        self._finish("completed")

    def close(self) -> None:
        # Reached with no outcome: a write failed or the server was stopped mid-stream.
        self._finish("aborted")

    def _finish(self, outcome: str) -> None:
        if self._outcome is not None:
            return
        self._outcome = outcome
        self._state.leave(self._request_id, slot=True)
        if outcome == "completed":
            self._state.count("streams_completed")
        elif outcome == "dropped":
            self._state.count("streams_dropped")
        else:
            self._state.abort(stream=True)
            logger.debug("stream aborted by the client")
