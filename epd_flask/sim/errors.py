"""vLLM's error bodies, in its two families: OpenAI-style ``{"error": {...}}`` for API errors
(including the pydantic "1 validation error" text FastAPI produces) and Starlette's
``{"detail": ...}`` for routing errors.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

#: vLLM names the error ``type`` after the exception class for the statuses it raises itself.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class SimError(Exception):
    """A request the sim refuses; rendered by ``error_body`` with ``status``."""

    def __init__(
        self, status: int, message: str, type_: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status) or _phrase(status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        return "Error"


def error_body(status: int, message: str, type_: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def _input_repr(value: Any) -> str:
    """How pydantic shows the offending input: containers summarised, scalars by repr."""
    if isinstance(value, dict):
        return f"'<dict of {len(value)} items>'"
    if isinstance(value, list):
        return f"'<list of {len(value)} items>'"
    return repr(value)


def validation_error(
    kind: str, loc: str, msg: str, value: Any, ctx: dict[str, Any] | None = None
) -> SimError:
    """FastAPI's 400 for a body that fails the pydantic request model (type "Bad Request")."""
    detail = f"{{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', 'input': {_input_repr(value)}"
    if ctx:
        detail += f", 'ctx': {ctx!r}"
    detail += "}"
    return SimError(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


def invalid_json(position: int, reason: str) -> SimError:
    return validation_error(
        "json_invalid", f"body.{position}", "JSON decode error", {}, {"error": reason}
    )


def not_an_object(value: Any) -> SimError:
    return validation_error(
        "model_attributes_type",
        "body",
        "Input should be a valid dictionary or object to extract fields from",
        value,
    )


def unsupported_media_type() -> SimError:
    return SimError(
        400,
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
        "Bad Request",
        None,
    )


def missing_field(name: str, body: dict[str, Any]) -> SimError:
    return validation_error("missing", f"body.{name}", "Field required", body)


def model_not_found(requested: str, served: str) -> SimError:
    return SimError(
        404,
        f"The model `{requested}` does not exist. Valid aliases: {served}.",
        "NotFoundError",
        "model",
    )


def bad_request(message: str, param: str | None, value: Any = None) -> SimError:
    """vLLM's own BadRequestError; it appends the parameter (and value) to the message."""
    if param is None:
        suffix = ""
    elif value is None:
        suffix = f" (parameter={param})"
    else:
        suffix = f" (parameter={param}, value={value})"
    return SimError(400, f"{message}{suffix}", "BadRequestError", param)


def injected_failure(status: int) -> SimError:
    return SimError(status, f"Simulated failure (injected fault fail_next, status {status})")


def embedding_missing(kind: str, key: str | None) -> SimError:
    """A ``*_embeds`` reference whose embedding the EC connector cannot find."""
    return SimError(
        500,
        f"No encoder output found for {kind} item with mm_hash {key}: the embedding was not "
        "published or has expired.",
        "InternalServerError",
    )


def engine_dead() -> SimError:
    return SimError(
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "InternalServerError",
    )


NOT_FOUND = {"detail": "Not Found"}
METHOD_NOT_ALLOWED = {"detail": "Method Not Allowed"}
