"""Two clients sending the same X-Request-Id at once never share upstream state, whatever the
connector: each gets the answer its own prompt gets alone.

The simulated instances key state the way vLLM does: a Mooncake prefill keeps KV by transfer
id (a decode pulling a shared id answers from whichever prompt's KV is there), and every
instance counts a request that arrives while another with the same X-Request-Id (the name
vLLM gives the request in its engine) is still in flight.
"""

from __future__ import annotations

import json
from typing import Any

import gevent
import pytest
import requests

from tests.bodies import chat
from tests.helpers import eventually
from tests.rosters import roster

PROMPTS = ("the first client asks about apples", "the second client asks about the weather")
CLIENT_ID = "same-id-1"
# Long enough that the two requests overlap on every instance.
PREFILL_TTFT = 0.2
DECODE_TTFT = 0.1


def _chat(prompt: str, stream: bool) -> dict[str, Any]:
    return chat(prompt, max_tokens=8, temperature=0, stream=stream)


def _answer(url: str, prompt: str, stream: bool) -> str:
    r = requests.post(url + "/v1/chat/completions", json=_chat(prompt, stream), timeout=20,
                      headers={"X-Request-Id": CLIENT_ID})
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == CLIENT_ID
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    events = [block[6:] for block in r.text.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                   for e in events[:-1] if json.loads(e)["choices"])



def _fleet(connector: str, sim, proxy) -> tuple[Any, Any, Any]:
    knobs_p: dict[str, Any] = {"ttft": PREFILL_TTFT}
    knobs_d: dict[str, Any] = {"ttft": DECODE_TTFT}
    if connector == "mooncake":
        p = sim("prefill", bootstrap_port=0, **knobs_p)
        d = sim("decode", **knobs_d)
        px = proxy(roster([(p, {"bootstrap_url": p.bootstrap_url})], [d], connector="mooncake"),
                   probes=True)
        assert eventually(lambda: requests.get(px.url + "/ready", timeout=5).ok)
        return p, d, px
    p, d = sim("prefill", **knobs_p), sim("decode", **knobs_d)
    if connector == "p2p_nccl":
        return p, d, proxy(roster([(p, {"kv_zmq_addr": "127.0.0.1:21001"})],
                                  [(d, {"kv_zmq_addr": "127.0.0.1:22001"})], connector="p2p_nccl"))
    return p, d, proxy(roster([p], [d], connector=connector))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("connector", ["mooncake", "nixl", "none", "p2p_nccl"])
def test_concurrent_requests_with_one_client_id_get_their_own_answers(
        sim, proxy, connector: str, stream: bool) -> None:
    p, d, px = _fleet(connector, sim, proxy)
    solo = [_answer(px.url, prompt, stream) for prompt in PROMPTS]
    assert solo[0] != solo[1]
    for server in (p, d):
        server.state.reset()
    together = [gevent.spawn(_answer, px.url, prompt, stream) for prompt in PROMPTS]
    gevent.joinall(together, raise_error=True)
    answers = [g.value for g in together]
    stats = {"prefill": p.state.stats(), "decode": d.state.stats()}
    print(f"\n{connector} stream={stream}: solo {solo} together {answers}; "
          f"max in flight prefill {stats['prefill']['max_in_flight']} "
          f"decode {stats['decode']['max_in_flight']}")
    assert stats["prefill"]["max_in_flight"] == 2  # they did overlap
    assert answers == solo
    for role, s in stats.items():
        assert s["request_ids_reused"] == 0, role
        assert s["kv_transfers_crossed"] == 0 and s["kv_handles_invalid"] == 0, role
    # Every leg of one request shares one upstream id, the two requests never do.
    ids = {server: [r["headers"]["x-request-id"] for r in server.state.requests()]
           for server in (p, d)}
    assert len(set(ids[p])) == 2 and set(ids[p]) == set(ids[d])
    assert CLIENT_ID not in ids[p]
    if connector == "mooncake":
        transfers = {r["body"]["kv_transfer_params"]["transfer_id"] for r in p.state.requests()}
        assert transfers == {f"xfer-{rid}" for rid in ids[p]}
