"""Mooncake's bootstrap server, as a MooncakeConnector prefill runs it beside the API server:
``GET /query`` tells a decode which engine (and worker addresses) each DP rank has.
"""

from __future__ import annotations

import random
from typing import Any

from . import errors, wire
from .httpio import StartResponse, WSGIResult, json_response

WORKER_PORT_RANGE = (30000, 60000)


class BootstrapApp:
    """Answers ``/query`` for the ranks of one prefill; engine ids come from its state."""

    def __init__(self, rank_engine_ids: list[str]) -> None:
        self.rank_engine_ids = rank_engine_ids
        # Fake ZMQ worker ports, fixed for the life of this server like real ones.
        self.worker_ports = [random.randint(*WORKER_PORT_RANGE) for _ in rank_engine_ids]

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        if environ.get("PATH_INFO") != "/query":
            return json_response(start_response, 404, errors.NOT_FOUND, vary=False)
        if environ["REQUEST_METHOD"] != "GET":
            return json_response(start_response, 405, errors.METHOD_NOT_ALLOWED,
                                 [("allow", "GET")], vary=False)
        body = wire.bootstrap_query(self.rank_engine_ids, self.worker_ports)
        return json_response(start_response, 200, body, vary=False)
