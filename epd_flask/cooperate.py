"""Handing the event loop back between the CPU-heavy steps of one large request.

Reading, parsing, hashing and serialising a multi-megabyte body each take milliseconds of
pure CPU; run back to back they stall every stream the worker carries for their sum. A yield
after each step bounds the stall to the longest single step.
"""

from __future__ import annotations

import gevent

#: Steps over at least this many bytes yield afterwards; smaller bodies never pay for it.
LARGE_BYTES = 256 * 1024


def after_step(size: int) -> None:
    if size >= LARGE_BYTES:
        gevent.sleep(0)
