"""The ``/sim/*`` control surface: the HTTP face of ``SimState`` (stats, recorded requests,
live knobs, faults, reset) for tests and people driving a sim from another process.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

from .httpio import StartResponse, WSGIResult, json_response, read_body
from .state import SimState


def _bad(start_response: StartResponse, message: str) -> WSGIResult:
    return json_response(start_response, 400, {"error": {
        "message": message, "type": "BadRequestError", "param": None, "code": 400}})


def _json_object(environ: dict[str, Any]) -> dict[str, Any]:
    raw = read_body(environ)
    if not raw.strip():
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("the body must be a JSON object")
    return value


def stats(state: SimState, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
    return json_response(start_response, 200, state.stats())


def requests(
    state: SimState, environ: dict[str, Any], start_response: StartResponse
) -> WSGIResult:
    """``?limit=N``: the N newest recorded requests, newest last (a bare JSON list)."""
    query = parse_qs(environ.get("QUERY_STRING", ""))
    limit = None
    if "limit" in query:
        try:
            limit = int(query["limit"][-1])
        except ValueError:
            return _bad(start_response, "limit must be an integer")
    return json_response(start_response, 200, state.requests(limit))


def config(state: SimState, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
    if environ["REQUEST_METHOD"] == "GET":
        return json_response(start_response, 200, state.config.as_dict())
    try:
        return json_response(start_response, 200, state.configure(**_json_object(environ)))
    except ValueError as exc:
        return _bad(start_response, str(exc))


def faults(state: SimState, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
    if environ["REQUEST_METHOD"] == "GET":
        return json_response(start_response, 200, dict(state.faults))
    try:
        return json_response(start_response, 200, state.inject(**_json_object(environ)))
    except ValueError as exc:
        return _bad(start_response, str(exc))


def reset(state: SimState, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
    state.reset()
    return json_response(start_response, 200, state.stats())
