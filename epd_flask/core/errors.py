"""The proxy's error taxonomy and its rendering in OpenAI's error shape.

Every failure a client can see is one of these classes; the class says the status and which
stage failed, and ``worth_another_instance`` (the one place) whether the work may run again
elsewhere. Rendering happens in
one place (``render``/``sse_event``) so the wire shape cannot drift between code paths.
Imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


class ProxyError(Exception):
    """Root of everything the proxy turns into a client-visible error."""

    status: int = 500
    type: str = "internal_error"
    code: str = "internal_error"
    request_id: str | None = None
    #: Seconds a client should wait before trying again (sent as ``Retry-After``), if any.
    retry_after: int | None = None
    #: Further headers the error response carries (a tenant's rate limits).
    headers: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        stage: str | None = None,
        instance: str | None = None,
        param: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.stage = stage
        self.instance = instance
        self.param = param
        self.detail = detail

    def __str__(self) -> str:
        """The message as logs and ``/status`` show it: with the instance's URL and the
        low-level reason, which the client's copy (``payload``) never carries."""
        extra = "; ".join(x for x in (self.instance, self.detail) if x)
        return f"{self.message} [{extra}]" if extra else self.message

    @property
    def retryable(self) -> bool:
        """Whether the request may run again (on other instances) after failing with this,
        before anything reached its client: the work is worth another instance, and the
        stage that failed is not one whose failure ends the request."""
        return self.stage not in FINAL_STAGES and worth_another_instance(self)

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ClientError(ProxyError):
    """The request itself is wrong; no backend was (or will be) called."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class PayloadTooLarge(ClientError):
    status = 413
    code = "payload_too_large"


class RequestTimeout(ClientError):
    """The client did not send its whole request in time; the connection is closed after
    this answer (the rest of the body is never read)."""

    status = 408
    code = "request_timeout"


class NotFound(ClientError):
    status = 404
    code = "not_found"


class MethodNotAllowed(ClientError):
    status = 405
    code = "method_not_allowed"


class Conflict(ClientError):
    """The request contradicts the current state (e.g. an instance's role in the roster)."""

    status = 409
    code = "conflict"


class Unprocessable(ClientError):
    """Well-formed JSON whose fields are invalid."""

    status = 422
    code = "invalid_fields"


class Unauthorized(ProxyError):
    """A serving API key is missing or wrong (OpenAI's 401: an invalid_request_error)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(ProxyError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NoBackend(ProxyError):
    """No live instance can take this stage; a stable status operators can alert on."""

    status = 503
    type = "service_unavailable"
    code = "no_backend"


class ClientDisconnected(ProxyError):
    """The client went away before its answer started; nobody reads what we render."""

    status = 499
    type = "client_closed_request"
    code = "client_closed_request"


class Overloaded(ProxyError):
    """This worker already carries as many requests as it may; another worker or instance (or
    this one a moment later) can take it. 503 rather than 429: nothing is wrong with the
    client's rate, and load balancers (nginx ``proxy_next_upstream http_503``) and OpenAI's
    clients both retry a 503 that carries ``Retry-After``."""

    status = 503
    type = "service_unavailable"
    code = "overloaded"
    retry_after = 1


class RateLimited(ProxyError):
    """Over the tenant's rate limit (docs/behaviour.md#admission): OpenAI's 429, whose
    ``type`` names the limit reached (``requests`` or ``tokens``), with ``Retry-After``."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str = "requests") -> None:
        super().__init__(message)
        self.type = kind


class ShuttingDown(ProxyError):
    """The worker is stopping (SIGTERM, reload). Before the status line this is a 503; on a
    stream that outlived the grace period it is the in-band error that ends it."""

    status = 503
    type = "service_unavailable"
    code = "shutting_down"
    retry_after = 1


class BackendError(ProxyError):
    """An upstream instance failed in a way that is not the client's fault."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"


class BackendUnavailable(BackendError):
    """The instance could not be reached (refused, reset before a response): the instance
    never started the work."""

    status = 503
    code = "upstream_unavailable"


class BackendTimeout(BackendError):
    status = 504
    type = "timeout_error"
    code = "upstream_timeout"


class AnswerTooLarge(BackendError):
    """An instance answered more than the proxy reads from it (``EPD_MAX_UPSTREAM_BODY_BYTES``)."""

    code = "upstream_answer_too_large"


class StreamInterrupted(BackendError):
    """The upstream's answer was cut before its end: before anything reached the client the
    work may run elsewhere; after, it is reported in band."""

    code = "stream_interrupted"


class EventTooLarge(StreamInterrupted):
    """An upstream event past the proxy's limit: the stream ends rather than hold it whole."""

    code = "upstream_event_too_large"


class BackendStatus(BackendError):
    """The instance answered with an error status.

    4xx answers are the client's own fault as vLLM judged it, so its body is relayed as is.
    """

    def __init__(
        self,
        message: str,
        *,
        upstream_status: int,
        body: bytes,
        content_type: str | None,
        stage: str | None = None,
        instance: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message, status=upstream_status, stage=stage, instance=instance,
                         detail=detail)
        self.body = body
        self.content_type = content_type
        if upstream_status < 500:
            self.type = "invalid_request_error"
            self.code = "upstream_rejected"


def instance_label(url: str | None) -> str:
    """How a client-facing message names an instance: a short digest of its URL, the same in
    every worker and across reloads, so a client's report can be matched to the instance
    (logs and ``/status`` show the URL next to it) while internal addresses stay inside."""
    if not url:
        return "?"
    return hashlib.blake2s(url.encode(), digest_size=3, person=b"epd-inst").hexdigest()


#: Stages whose failure ends the request: a failed encoder call already went once to another
#: encoder (see ``fanout``), and the request as a whole does not run again
#: (docs/behaviour.md#encoders-and-rewriting).
FINAL_STAGES = frozenset({"encode"})


def worth_another_instance(err: ProxyError) -> bool:
    """Whether work that failed with ``err`` may run again on another instance; asked only
    while nothing of its answer reached the client.

    Yes when the instance never started it (unreachable), failed it itself (5xx) or died
    before its answer was complete. Not for a 4xx (the request is wrong: any instance would
    refuse it), a timeout (the stage's time is used up) or anything of the proxy's own.
    """
    if isinstance(err, (BackendUnavailable, StreamInterrupted)):
        return True
    return isinstance(err, BackendStatus) and err.status >= 500


def render(err: ProxyError) -> tuple[int, bytes, str]:
    """Status, body and content type for a client-facing error response.

    An upstream's own OpenAI-shaped error body is passed through unchanged so clients see
    vLLM's wording (e.g. "model does not exist"); anything else gets our shape.
    """
    if isinstance(err, BackendStatus) and _is_openai_error(err.body):
        return err.status, err.body, "application/json"
    return err.status, json.dumps(err.payload()).encode(), "application/json"


def extra_headers(err: ProxyError) -> list[tuple[str, str]]:
    """Headers an error response carries besides its body's content type."""
    headers = [("Retry-After", str(err.retry_after))] if err.retry_after is not None else []
    if isinstance(err, RequestTimeout):
        headers.append(("Connection", "close"))
    headers.extend(err.headers)
    return headers


def sse_event(err: ProxyError) -> bytes:
    """An in-band error for a stream whose status line was already sent."""
    return b"data: " + json.dumps(err.payload()).encode() + b"\n\n"


def _is_openai_error(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict)
