"""Concurrent encoder calls for one request, on a bounded gevent pool
(docs/behaviour.md#encoders-and-rewriting).

Every call starts at once (up to the bound); a call whose encoder is unreachable, answers 5xx
or dies mid-answer goes once to another live encoder; the first failure that stays ends the
fan-out and cancels the calls still running; one deadline covers the whole stage so a stalled
encoder cannot hold a worker forever. The calls themselves go through the transport like every
other upstream leg.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import gevent
from gevent.pool import Pool

from epd_flask.control.roster import Instance
from epd_flask.core.errors import (
    BackendTimeout,
    BackendUnavailable,
    ProxyError,
    instance_label,
    worth_another_instance,
)
from epd_flask.fleet.registry import Registry
from epd_flask.serving.context import OpenLeg, RequestContext
from epd_flask.upstream.transport import Transport, encode_json

logger = logging.getLogger(__name__)

ENCODE_STAGE = "encode"
ENCODE_PATH = "/v1/chat/completions"
#: How long cancelled calls get to close their connections before the error is raised.
CANCEL_GRACE_SECONDS = 1.0

#: Given the encoder that failed a call, another live one to send it to (None: there is none).
Alternate = Callable[[Instance], "Instance | None"]


@dataclass(frozen=True)
class EncoderCall:
    target: Instance
    body: dict[str, Any]
    headers: dict[str, str]


class Fanout:
    def __init__(self, transport: Transport, registry: Registry,
                 counters: Counter[str] | None = None) -> None:
        self.transport = transport
        self.registry = registry
        self.counters: Counter[str] = Counter() if counters is None else counters

    def run(self, calls: Sequence[EncoderCall], *, concurrency: int, timeout: float,
            ctx: RequestContext | None = None,
            alternate: Alternate | None = None) -> list[bytes]:
        """The answer bodies, in call order; the first failure is raised as it happens.
        With ``ctx``, each call is one of the request's upstream legs (in-flight, errors).

        ``alternate(failed)`` names another encoder for a call whose encoder failed without
        leaving work worth waiting for (unreachable, 5xx, cut mid-answer); the call is sent
        there once. A stall is not retried: it used up the stage's time.
        """
        pool = Pool(concurrency)
        targets = [call.target for call in calls]
        greenlets = [pool.spawn(self._call, i, call, timeout, ctx, targets, alternate)
                     for i, call in enumerate(calls)]
        deadline = gevent.Timeout(timeout)
        deadline.start()
        try:
            for done in gevent.iwait(greenlets):
                outcome = done.value
                if isinstance(outcome, ProxyError):
                    raise outcome
        except gevent.Timeout as exc:
            if exc is not deadline:
                raise
            stalled = sorted({targets[i].url for i, g in enumerate(greenlets) if not g.ready()})
            raise BackendTimeout(
                f"encoder {', '.join(instance_label(u) for u in stalled)} sent no answer "
                f"within {timeout:g} s (encoder_timeout); the request was abandoned",
                stage=ENCODE_STAGE, instance=",".join(stalled) or None) from None
        finally:
            deadline.close()
            pool.kill(block=True, timeout=CANCEL_GRACE_SECONDS)
        return [g.value for g in greenlets]

    def _call(self, index: int, call: EncoderCall, timeout: float, ctx: RequestContext | None,
              targets: list[Instance], alternate: Alternate | None) -> bytes | ProxyError:
        """One encoder request and, when allowed, its one retry on another encoder."""
        outcome = self._send(call.target, call, timeout, ctx)
        if not isinstance(outcome, ProxyError) or not worth_another_instance(outcome) \
                or alternate is None:
            return outcome
        other = alternate(call.target)
        if other is None or other.url == call.target.url:
            return outcome
        self.counters["retried_encode"] += 1
        if ctx is not None:
            ctx.retry(outcome)
            ctx.failed.add(call.target.url)
        logger.warning("request %s: encoder %s failed (%s); its item(s) go to encoder %s",
                       ctx.request_id if ctx else "-", call.target.url, outcome, other.url)
        targets[index] = other
        return self._send(other, call, timeout, ctx)

    def _send(self, target: Instance, call: EncoderCall, timeout: float,
              ctx: RequestContext | None) -> bytes | ProxyError:
        """A failure is returned, not raised, so gevent does not print it as an unhandled
        greenlet error."""
        headers = dict(call.headers)
        headers["Content-Type"] = "application/json"
        url = target.url
        # With the request's context the call is one of its legs (also when the fan-out is
        # cancelled: the leg ends with the greenlet).
        booked = (ctx.leg(ENCODE_STAGE, target.role, url) if ctx is not None
                  else nullcontext(OpenLeg(ENCODE_STAGE, target.role, url)))
        try:
            with booked as leg:
                if leg.span is not None:  # docs/behaviour.md#tracing
                    headers.update(leg.span.headers)
                resp = self.transport.send("POST", url + ENCODE_PATH, stage=ENCODE_STAGE,
                                           headers=headers, body=encode_json(call.body),
                                           read_timeout=timeout)
                leg.status = resp.status_code
                self.transport.raise_for_status(resp, ENCODE_STAGE)
                return self.transport.read_body(resp, ENCODE_STAGE,
                                                max_bytes=self.transport.max_answer_bytes)
        except BackendUnavailable as err:
            self.registry.record_failure(url, str(err))
            return err
        except ProxyError as err:
            return err
