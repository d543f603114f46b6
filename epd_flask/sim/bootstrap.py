"""Mooncake's bootstrap server, as a MooncakeConnector prefill runs it beside the API server:
``GET /query`` tells a decode which engine (and worker addresses) each DP rank has.

Sim only: ``GET /sim/transfers/<transfer_id>?wait=S`` stands in for the worker-to-worker
channel real decodes pull KV over. It answers once the prefill settled that transfer (or after
``S`` seconds, at most ``MAX_WAIT_SECONDS``) with its state and engine id.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import parse_qs, unquote

from . import errors, wire
from .httpio import StartResponse, WSGIResult, json_response
from .transfers import TransferBook

WORKER_PORT_RANGE = (30000, 60000)
TRANSFERS_PREFIX = "/sim/transfers/"
MAX_WAIT_SECONDS = 5.0


class BootstrapApp:
    """Answers ``/query`` for the ranks of one prefill; engine ids come from its state."""

    def __init__(self, rank_engine_ids: list[str], transfers: TransferBook | None = None) -> None:
        self.rank_engine_ids = rank_engine_ids
        self.transfers = transfers or TransferBook()
        # Fake ZMQ worker ports, fixed for the life of this server like real ones.
        self.worker_ports = [random.randint(*WORKER_PORT_RANGE) for _ in rank_engine_ids]

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        path = environ.get("PATH_INFO") or ""
        if path.startswith(TRANSFERS_PREFIX) and environ["REQUEST_METHOD"] == "GET":
            return self._transfer(environ, start_response, unquote(path[len(TRANSFERS_PREFIX):]))
        if path != "/query":
            return json_response(start_response, 404, errors.NOT_FOUND, vary=False)
        if environ["REQUEST_METHOD"] != "GET":
            return json_response(start_response, 405, errors.METHOD_NOT_ALLOWED,
                                 [("allow", "GET")], vary=False)
        body = wire.bootstrap_query(self.rank_engine_ids, self.worker_ports)
        return json_response(start_response, 200, body, vary=False)

    def _transfer(self, environ: dict[str, Any], start_response: StartResponse,
                  transfer_id: str) -> WSGIResult:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            wait = float(query.get("wait", ["0"])[-1])
        except ValueError:
            wait = 0.0
        wait = min(max(wait, 0.0), MAX_WAIT_SECONDS)
        return json_response(start_response, 200, self.transfers.wait(transfer_id, wait),
                             vary=False)
