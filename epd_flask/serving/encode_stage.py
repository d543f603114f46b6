"""The encode stage of one request (E+PD, E+P+D): its media to the encoders, then the body the
next stage gets instead (docs/behaviour.md#encoders-and-rewriting), and the replica that stage
must run on (docs/behaviour.md#routing).

Each media item goes to the encoder the encode role's policy picks for it, keyed by the item's
content (the same image meets the same encoder's cache under ``prefix``).

Plans and rewrites with ``multimodal``, calls encoders through ``fanout``. A failed encoder call
goes once to another encoder (unreachable, 5xx, cut mid-answer); a failure that remains fails
the request before any prefill or decode call, and the request is not retried as a whole.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from epd_flask.control.roles import ENCODE
from epd_flask.control.roster import Instance, Settings
from epd_flask.core import cooperate, jsoncodec
from epd_flask.core.errors import BackendError, BackendStatus, instance_label
from epd_flask.core.headers import DP_RANK_HEADER, REQUEST_ID_HEADER
from epd_flask.fleet.policies import Placement, RouteRequest
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.routing import Router
from epd_flask.serving import multimodal
from epd_flask.serving.context import RequestContext
from epd_flask.serving.fanout import ENCODE_STAGE, EncoderCall, Fanout

logger = logging.getLogger(__name__)


@dataclass
class Staged:
    """What the P/D legs run with: the body for the next stage and headers for the stage that
    consumes the embeddings (its data-parallel rank when encoders pushed to one replica)."""

    body: dict[str, Any]
    consumer_headers: dict[str, str] = field(default_factory=dict)


class EncodeStage:
    def __init__(self, router: Router, registry: Registry, fanout: Fanout) -> None:
        self.router = router
        self.registry = registry
        self.fanout = fanout

    def run(self, body: dict[str, Any], ctx: RequestContext, consumer: Placement,
            settings: Settings, request: RouteRequest) -> Staged:
        """Encode ``body``'s media for ``consumer``, the instance (and replica) chosen to
        consume it.

        Text-only requests, and rosters without encoders, pass through untouched.
        """
        items = multimodal.extract(body)
        if not items or not self.registry.serves_anywhere(ENCODE, ctx.model):
            # No encoder for this model (docs/behaviour.md#models): the consumer encodes.
            return Staged(body)
        cooperate.after_step(ctx.bytes_in)  # extracting hashed every item's content
        started = time.monotonic()
        wanted = RouteRequest(model=ctx.model)
        targets = [p.instance for p in self.router.pick_each(
            ENCODE, [item.key.encode("utf-8") for item in items], wanted, ctx.decided)]
        consumer_zmq, headers = self._pin_replica(consumer)
        transfer_ids = {i.index: uuid.uuid4().hex for i in items} if consumer_zmq else {}
        rewrite = settings.rewrite_media
        batches = multimodal.plan_batches(items, targets, settings.encoder_max_batch_size)
        calls = [EncoderCall(
            batch.target,
            multimodal.encoder_body(body, batch.items, send_uuids=rewrite,
                                    consumer_zmq=consumer_zmq, transfer_ids=transfer_ids),
            self._child_headers(ctx, batch.items[0].index),
        ) for batch in batches]
        ctx.instances["encode"] = ",".join(dict.fromkeys(c.target.url for c in calls))
        try:
            answers = self.fanout.run(calls, concurrency=settings.encoder_concurrency,
                                      timeout=settings.encoder_timeout, ctx=ctx,
                                      alternate=partial(self._other_encoder, ctx=ctx))
        except BackendStatus:
            raise  # the encoder's own status reaches the client
        except BackendError as err:
            raise BackendError(f"encoding failed: {err.message}", code=err.code,
                               stage=ENCODE_STAGE, instance=err.instance) from err
        finally:
            ctx.mark("encode", started)
        audio_in_video = _use_audio_in_video(body)
        encoded: dict[int, multimodal.Encoded] = {}
        for call, batch, raw in zip(calls, batches, answers, strict=True):
            try:
                encoded.update(multimodal.match_batch(
                    batch.items, _reported(raw, call, ctx), send_uuids=rewrite,
                    audio_in_video=audio_in_video, transfer_ids=transfer_ids))
            except multimodal.ReportError as exc:
                raise BackendError(f"encoder {instance_label(call.target.url)} answered an "
                                   f"unusable ec_transfer_params: {exc}",
                                   code="bad_encoder_report", stage=ENCODE_STAGE,
                                   instance=call.target.url) from None
        started = time.monotonic()
        out = multimodal.rewrite(body, items, encoded) if rewrite else body
        out = multimodal.attach_handles(out, encoded, rewritten=rewrite)
        ctx.mark("rewrite", started)
        logger.debug("request %s: %d media item(s), %d encoder call(s), %d reported",
                     ctx.request_id, len(items), len(calls), len(encoded))
        return Staged(out, headers)

    def _other_encoder(self, failed: Instance, ctx: RequestContext) -> Instance | None:
        """A live encoder of the request's model other than ``failed`` for its call's one
        retry, if there is one."""
        if not any(i.url != failed.url for i in self.registry.live(ENCODE, ctx.model)):
            return None
        return self.router.pick(ENCODE, RouteRequest(model=ctx.model,
                                                     exclude=frozenset({failed.url})),
                                ctx.decided).instance

    @staticmethod
    def _pin_replica(consumer: Placement) -> tuple[str | None, dict[str, str]]:
        """With push consumers (docs/behaviour.md#routing), the replica the consumer's policy
        chose is named to both the encoders (its address) and the stage that runs the request
        (the rank header), so the push lands where the request runs. Pull and shared-storage
        connectors need no pinning."""
        inst = consumer.instance
        if not inst.ec_zmq_addrs:
            return None, {}
        rank = consumer.dp_rank or 0
        headers = {DP_RANK_HEADER: str(rank)} if inst.dp_size > 1 else {}
        return inst.ec_zmq_addrs[rank], headers

    @staticmethod
    def _child_headers(ctx: RequestContext, first_index: int) -> dict[str, str]:
        headers = dict(ctx.upstream_headers)
        headers[REQUEST_ID_HEADER] = f"{ctx.attempt_id}:{first_index}:{secrets.token_hex(3)}"
        return headers


def _use_audio_in_video(body: dict[str, Any]) -> bool:
    kwargs = body.get("mm_processor_kwargs")
    return isinstance(kwargs, dict) and bool(kwargs.get("use_audio_in_video"))


def _reported(raw: bytes, call: EncoderCall, ctx: RequestContext) -> Any:
    """The encoder's ``ec_transfer_params``; an unreadable answer reports nothing, so its
    items stay raw media and the next stage encodes them itself."""
    try:
        doc = jsoncodec.loads(raw)
    except ValueError:
        logger.warning("request %s: encoder %s answered non-JSON; its items stay raw",
                       ctx.request_id, call.target.url)
        return None
    return doc.get("ec_transfer_params") if isinstance(doc, dict) else None
