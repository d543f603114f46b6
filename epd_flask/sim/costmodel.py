"""How long a busy engine takes: the sim's cost model, off unless configured.

With ``prefill_tokens_per_s`` > 0 the server behaves like one vLLM engine under load:
- prefill work is the prompt's *uncached* tokens (the prefix cache answers the rest), and all
  prefills of the server share one token budget: vLLM's scheduler fills each step with up to
  ``max_num_batched_tokens`` of waiting prompts first come, first served (chunked prefill), so a
  prompt waits for those queued before it. The engine's clock ``busy_until`` is that queue: a
  prefill of n uncached tokens ends n / rate seconds after the previous one ends (or now);
- the inter-token time of a stream is ``token_delay + token_delay_per_stream * (other
  streams running)``: decode steps are memory-bound, and each extra sequence in the batch adds
  its KV reads. It is fixed when the stream starts, from the streams running then (the end
  times of the answers this server planned);
- a decode that got no KV handles (selective disaggregation, a failed prefill) computes the
  prompt itself, through its own prefix cache and budget; with valid handles its first token
  is one decode step.
``kv_cache_blocks`` bounds each server's prefix cache (blocks of ``block_size`` tokens, LRU
eviction).
The clock also answers what vLLM's scheduler gauges say (``/metrics``): the prefills queued
and not started (``num_requests_waiting``) and the blocks the requests in flight hold until
they end (``kv_cache_usage_perc``).
Realistic figures and their sources are in docs/benchmarks.md.
"""

from __future__ import annotations

import bisect
import time


class EngineClock:
    """One server's queue of prefill work and its running streams."""

    def __init__(self) -> None:
        self.busy_until = 0.0
        self._stream_ends: list[float] = []
        self._starts: list[float] = []  # when each queued prefill starts computing, sorted
        self._held: list[tuple[float, int]] = []  # (until, blocks) of requests in flight

    def prefill(self, tokens: int, rate: float, now: float | None = None) -> float:
        """Seconds until a prefill of ``tokens`` uncached tokens, queued now, is done."""
        if rate <= 0 or tokens <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        start = max(now, self.busy_until)
        if start > now:
            bisect.insort(self._starts, start)
        self.busy_until = start + tokens / rate
        return self.busy_until - now

    def backlog(self, now: float | None = None) -> float:
        """Seconds of prefill work queued ahead of a prefill arriving now."""
        now = time.monotonic() if now is None else now
        return max(0.0, self.busy_until - now)

    def waiting(self, now: float | None = None) -> int:
        """Prefills queued that have not started computing."""
        now = time.monotonic() if now is None else now
        del self._starts[:bisect.bisect_right(self._starts, now)]
        return len(self._starts)

    def hold(self, blocks: int, until: float) -> None:
        """A request holds ``blocks`` of KV cache until ``until``."""
        if blocks > 0:
            bisect.insort(self._held, (until, blocks))

    def blocks_held(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        del self._held[:bisect.bisect_right(self._held, (now, 1 << 62))]
        return sum(blocks for _, blocks in self._held)

    def running(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        cut = bisect.bisect_right(self._stream_ends, now)
        del self._stream_ends[:cut]
        return len(self._stream_ends)

    def inter_token(self, base: float, per_stream: float, now: float | None = None) -> float:
        return base + per_stream * self.running(now)

    def stream_until(self, end: float) -> None:
        bisect.insort(self._stream_ends, end)

    def reset(self) -> None:
        self.busy_until = 0.0
        self._stream_ends.clear()
        self._starts.clear()
        self._held.clear()
