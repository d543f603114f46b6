"""Never refuse what vLLM accepts: a sample of lax spellings sent to real vLLM directly and
through the proxy (P+D over the ``none`` connector) gets the same verdict on both sides, the
proxy streams exactly when vLLM does, and decode receives the client's values as written.
tests/unit/test_validation.py holds the whole table; this checks the sample against the real
thing."""

from __future__ import annotations

import pytest

from tests.vllm.checks import chat_body, completion_body, post, unique_prompt

pytestmark = pytest.mark.vllm

#: (fields over a good body, the answer both must give): vLLM's lax pydantic models decide.
SAMPLE = [
    pytest.param({"max_tokens": "5"}, 200, id="max_tokens-string"),
    pytest.param({"max_tokens": 5.0}, 200, id="max_tokens-integral-float"),
    pytest.param({"max_tokens": "5", "stream": "true"}, 200, id="stream-string-true"),
    pytest.param({"stream": "false"}, 200, id="stream-string-false"),
    pytest.param({"stream": 1, "stream_options": {"include_usage": "yes"}}, 200,
                 id="stream-one-usage-yes"),
    pytest.param({"min_tokens": "2"}, 200, id="min_tokens-string"),
    pytest.param({"max_tokens": 5.5}, 400, id="max_tokens-fraction"),
    pytest.param({"max_tokens": "ten"}, 400, id="max_tokens-word"),
    pytest.param({"stream": "maybe"}, 400, id="stream-maybe"),
    pytest.param({"stream_options": {"include_usage": True}}, 400, id="options-without-stream"),
]


@pytest.fixture(scope="module")
def pd(fleet):
    return fleet.proxied_pd("example", "none")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("extra", "status"), SAMPLE)
def test_proxy_and_vllm_agree_on_lax_fields(pd, path, extra, status):
    make = chat_body if "chat" in path else completion_body
    body = {**make(unique_prompt(f"lax {path} {extra}")), **extra}

    direct = post(pd.decode.url, path, body)
    proxied = post(pd.proxy.url, path, body)

    assert direct.status == status, direct.raw[:300]
    assert proxied.status == status, proxied.raw[:300]
    if status == 200:
        streamed = proxied.headers.get("content-type", "").startswith("text/event-stream")
        assert streamed == direct.headers.get("content-type", "").startswith(
            "text/event-stream")
        assert proxied.text == direct.text  # greedy: the same answer either way
    else:
        assert proxied.json["error"]["param"].split(".")[0] in {*extra, "body"}
