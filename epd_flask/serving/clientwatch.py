"""Whether a client hung up while its request waits: one sweep per worker over every client
whose request waits (for capacity, or for upstream legs before its answer starts), instead of
each request waking every ``CLIENT_CHECK_INTERVAL`` to ask.

A request that waits registers what to do if its client leaves (``Client.watched``); one
greenlet, alive while anything is watched, asks the kernel every ``CLIENT_CHECK_INTERVAL``
which watched sockets have something to read (one non-blocking ``poll`` over all of them: a
client that hung up reads as end of file), peeks at those alone and calls that for the ones
that hung up. With hundreds of requests waiting under a flood, their own wake-ups (a timer, two
greenlet switches and a peek each, ten times a second) took a fifth of the worker's CPU, which
every other request then waited for, and a peek at every socket each sweep still a tenth
(docs/behaviour.md#admission).
"""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gevent
from gevent import monkey

logger = logging.getLogger(__name__)

#: How often a waiting request's client is asked whether it is still there.
CLIENT_CHECK_INTERVAL = 0.1
#: Where gunicorn's workers put the client connection in the WSGI environ (``-k gevent``, and
#: the pywsgi-based worker).
SOCKET_KEYS = ("gunicorn.socket", "gunicorn.sock")

#: What to do when a watched client hung up: called from the sweep's greenlet, so it must
#: not block (it may set an event, or kill a greenlet without waiting).
OnGone = Callable[[], None]
#: The kernel's poll, not gevent's cooperative one: the sweep asks without waiting (timeout 0).
_poll = monkey.get_original("select", "poll")
#: A socket to look at: something to read (or end of file), or the peer gone or in error.
_READY = select.POLLIN | select.POLLPRI | select.POLLRDHUP


def peer_closed(sock: Any) -> bool:
    """True if the client at ``sock`` hung up; never consumes bytes it sent."""
    raw = getattr(sock, "_sock", sock)
    try:
        return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


class Client:
    """One request's client connection, as the watch sees it."""

    __slots__ = ("sock", "watch")

    def __init__(self, watch: ClientWatch, sock: Any) -> None:
        self.watch = watch
        self.sock = sock

    def gone(self) -> bool:
        return peer_closed(self.sock)

    @contextmanager
    def watched(self, on_gone: OnGone) -> Iterator[None]:
        """While the block runs, ``on_gone`` is called once if the client hangs up (noticed
        within ``CLIENT_CHECK_INTERVAL``)."""
        key = self.watch.add(self, on_gone)
        try:
            yield
        finally:
            self.watch.discard(key)


class ClientWatch:
    """One worker's sweep over the clients of waiting requests."""

    def __init__(self, interval: float = CLIENT_CHECK_INTERVAL) -> None:
        self.interval = interval
        self._watched: dict[int, tuple[Client, OnGone, int]] = {}
        #: The watches on each socket (by file descriptor), which the kernel is asked about.
        self._by_fd: dict[int, set[int]] = {}
        self._poller = _poll()
        self._next = 0
        self._sweeper: gevent.Greenlet | None = None

    def client(self, environ: dict[str, Any]) -> Client | None:
        """The WSGI request's client, when its server says where the connection is (gunicorn's
        workers do); None otherwise (nothing can be watched)."""
        sock = next((environ[key] for key in SOCKET_KEYS if key in environ), None)
        return Client(self, sock) if sock is not None else None

    def add(self, client: Client, on_gone: OnGone) -> int:
        self._next += 1
        key = self._next
        try:
            fd = client.sock.fileno()
        except (OSError, ValueError):
            fd = -1  # closed already: the next sweep finds it gone
        self._watched[key] = (client, on_gone, fd)
        keys = self._by_fd.get(fd)
        if keys is None:
            keys = self._by_fd[fd] = set()
            if fd >= 0:
                self._poller.register(fd, _READY)
        keys.add(key)
        if self._sweeper is None:
            self._sweeper = gevent.spawn(self._sweep)
        return key

    def discard(self, key: int) -> None:
        watched = self._watched.pop(key, None)
        if watched is None:
            return
        fd = watched[2]
        keys = self._by_fd[fd]
        keys.discard(key)
        if not keys:
            del self._by_fd[fd]
            if fd >= 0:
                self._poller.unregister(fd)

    def __len__(self) -> int:
        return len(self._watched)

    def _sweep(self) -> None:
        try:
            while self._watched:
                gevent.sleep(self.interval)
                ready = [fd for fd, _ in self._poller.poll(0)]
                if -1 in self._by_fd:
                    ready.append(-1)
                for fd in ready:
                    for key in list(self._by_fd.get(fd, ())):
                        watched = self._watched.get(key)
                        if watched is None or not watched[0].gone():
                            continue
                        self.discard(key)
                        try:
                            watched[1]()
                        except Exception:  # a bug: the other clients are still watched
                            logger.exception("acting on a client that hung up failed")
        finally:
            self._sweeper = None
