"""Concurrent encoder calls for one request, on a bounded gevent pool (M4).

Every call starts at once (up to the bound), the first failure ends the fan-out and cancels
the calls still running, and one deadline covers the whole stage so a slow encoder cannot hold
a worker forever. The calls themselves go through the transport like every other upstream leg.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gevent
from gevent.pool import Pool

from epd_flask.context import RequestContext
from epd_flask.errors import BackendTimeout, BackendUnavailable, ProxyError
from epd_flask.registry import Registry
from epd_flask.roster import Instance
from epd_flask.transport import Transport, encode_json

logger = logging.getLogger(__name__)

ENCODE_STAGE = "encode"
ENCODE_PATH = "/v1/chat/completions"
#: How long cancelled calls get to close their connections before the error is raised.
CANCEL_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class EncoderCall:
    target: Instance
    body: dict[str, Any]
    headers: dict[str, str]


class Fanout:
    def __init__(self, transport: Transport, registry: Registry) -> None:
        self.transport = transport
        self.registry = registry

    def run(self, calls: Sequence[EncoderCall], *, concurrency: int,
            timeout: float, ctx: RequestContext | None = None) -> list[bytes]:
        """The answer bodies, in call order; the first failure is raised as it happens.
        With ``ctx``, each call is one of the request's upstream legs (in-flight, errors)."""
        pool = Pool(concurrency)
        greenlets = [pool.spawn(self._call, call, timeout, ctx) for call in calls]
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
            raise BackendTimeout(f"encoders did not all answer within {timeout:g} s",
                                 stage=ENCODE_STAGE) from None
        finally:
            deadline.close()
            pool.kill(block=True, timeout=CANCEL_GRACE_SECONDS)
        return [g.value for g in greenlets]

    def _call(self, call: EncoderCall, timeout: float,
              ctx: RequestContext | None) -> bytes | ProxyError:
        """One encoder request; a failure is returned, not raised, so gevent does not print
        it as an unhandled greenlet error."""
        headers = dict(call.headers)
        headers["Content-Type"] = "application/json"
        url = call.target.url
        status: int | None = None
        failure: ProxyError | None = None
        if ctx is not None:
            ctx.leg_open(ENCODE_STAGE, call.target.role, url)
        try:
            resp = self.transport.send("POST", url + ENCODE_PATH, stage=ENCODE_STAGE,
                                       headers=headers, body=encode_json(call.body),
                                       read_timeout=timeout)
            status = resp.status_code
            self.transport.raise_for_status(resp, ENCODE_STAGE)
            return self.transport.read_body(resp, ENCODE_STAGE)
        except BackendUnavailable as err:
            self.registry.record_failure(url, str(err))
            failure = err
            return err
        except ProxyError as err:
            failure = err
            return err
        finally:  # also when the fan-out is cancelled: the leg ends with the greenlet
            if ctx is not None:
                ctx.leg_close(ENCODE_STAGE, url, status=status, error=failure)
