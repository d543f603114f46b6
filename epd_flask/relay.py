"""Decode's answer to the client: bytes as they arrive, and an in-band error if it dies.

Once the status line is out, a failure can only be told inside the stream. For SSE the relay
forwards whole events (cheap: vLLM writes one event per chunk) so an error event never lands
in the middle of a half-relayed one. The upstream response is closed on every exit, including
the client going away (the WSGI server closes this generator), which is what frees the slot on
the instance.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import requests

from epd_flask import errors
from epd_flask.context import RequestContext
from epd_flask.errors import ProxyError
from epd_flask.transport import Transport

logger = logging.getLogger(__name__)

EVENT_END = b"\n\n"


def sse(transport: Transport, resp: requests.Response, ctx: RequestContext,
        stage: str = "decode") -> Iterator[bytes]:
    held = b""
    try:
        for chunk in transport.iter_raw(resp, stage):
            if held:
                chunk = held + chunk
                held = b""
            if not chunk.endswith(EVENT_END):
                cut = chunk.rfind(EVENT_END)
                if cut < 0:
                    held = chunk
                    continue
                held = chunk[cut + 2:]
                chunk = chunk[:cut + 2]
            ctx.chunks += 1
            ctx.bytes_out += len(chunk)
            yield chunk
        if held:
            ctx.bytes_out += len(held)
            yield held
        ctx.finish()
    except ProxyError as err:
        logger.warning("request %s: %s stream ended early: %s", ctx.request_id, stage, err)
        ctx.finish(error=err.message)
        yield errors.sse_event(err)
    except GeneratorExit:
        ctx.finish(error="client disconnected")
        raise
    finally:
        resp.close()


def raw(transport: Transport, resp: requests.Response, ctx: RequestContext,
        stage: str = "decode") -> Iterator[bytes]:
    """Any other body (pass-through), forwarded unframed.

    A failure is re-raised so the server drops the connection without the final chunk: for a
    body with no in-band error format, truncation the client can detect is the honest signal.
    """
    try:
        for chunk in transport.iter_raw(resp, stage):
            ctx.bytes_out += len(chunk)
            yield chunk
        ctx.finish()
    except ProxyError as err:
        logger.warning("request %s: %s body ended early: %s", ctx.request_id, stage, err)
        ctx.finish(error=err.message)
        raise
    except GeneratorExit:
        ctx.finish(error="client disconnected")
        raise
    finally:
        resp.close()
