"""The transport's mapping of failures to the error taxonomy (a fake transport is honest here:
these are the library's exceptions, raised exactly as requests raises them)."""

from __future__ import annotations

import pytest
import requests
import responses

from epd_flask import errors
from epd_flask.transport import Transport

URL = "http://10.255.255.1:9/v1/completions"  # never contacted: `responses` intercepts


@responses.activate
@pytest.mark.parametrize(("exc", "kind", "status"), [
    (requests.ConnectionError("refused"), errors.BackendUnavailable, 503),
    (requests.ConnectTimeout("slow"), errors.BackendUnavailable, 503),
    (requests.ReadTimeout("slow"), errors.BackendTimeout, 504),
    (requests.TooManyRedirects("loop"), errors.BackendError, 502),
])
def test_failures_map_to_taxonomy(exc: Exception, kind: type, status: int) -> None:
    responses.add(responses.POST, URL, body=exc)
    with pytest.raises(kind) as info:
        Transport().send("POST", URL, stage="decode", headers={}, body=b"{}", read_timeout=1)
    assert info.value.status == status
    assert info.value.stage == "decode"
    assert "decode instance http://10.255.255.1:9" in info.value.message


@responses.activate
def test_error_status_keeps_the_upstream_body() -> None:
    body = b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'
    responses.add(responses.POST, URL, body=body, status=400, content_type="application/json")
    transport = Transport()
    resp = transport.send("POST", URL, stage="prefill", headers={}, body=b"{}", read_timeout=1)
    with pytest.raises(errors.BackendStatus) as info:
        transport.raise_for_status(resp, "prefill")
    assert info.value.status == 400 and info.value.body == body
    assert not info.value.retryable


@responses.activate
def test_retryable_only_for_server_errors() -> None:
    responses.add(responses.POST, URL, body=b"boom", status=503)
    transport = Transport()
    resp = transport.send("POST", URL, stage="decode", headers={}, body=b"{}", read_timeout=1)
    with pytest.raises(errors.BackendStatus) as info:
        transport.raise_for_status(resp, "decode")
    assert info.value.retryable and info.value.status == 503
