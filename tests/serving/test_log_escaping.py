"""Text from outside the proxy reaches its log escaped, as the request line escapes it
(core/logfmt.py): a model or adapter name an instance lists, a Mooncake engine id, a path a
client sends. A newline in any of them could otherwise write a line of its own (a forged
``[ERROR]``), and an ANSI escape recolour or rewrite an operator's terminal."""

from __future__ import annotations

import json
import logging
import socket

import pytest
import requests

from epd_flask.control.roster import Instance, Roster
from epd_flask.core.logfmt import change, names, quote
from epd_flask.fleet.bootstrap import BootstrapDiscovery
from epd_flask.fleet.live import LiveFleet
from epd_flask.upstream.transport import Transport
from tests.fakes import response
from tests.helpers import RawStream
from tests.rosters import roster

FORGED = "tiny\n2026-01-01 00:00:00 [1] [ERROR] epd_flask: forged line"
ANSI = "\x1b[2J\x1b[31mred-adapter"


def clean(records: list[logging.LogRecord]) -> list[str]:
    """Every message, each checked to be one line of printable text."""
    messages = [r.getMessage() for r in records]
    for message in messages:
        assert "\n" not in message and "\r" not in message and "\x1b" not in message, message
    return messages


def test_quote_names_and_change_escape_what_could_break_a_line() -> None:
    assert quote("plain-name") == "plain-name"
    assert quote(FORGED) == json.dumps(FORGED)
    assert quote(ANSI) == '"\\u001b[2J\\u001b[31mred-adapter"'
    assert quote("a\u2028b") == '"a\\u2028b"'  # a line separator to some log viewers
    assert names(["b", ANSI, "c"], 2) == 'b, "\\u001b[2J\\u001b[31mred-adapter", and 1 more'
    assert change(None, ["x", FORGED]).startswith("2: ")
    assert change(["a", "b"], ["b", "c"]) == "2 now; added 1: c; removed 1: a"


def test_model_names_an_instance_lists_are_logged_escaped(
        fake, proxy, caplog: pytest.LogCaptureFixture) -> None:
    listed = [["tiny"], ["tiny", FORGED, ANSI]]

    def instance(conn: socket.socket, request: bytes) -> None:
        if request.startswith(b"GET /v1/models"):
            doc = {"object": "list", "data": [{"id": n} for n in listed.pop(0)]}
            conn.sendall(response(body=json.dumps(doc).encode()))
        else:
            conn.sendall(response(body=b"{}"))

    upstream = fake(instance)
    px = proxy({"instances": [{"role": "prefill_decode", "url": upstream.url}]})
    with caplog.at_level(logging.INFO, logger="epd_flask.fleet.registry"):
        px.services.prober.probe_all()
        px.services.prober.probe_all()
    first, second = (m for m in clean(caplog.records) if "serves models" in m)
    assert first.endswith("serves models: 1: tiny")
    assert second.endswith('added 2: "\\u001b[2J\\u001b[31mred-adapter", ' + json.dumps(FORGED))


def test_mooncake_engine_ids_are_logged_escaped(
        fake, caplog: pytest.LogCaptureFixture) -> None:
    def bootstrap(conn: socket.socket, request: bytes) -> None:
        doc = {"0": {"engine_id": FORGED}, "1": {"engine_id": ANSI}}
        conn.sendall(response(body=json.dumps(doc).encode()))

    server = fake(bootstrap)
    prefill = Instance(role="prefill", url="http://127.0.0.1:9", bootstrap_url=server.url)
    found = BootstrapDiscovery(LiveFleet(Roster(instances=(prefill,))), Transport())
    with caplog.at_level(logging.INFO, logger="epd_flask.fleet.bootstrap"):
        assert found.refresh(prefill)
    (line,) = clean(caplog.records)
    assert json.dumps(FORGED) in line


def test_a_refused_path_is_logged_escaped(sim, proxy, caplog: pytest.LogCaptureFixture) -> None:
    d = sim("decode", token_delay=0.05, output_tokens=200)
    px = proxy(roster([sim("prefill")], [d]), max_in_flight=1)
    stream = RawStream(px.url, "/v1/chat/completions", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200, "stream": True})
    stream.first_event()  # the one slot is taken: the next request is refused at once
    try:
        with caplog.at_level(logging.INFO, logger="epd_flask.web.inflight"):
            r = requests.get(px.url + "/v1/x%0A[ERROR]%20forged%1B[31m", timeout=10)
        assert r.status_code == 503
    finally:
        stream.hang_up()
    (line,) = clean(caplog.records)
    assert 'route="/v1/x\\n[ERROR] forged\\u001b[31m"' in line
