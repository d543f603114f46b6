"""Handing the event loop back between the CPU-heavy steps of one large request.

Reading, parsing, hashing and serialising a multi-megabyte body each take milliseconds of
pure CPU; run back to back they stall every stream the worker carries for their sum. A yield
after each step bounds the stall to the longest single step.

The yield is a timer, not ``sleep(0)``: gevent runs ``sleep(0)`` resumptions as callbacks in
the same pass as other callbacks, before it polls sockets or fires timers again, so a chain of
them held the streams' I/O for the whole request (measured: the loop held 29-33 ms by a 4 MB
body despite a yield after every 256 KB step).
"""

from __future__ import annotations

import gevent

#: Steps over at least this many bytes yield afterwards; smaller bodies never pay for it.
LARGE_BYTES = 256 * 1024
#: Any positive sleep resumes only after the loop has polled I/O and run due timers.
YIELD_SECONDS = 1e-6


def after_step(size: int) -> None:
    if size >= LARGE_BYTES:
        yield_now()


def yield_now() -> None:
    """Let every other greenlet that is ready run, its I/O polled, before going on."""
    gevent.sleep(YIELD_SECONDS)
