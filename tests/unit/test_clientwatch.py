"""The worker's one sweep over waiting requests' clients (``serving/clientwatch.py``): a client
that hangs up is acted on once, one still there never is, and the sweep ends with the last
watch; through HTTP, tests/serving/test_client_departure.py and test_admission.py show what a
request does then."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import gevent

from epd_flask.serving.clientwatch import Client, ClientWatch
from epd_flask.serving.legs import unless_client_leaves
from tests.helpers import eventually


@contextmanager
def connections(n: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """``n`` connected pairs: (the proxy's end, the client's end)."""
    with ExitStack() as stack:
        pairs = []
        for _ in range(n):
            ours, theirs = socket.socketpair()
            stack.enter_context(ours)
            stack.enter_context(theirs)
            pairs.append((ours, theirs))
        yield pairs


def test_the_client_that_hangs_up_is_acted_on_once_and_only_it() -> None:
    watch = ClientWatch(interval=0.01)
    seen: list[int] = []
    with connections(3) as pairs, ExitStack() as watching:
        for n, (ours, _) in enumerate(pairs):
            watching.enter_context(Client(watch, ours).watched(lambda n=n: seen.append(n)))
        pairs[1][1].sendall(b"a pipelined byte is not a departure")
        pairs[2][1].close()
        eventually(lambda: seen == [2], what="the departed client acted on")
        gevent.sleep(0.05)
        assert seen == [2] and len(watch) == 2
    assert len(watch) == 0
    eventually(lambda: watch._sweeper is None, what="the sweep ended with the last watch")


def test_a_leg_whose_client_leaves_is_killed_and_the_request_told() -> None:
    watch = ClientWatch(interval=0.01)
    ended: list[str] = []

    def upstream() -> str:
        try:
            gevent.sleep(30)
            return "answered"
        finally:
            ended.append("leg closed")
    with connections(1) as [(ours, theirs)]:
        waiting = gevent.spawn(unless_client_leaves, Client(watch, ours), upstream)
        gevent.sleep(0.05)
        theirs.close()
        waiting.join(5)
    assert waiting.dead and type(waiting.exception).__name__ == "ClientDisconnected"
    assert ended == ["leg closed"]
    with connections(1) as [(ours, _)]:
        assert unless_client_leaves(Client(watch, ours), lambda: "answered") == "answered"
