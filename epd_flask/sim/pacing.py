"""Waiting the way a busy engine does, while noticing a client that hangs up.

A streaming server only learns of a departed client when a write fails, which may be many
seconds away during a long TTFT or an injected hang. Watching the socket for EOF while we wait
makes abort detection prompt and lets hanging requests end when their client does.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import gevent
from gevent import select

logger = logging.getLogger(__name__)

#: Re-check interval when the client has sent bytes we must not consume (pipelining).
BUSY_POLL_INTERVAL = 0.05
#: Waits up to this long (inter-token delays) sleep and then peek once: a departed client is
#: still noticed within one token, without select()'s watchers and timer on every token,
#: which were a third of the sim's CPU with 500 paced streams.
SHORT_WAIT = 0.1


def client_gone(sock: Any) -> bool:
    """True if the peer closed (EOF or error); never consumes request bytes."""
    # The raw socket: gevent's wrapper would park this greenlet on EWOULDBLOCK.
    raw = getattr(sock, "_sock", sock)
    try:
        return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def wait_or_gone(sock: Any | None, seconds: float) -> bool:
    """Sleep ``seconds``; return True early if the client at ``sock`` went away."""
    if seconds <= 0:
        return False
    if sock is None:
        gevent.sleep(seconds)
        return False
    if seconds <= SHORT_WAIT:
        gevent.sleep(seconds)
        return client_gone(sock)
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            readable, _, _ = select.select([sock], [], [], remaining)
        except (OSError, ValueError):
            return True  # the socket was closed under us (server stopping)
        if readable:
            if client_gone(sock):
                return True
            gevent.sleep(min(remaining, BUSY_POLL_INTERVAL))


def wait_until_or_gone(sock: Any | None, deadline: Callable[[], float]) -> bool:
    """Sleep until ``deadline()`` (a monotonic time that may move later while we sleep: a
    prefill a more urgent prompt overtook); True early if the client went away."""
    while True:
        remaining = deadline() - time.monotonic()
        if remaining <= 0:
            return False
        if wait_or_gone(sock, remaining):
            return True


def hang_up(sock: Any | None) -> None:
    """Cut the connection with no further bytes (no chunked terminator, no response)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError as exc:
        logger.debug("shutdown of a client socket failed: %s", exc)
