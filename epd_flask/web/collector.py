"""A worker's garbage collector, set for a flood of requests (docs/benchmarks.md, the
``make bench-tenants`` section).

Every collection stops all of the worker's requests at once, for as long as it takes to walk
the generations it collects. Python starts one by a count of allocations minus deallocations,
and under a flood those balance: hundreds of requests arrive while as many end, so the young
generations grow to tens of thousands of live objects before the count calls a collection,
and the oldest one holds everything the waiting and running requests own. With Python's
thresholds (700, 10, 10) a worker carrying ~500 requests stalled 25-69 ms in full collections
every ~15 s and up to 40 ms in gen-1 ones. Here the young generations are also collected on a
clock, so each walks what a tenth of a second made (under 5 ms in the flood), and a full
collection is rare: a request's objects are freed by reference counting, not by the collector
(tests/serving/test_garbage.py), so the oldest generation gains little garbage between two.

Set up by the gevent worker (``web/worker.py``) once its app and ``post_worker_init``'s
greenlets are loaded; the master imports it with the worker class, and importing it changes
nothing.
"""

from __future__ import annotations

import gc

from epd_flask.core.periodic import Periodic

#: Seconds between two collections of the young generations (0 and 1).
YOUNG_EVERY = 0.1

#: The collector's own thresholds (gen 0, 1, 2). Every collection of gen 1, the clock's
#: included, counts towards gen 2: 6,000 of them is ~10 minutes at the clock's pace, busy or
#: idle, which bounds how long a cycle some error path leaves lives. Gen 1 every 3 gen-0
#: collections instead of 10, for a burst between two ticks.
THRESHOLDS = (700, 3, 6000)


def settle() -> Periodic:
    """Freeze what the worker has loaded (the app, its services and their greenlets live as
    long as it: no collection walks them again), set ``THRESHOLDS`` and start the clock."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    clock = Periodic("young collections", lambda: gc.collect(1), lambda: YOUNG_EVERY)
    clock.start()
    return clock
