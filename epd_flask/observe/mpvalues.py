"""prometheus_client's multiprocess values, updated without a lock and a pid check each time
in a worker whose threads are greenlets.

In multiprocess mode every ``inc``, ``set`` and histogram ``observe`` takes one process-wide
lock (a gevent lock once gevent patched ``threading``) and calls ``os.getpid()`` to notice a
fork, then writes the value into the process's mmap file: 0.87 us per update, ~23 updates per
non-stream request (docs/benchmarks.md#the-proxys-own-work-per-request-hotpathpy). Under gevent
the handlers are greenlets of one thread and an update never yields, so the lock can never be
contended; and a fork is noticed by ``os.register_at_fork`` instead of asked for on every
update. What is written, and when, is unchanged: each update still goes to the file at once,
so a scrape right after a request sees it. 0.19 us per update.

Like prometheus_client's own choice of value class, this is the process's: ``Metrics`` installs
it when an app of the process writes multiprocess files (observe/metrics.py says why the
choice cannot be an app's).
"""

from __future__ import annotations

import os
from typing import Any

import gevent.monkey
from prometheus_client import values

_forked = False


def _after_fork() -> None:
    global _forked
    _forked = True


def install() -> bool:
    """Use the lean value class for metrics created from now on, if this process writes
    multiprocess files and its threads are greenlets; True if installed."""
    base: Any = values.ValueClass
    if not getattr(base, "_multiprocess", False) or getattr(base, "lean", False) \
            or not gevent.monkey.is_module_patched("threading"):
        return False

    class GreenletValue(base):  # type: ignore[misc, valid-type]
        lean = True

        def inc(self, amount: float) -> None:
            if _forked:  # the base notices the new pid and opens this process's own files
                base.inc(self, amount)
                return
            self._value += amount
            self._timestamp = 0.0
            self._file.write_value(self._key, self._value, 0.0)

        def set(self, value: float, timestamp: float | None = None) -> None:
            if _forked:
                base.set(self, value, timestamp)
                return
            self._value = value
            self._timestamp = timestamp or 0.0
            self._file.write_value(self._key, value, self._timestamp)

    values.ValueClass = GreenletValue
    os.register_at_fork(after_in_child=_after_fork)
    return True
