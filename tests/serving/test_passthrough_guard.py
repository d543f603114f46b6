"""What a pass-through may carry to an instance, through real HTTP: no KV connector
parameters from the client, no admin credential, no path that escapes the completion route,
and a path whose encoded characters stay encoded."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from gevent.pywsgi import WSGIServer

from tests.bodies import completion
from tests.helpers import NoDelayHandler
from tests.rosters import roster

ADMIN = "admin-key-abcdefghijkl"
HANDLES = {"do_remote_prefill": True, "remote_engine_id": "someone-elses-engine",
           "remote_host": "10.0.0.9", "remote_port": 5600, "remote_block_ids": [[1, 2]]}


class Recorder:
    """An instance that answers 200 to everything and keeps what it received, including the
    request line exactly as it arrived."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.server = WSGIServer(("127.0.0.1", 0), self.app, log=None,
                                 handler_class=self._handler())
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    @staticmethod
    def _handler() -> type:
        class Handler(NoDelayHandler):
            def get_environ(self) -> dict[str, Any]:
                env = super().get_environ()
                env["recorder.request_line"] = self.requestline
                return env
        return Handler

    def app(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        if environ["PATH_INFO"] != "/health":
            self.seen.append({
                "line": environ["recorder.request_line"], "path": environ["PATH_INFO"],
                "query": environ.get("QUERY_STRING", ""), "body": body,
                "headers": {k[5:].replace("_", "-").lower(): v for k, v in environ.items()
                            if k.startswith("HTTP_")}})
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"ok": true}']


@pytest.fixture
def upstream(proxy, sim) -> Iterator[Any]:
    rec = Recorder()

    def start(**config: Any) -> Any:
        p = sim("prefill")
        return rec, proxy(roster([p], [rec]), **config)

    yield start
    rec.server.stop(timeout=1)


@pytest.mark.parametrize("path", ["/v1/responses", "/inference/v1/generate", "/v1/embeddings"])
@pytest.mark.parametrize("ctype", ["application/json", None, "text/plain"])
def test_client_kv_transfer_params_never_reach_an_instance(upstream, path, ctype) -> None:
    rec, px = upstream()
    body = {"model": "m", "input": "hi", "kv_transfer_params": HANDLES}
    headers = {"Content-Type": ctype} if ctype else {}
    r = requests.post(px.url + path, data=json.dumps(body), headers=headers, timeout=10)
    assert r.status_code == 200
    sent = json.loads(rec.seen[-1]["body"])
    assert sent == {"model": "m", "input": "hi"}


def test_a_body_without_them_is_forwarded_byte_for_byte(upstream) -> None:
    rec, px = upstream()
    raw = b'{ "model" : "m",\n  "input": "caf\\u00e9" }'
    r = requests.post(px.url + "/v1/responses", data=raw,
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 200 and rec.seen[-1]["body"] == raw


def test_a_body_that_only_looks_like_json_is_refused_not_forwarded(upstream) -> None:
    rec, px = upstream()
    raw = b'{"kv_transfer_params": {"remote_host": "10.0.0.9"}, "x": }'
    r = requests.post(px.url + "/v1/responses", data=raw, headers={"Content-Type": "text/plain"},
                      timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert rec.seen == []


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1//chat/completions",
                                  "/v1/completions//"])
def test_other_spellings_of_the_completion_routes_are_404(upstream, path) -> None:
    rec, px = upstream()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
            "kv_transfer_params": HANDLES}
    r = requests.post(px.url + path, json=body, timeout=10)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not_found", r.text
    assert rec.seen == []


