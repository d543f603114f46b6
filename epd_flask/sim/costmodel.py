"""How long a busy engine takes: the sim's cost model, off unless configured.

With ``prefill_tokens_per_s`` > 0 the server behaves like one vLLM engine under load:
- prefill work is the prompt's *uncached* tokens (the prefix cache answers the rest), and all
  prefills of the server share one token budget: vLLM's scheduler fills each step with up to
  ``max_num_batched_tokens`` of prompts, the running requests' remaining chunks first, then
  the waiting queue's in its policy's order (chunked prefill), so a prompt waits for those
  before it. The engine's clock is that queue: a prefill of n uncached tokens ends n / rate
  seconds after the one before it ends (or now). A prefill that started computing keeps its
  place; among those not started, ``fcfs`` keeps arrival order and ``priority`` (vLLM's
  ``--scheduling-policy priority``: its waiting queue ordered by (priority, arrival)) puts a
  lower ``priority`` first, so a later urgent prompt moves the less urgent ones waiting
  back (their first tokens come later: ``Prefill.end`` moves). vLLM preempts a running
  request only when the KV cache has no block for a running one (the victim then is the
  running request of the highest (priority, arrival)); the cost model does not run out of
  KV blocks, so it never preempts;
- the inter-token time of a stream is ``token_delay + token_delay_per_stream * (other
  streams running) + token_delay_per_context_token * (their tokens of context)``: decode
  steps are memory-bound, and each extra sequence in the batch adds its KV reads, which grow
  with its context (the flat figure per stream holds for one context length; the figure per
  token for any). It is fixed when the stream starts, from the streams running then (the end
  times of the answers this server planned, each with its prompt and half its answer: its
  context on average over its life);
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
import itertools
import time
from dataclasses import dataclass


@dataclass(eq=False)
class Prefill:
    """One prompt's prefill in the engine's queue: ``end`` is when its last token is
    computed, which a more urgent prompt arriving before it starts moves later."""

    rank: int
    seq: int
    seconds: float
    start: float = 0.0
    end: float = 0.0


class EngineClock:
    """One server's queue of prefill work and its running streams."""

    def __init__(self) -> None:
        self._started_until = 0.0  # when the prefills that started computing are done
        self._queued: list[Prefill] = []  # not started, in the order they will run
        self._seq = itertools.count()
        self._streams: list[tuple[float, int]] = []  # (end, context tokens) of each stream
        self._held: list[tuple[float, int]] = []  # (until, blocks) of requests in flight

    @property
    def busy_until(self) -> float:
        """When every prefill queued now is done."""
        return self._queued[-1].end if self._queued else self._started_until

    def prefill(self, tokens: int, rate: float, now: float | None = None) -> float:
        """Seconds until a prefill of ``tokens`` uncached tokens, queued now first come, first
        served, is done."""
        if rate <= 0 or tokens <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        return self.queue(tokens, rate, 0, now).end - now

    def queue(self, tokens: int, rate: float, rank: int = 0,
              now: float | None = None) -> Prefill:
        """Queue a prefill of ``tokens`` uncached tokens now, before every prefill not started
        whose ``rank`` is higher (0 for all of them: first come, first served)."""
        now = time.monotonic() if now is None else now
        self._settle(now)
        job = Prefill(rank, next(self._seq), max(0, tokens) / rate if rate > 0 else 0.0)
        if job.seconds <= 0:
            job.start = job.end = now
            return job
        at = len(self._queued)
        while at > 0 and self._queued[at - 1].rank > rank:
            at -= 1
        self._queued.insert(at, job)
        t = max(now, self._started_until) if at == 0 else self._queued[at - 1].end
        for later in self._queued[at:]:
            later.start, later.end = t, t + later.seconds
            t = later.end
        self._settle(now)
        return job

    def _settle(self, now: float) -> None:
        """The queued prefills whose start has come leave the queue: they keep their place."""
        while self._queued and self._queued[0].start <= now:
            self._started_until = self._queued.pop(0).end

    def backlog(self, now: float | None = None) -> float:
        """Seconds of prefill work queued ahead of a prefill arriving now."""
        now = time.monotonic() if now is None else now
        return max(0.0, self.busy_until - now)

    def waiting(self, now: float | None = None) -> int:
        """Prefills queued that have not started computing."""
        now = time.monotonic() if now is None else now
        self._settle(now)
        return len(self._queued)

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
        del self._streams[:bisect.bisect_right(self._streams, (now, 1 << 62))]
        return len(self._streams)

    def inter_token(self, base: float, per_stream: float, now: float | None = None,
                    per_context_token: float = 0.0) -> float:
        step = base + per_stream * self.running(now)
        if per_context_token:
            step += per_context_token * sum(context for _, context in self._streams)
        return step

    def stream_until(self, end: float, context: int = 0) -> None:
        """A stream runs until ``end`` holding ``context`` tokens of KV (on average)."""
        bisect.insort(self._streams, (end, max(0, context)))

    def reset(self) -> None:
        self._started_until = 0.0
        self._queued.clear()
        self._streams.clear()
        self._held.clear()
