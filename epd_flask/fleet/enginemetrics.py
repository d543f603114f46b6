"""What an instance's engine says about its queue: three of vLLM's scheduler gauges, read from
its ``GET /metrics`` by the prober (docs/behaviour.md#routing-policies).

Every proxy host and worker sees the same engine, so its queue counts the requests all of them
sent, which no worker's own count of its calls can. The names are vLLM 0.32's
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``): ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full),
labelled ``model_name`` and ``engine``, one series per engine (data-parallel rank); an
instance's figure is the sum over its series (the usage: their mean).

A read is bounded: at most ``MAX_BYTES`` are read (vLLM's whole page is ~100 KB per engine,
histograms included), within the probe timeout, and only lines that start with the three
names are parsed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epd_flask.upstream.transport import Transport

PATH = "/metrics"
WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = b"vllm:kv_cache_usage_perc"
NAMES = (WAITING, RUNNING, KV_USAGE)
#: The most of a /metrics page read; a larger one fails the read.
MAX_BYTES = 4 * 1024 * 1024
STAGE = "probe"


@dataclass(frozen=True)
class EngineLoad:
    """One read: requests waiting and running over the instance's engines, and their mean KV
    cache usage (None: not exported)."""

    waiting: int
    running: int
    kv_usage: float | None = None

    @property
    def queue(self) -> int:
        return self.waiting + self.running


class MetricsError(ValueError):
    pass


def _value(line: bytes) -> float:
    """A sample's value: the first field after the labels (a timestamp may follow)."""
    end = line.rfind(b"}")
    rest = line[end + 1:] if end >= 0 else line.split(None, 1)[1] if b" " in line else b""
    fields = rest.split()
    if not fields:
        raise MetricsError(f"no value in {line[:120]!r}")
    value = float(fields[0])
    if not math.isfinite(value):
        raise MetricsError(f"a value that is not a number: {line[:120]!r}")
    return value


def parse(text: bytes) -> EngineLoad:
    """The three gauges of a Prometheus text page; MetricsError when the queue's two are
    missing (not a vLLM page, or one too old to export them)."""
    sums: dict[bytes, list[float]] = {name: [] for name in NAMES}
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        for name in NAMES:
            if line.startswith(name) and line[len(name):len(name) + 1] in (b"{", b" "):
                sums[name].append(_value(line))
                break
    if not sums[WAITING] or not sums[RUNNING]:
        raise MetricsError(f"{WAITING.decode()} and {RUNNING.decode()} are not on the page")
    usage = sums[KV_USAGE]
    return EngineLoad(round(sum(sums[WAITING])), round(sum(sums[RUNNING])),
                      sum(usage) / len(usage) if usage else None)


def read(transport: Transport, url: str, timeout: float,
         headers: dict[str, str] | None = None) -> EngineLoad:
    """``url``'s engine load; ProxyError or MetricsError when it cannot be read."""
    resp = transport.send("GET", url + PATH, stage=STAGE, headers=headers or {},
                          read_timeout=timeout, total_timeout=timeout)
    status = resp.status_code
    data = transport.read_body(resp, STAGE, max_bytes=MAX_BYTES)
    if status != 200:
        raise MetricsError(f"{PATH} answered {status}")
    return parse(data)

