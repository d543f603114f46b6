"""The two bookkeeping rules every upstream call goes through: whether a failure may run again
elsewhere (decided in ``errors.worth_another_instance`` alone) and a leg's life as a block
(``RequestContext.leg``)."""

from __future__ import annotations

import gevent
import pytest

from epd_flask.core import errors
from epd_flask.core.events import Events
from epd_flask.serving.context import RequestContext


def _status(code: int, stage: str = "decode") -> errors.BackendStatus:
    return errors.BackendStatus(f"answered {code}", upstream_status=code, body=b"",
                                content_type=None, stage=stage)


@pytest.mark.parametrize(("err", "retryable"), [
    (errors.BackendUnavailable("refused", stage="decode"), True),
    (errors.StreamInterrupted("cut", stage="prefill"), True),
    (_status(500), True),
    (_status(503, "prefill"), True),
    (_status(400), False),
    (_status(404), False),
    (errors.BackendTimeout("stalled", stage="decode"), False),
    (errors.BackendError("garbage", stage="decode"), False),
    (errors.NoBackend("none", stage="decode"), False),
    (errors.ClientDisconnected("gone"), False),
    (errors.ClientError("bad"), False),
    # An encoder failure is final for the request (its call was already tried elsewhere).
    (errors.BackendUnavailable("refused", stage="encode"), False),
    (_status(500, "encode"), False),
])
def test_one_rule_says_what_may_run_again(err: errors.ProxyError, retryable: bool) -> None:
    assert err.retryable is retryable
    if err.stage == "encode":  # the fan-out still sends that call once to another encoder
        assert errors.worth_another_instance(err)


class Seen(list[tuple[str, ...]]):
    """What a request context made with ``events`` told its observers about its legs."""

    def __init__(self) -> None:
        super().__init__()
        self.events = Events()
        self.events.upstream_opened.add_listener(lambda role, url: self.append(("opened", url)))
        self.events.upstream_closed.add_listener(lambda role, url: self.append(("closed", url)))
        self.events.upstream_error.add_listener(
            lambda stage, url, kind: self.append(("error", url, kind)))

    def context(self) -> RequestContext:
        return RequestContext("r", "/v1/completions", {}, events=self.events)


@pytest.fixture
def seen() -> Seen:
    return Seen()


def test_a_leg_block_closes_its_leg_however_it_ends(seen) -> None:
    ctx = seen.context()
    with ctx.leg("prefill", "prefill", "http://p") as leg:
        leg.status = 200
        assert ctx.legs == [leg]
    with pytest.raises(errors.BackendUnavailable), ctx.leg("decode", "decode", "http://d"):
        raise errors.BackendUnavailable("refused", stage="decode")
    with pytest.raises(errors.BackendTimeout), ctx.leg("decode", "decode", "http://d2"):
        raise errors.BackendTimeout("stalled", stage="decode")
    assert ctx.legs == []
    assert ctx.failed == {"http://d"}  # another instance may take it; a stall is no reason
    assert seen == [("opened", "http://p"), ("closed", "http://p"),
                    ("opened", "http://d"), ("closed", "http://d"),
                    ("error", "http://d", "upstream_unavailable"),
                    ("opened", "http://d2"), ("closed", "http://d2"),
                    ("error", "http://d2", "upstream_timeout")]


def test_a_killed_leg_closes_blaming_nobody(seen) -> None:
    ctx = seen.context()

    def wait() -> None:
        with ctx.leg("decode", "decode", "http://d"):
            gevent.sleep(10)

    g = gevent.spawn(wait)
    gevent.sleep(0)
    assert len(ctx.legs) == 1
    g.kill()
    assert ctx.legs == [] and ctx.failed == set()
    assert seen == [("opened", "http://d"), ("closed", "http://d")]


def test_a_held_leg_stays_open_until_the_request_finishes(seen) -> None:
    ctx = seen.context()
    with ctx.leg("decode", "decode", "http://d") as leg:
        leg.status = 200
        leg.hold()
    assert ctx.legs == [leg]
    ctx.finish(error=errors.StreamInterrupted("cut", stage="decode"))
    assert ctx.legs == []
    assert seen == [("opened", "http://d"), ("closed", "http://d"),
                    ("error", "http://d", "stream_interrupted")]
