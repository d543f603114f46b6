"""A request's objects are freed by reference counting when it ends, not left in cycles for the
garbage collector: a request that lived long (a stream, a wait in the admission queue) has
reached the collector's oldest generation by then, and under a flood the full collections
that freed such cycles held a worker's event loop for 100-240 ms, every request's first token
with it (docs/benchmarks.md, make bench-tenants)."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import gevent
import requests

from tests.bodies import chat
from tests.rosters import roster

#: What one completion makes that must not outlive it in a cycle: the admission ticket and
#: its place in the queue, the upstream answer and its parser, Flask's request.
KINDS = ("Ticket", "Waiter", "Response", "HttpResponseParser", "Request", "TimedInput")


@contextmanager
def cycles() -> Iterator[Counter[str]]:
    """The objects of ``KINDS`` that only the collector could free, by kind, once the block
    ran (collected with every cycle kept for inspection)."""
    found: Counter[str] = Counter()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.update(type(o).__name__ for o in gc.garbage if type(o).__name__ in KINDS)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_queued_streamed_and_a_refused_request_leave_no_cycle(sim, proxy) -> None:
    server = sim("prefill_decode", token_delay=0.01, output_tokens=5)
    doc = roster(combined=[(server, {"max_concurrency": 1})],
                 admission={"tenant_header": "X-Tenant", "queue_timeout": 20, "max_queue": 1})
    doc["tenants"] = {"chat": {"priority": "high"}, "batch": {"priority": "low"}}
    px = proxy(doc)
    url = px.url + "/v1/chat/completions"

    def post(tenant: str, stream: bool) -> int:
        r = requests.post(url, json=chat(f"from {tenant}", max_tokens=5, stream=stream),
                          headers={"X-Tenant": tenant}, timeout=30)
        r.content  # noqa: B018 (read to its end)
        return r.status_code

    post("chat", True)  # the first request builds what lives as long as the app
    with cycles() as found:
        sent = [gevent.spawn(post, "batch", n % 2 == 0) for n in range(6)]
        statuses = [g.get(timeout=30) for g in sent]
    assert 200 in statuses and 503 in statuses, "some waited and went out, some were refused"
    assert not found, f"left in cycles: {dict(found)}"
