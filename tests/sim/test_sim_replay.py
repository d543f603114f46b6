"""Every captured real-vLLM exchange in fixtures/realvllm, replayed against a sim in the role
of the server that answered it: same status, content type and wire shape, and error bodies
word for word (numbers aside)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from epd_flask.sim import SimConfig, SimServer
from tests.sim.simclient import RawClient
from tests.sim.wireshape import body_shape, error_text

FIXTURES = Path(__file__).parent / "fixtures" / "realvllm"
#: The captures' ports say which server answered (shared/realvllm/up.sh's layout).
ROLE_BY_PORT = {8100: "prefill", 8200: "decode", 8300: "encode", 8400: "prefill_decode"}
CONNECTOR_BY_DIR = {"pd-nixl": "nixl", "pd-mooncake": "mooncake",
                    "pd-example-connector": "example"}
#: Not request/response pairs a fresh sim can replay: the bootstrap server (tested in
#: test_sim_encode_bootstrap) and the engine-killing handles (test_sim_kv, test_sim_faults).
SKIP = ("01-mooncake-bootstrap-query", "24-decode-bogus-kv-params", "25-decode-health-after",
        "12-decode-bogus-kv-params")


def _parse_request(path: Path) -> tuple[str, str, int | None, bytes]:
    first, _, rest = path.read_text(encoding="utf-8").partition("\n")
    method, target = first.split(" ", 1)
    url = urlsplit(target.strip())
    # The capture files add one newline after the body that was sent.
    body = rest.lstrip("\n").removesuffix("\n").encode("utf-8")
    return method, url.path or target.strip(), url.port, body


def _parse_response(path: Path) -> tuple[int, dict[str, str], str]:
    head, _, body = path.read_text(encoding="utf-8").partition("\n\n")
    lines = head.splitlines()
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body.strip("\n")


def _sim_config(folder: str, port: int | None) -> dict[str, Any]:
    if folder == "single":
        return {"role": "prefill_decode"}
    role = ROLE_BY_PORT[port]
    knobs: dict[str, Any] = {"role": role}
    connector = CONNECTOR_BY_DIR.get(folder)
    if connector is not None:
        knobs["kv_connector"] = connector
        if connector == "mooncake" and role == "prefill":
            knobs["bootstrap_port"] = 0
    if role == "encode":
        knobs["ec_metadata"] = "empty"  # LLaVA's encoder reports no metadata
    return knobs


def _cases() -> list[Any]:
    cases = []
    for req in sorted(FIXTURES.glob("*/*.req")):
        if req.stem.startswith(SKIP):
            continue
        cases.append(pytest.param(req, id=f"{req.parent.name}/{req.stem}"))
    return cases


@pytest.mark.parametrize("req", _cases())
def test_sim_answers_like_real_vllm(req: Path):
    method, path, port, body = _parse_request(req)
    status, headers, captured = _parse_response(req.with_suffix(".resp"))
    server = SimServer(SimConfig(**_sim_config(req.parent.name, port))).start()
    client = RawClient(server.url)
    try:
        sent_headers = {"content-type": "application/json"} if body else {}
        client.send(method, path, body if body else None, headers=sent_headers)
        resp = client.read_response()
    finally:
        client.close()
        server.stop()
    got = resp.body.decode("utf-8")
    assert resp.status == status, got
    assert resp.headers.get("content-type") == headers.get("content-type")
    assert body_shape(got, resp.headers.get("content-type", "")) == body_shape(
        captured, headers.get("content-type", ""))
    if status >= 400:
        assert error_text(got) == error_text(captured)