def raw_request(url: str, line: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"{line}\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return int(sock.recv(65536).split(b" ", 2)[1])


def test_encoded_characters_in_a_path_stay_encoded(upstream) -> None:
    rec, px = upstream()
    assert raw_request(px.url, "GET /v1/models%3Fadmin=1?limit=5 HTTP/1.1") == 200
    assert rec.seen[-1]["line"] == "GET /v1/models%3Fadmin=1?limit=5 HTTP/1.1"
    assert rec.seen[-1]["query"] == "limit=5"
    assert raw_request(px.url, "GET /v1/a%20b%25c%23d HTTP/1.1") == 200
    assert rec.seen[-1]["line"] == "GET /v1/a%20b%25c%23d HTTP/1.1"
    # A CRLF never reaches a request line (Flask's path converter does not route it).
    before = len(rec.seen)
    assert raw_request(px.url, "GET /v1/a%0D%0AX-Injected:%201 HTTP/1.1") == 404
    assert len(rec.seen) == before


@pytest.mark.parametrize("path", ["/instances", "/instances/", "//instances"])
def test_the_admin_credential_never_reaches_an_instance(upstream, path) -> None:
    rec, px = upstream(admin_api_key=ADMIN, admin_prefix="/ops")
    for auth in ({"X-API-Key": ADMIN}, {"Authorization": f"Bearer {ADMIN}"}):
        r = requests.post(px.url + path, json={"role": "decode", "url": "http://10.1.1.1:1"},
                          headers=auth, timeout=10)
        assert r.status_code == 404, r.text
        r = requests.get(px.url + path, headers=auth, timeout=10)
        assert r.status_code == 404
    # The real admin API is where the prefix puts it.
    assert requests.get(px.url + "/ops/instances", headers={"X-API-Key": ADMIN},
                        timeout=10).status_code == 200
    # Sent anywhere else, the admin key is dropped, and X-API-Key never crosses.
    for auth in ({"X-API-Key": ADMIN}, {"Authorization": f"Bearer {ADMIN}"},
                 {"Authorization": f"bearer  {ADMIN} "}):
        r = requests.post(px.url + "/v1/responses", json={"input": "hi"}, headers=auth,
                          timeout=10)
        assert r.status_code == 200
        assert "authorization" not in rec.seen[-1]["headers"]
        assert "x-api-key" not in rec.seen[-1]["headers"]
    # A client's own bearer (no serving keys configured) still reaches the instance.
    requests.get(px.url + "/v1/models", headers={"Authorization": "Bearer sk-client"},
                 timeout=10)
    assert rec.seen[-1]["headers"]["authorization"] == "Bearer sk-client"


def test_a_combined_instance_never_sees_the_clients_kv_transfer_params(sim, proxy) -> None:
    pd = sim("prefill_decode")
    px = proxy(roster(combined=[pd]))
    r = requests.post(px.url + "/v1/completions",
                      json=completion("hi", max_tokens=2, kv_transfer_params=HANDLES), timeout=10)
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in pd.state.requests(1)[0]["body"]


OPERATOR_CALLS = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                  ("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
                  ("GET", "/is_sleeping"), ("POST", "/collective_rpc"), ("POST", "/pause"),
                  ("POST", "/resume"), ("POST", "/scale_elastic_ep"),
                  ("POST", "/update_weights"), ("POST", "/abort_requests"),
                  ("GET", "/server_info"), ("POST", "/v1/admin/drain"),
                  ("POST", "//sleep"), ("POST", "/v1//load_lora_adapter/")]


@pytest.mark.parametrize(("method", "path"), OPERATOR_CALLS)
def test_vllms_operator_routes_need_the_admin_key(upstream, method, path) -> None:
    """A client (even with a serving key) never loads adapters, puts an engine to sleep or
    runs methods on its workers; the operator does, with the admin key, which the instance
    never sees (it gets the backend key)."""
    rec, px = upstream(admin_api_key=ADMIN, api_keys=("sk-client",),
                       backend_api_key="backend-key")
    body = {"lora_name": "a", "lora_path": "/tmp/a", "method": "m"}
    for headers in ({}, {"Authorization": "Bearer sk-client"}, {"X-API-Key": "sk-client"},
                    {"X-API-Key": ADMIN + "x"}):
        r = requests.request(method, px.url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 403, (headers, r.text)
        assert r.json()["error"]["code"] in ("missing_admin_key", "invalid_admin_key")
    assert rec.seen == []
    for headers in ({"X-API-Key": ADMIN}, {"Authorization": f"Bearer {ADMIN}"}):
        r = requests.request(method, px.url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        seen = rec.seen[-1]["headers"]
        assert seen["authorization"] == "Bearer backend-key" and "x-api-key" not in seen
    _, plain = upstream()  # without ADMIN_API_KEY the routes are off, as the admin API
    r = requests.request(method, plain.url + path, json=body, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_api_disabled"
    # Serving routes beside them are unchanged: the serving key, forwarded as before.
    r = requests.post(px.url + "/tokenize", json={"prompt": "hi"},
                      headers={"Authorization": "Bearer sk-client"}, timeout=10)
    assert r.status_code == 200
