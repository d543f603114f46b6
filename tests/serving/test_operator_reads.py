"""What names every instance URL (``/metrics``, ``/status``, ``/debug/worker``) is an
operator's to read: once any key is configured it needs the metrics key (Prometheus' bearer
token) or the admin key, never a serving key. ``/health``, which the shipped nginx publishes,
names no instance at all: it counts them per role and state."""

from __future__ import annotations

import pytest
import requests

from tests.rosters import roster

METRICS_KEY = "metrics-key-abcdefghijkl"
ADMIN_KEY = "admin-key-abcdefghijkl"
SERVING_KEY = "sk-client-abcdefghijkl"
READS = ("/metrics", "/status", "/debug/worker")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def statuses(base: str, headers: dict[str, str]) -> dict[str, int]:
    return {path: requests.get(base + path, headers=headers, timeout=10).status_code
            for path in READS}


def test_with_no_key_configured_the_reads_stay_open(sim, proxy) -> None:
    px = proxy(roster([sim("prefill")], [sim("decode")]), debug_endpoints=True)
    assert statuses(px.url, {}) == dict.fromkeys(READS, 200)


def test_the_metrics_key_or_the_admin_key_opens_them_and_nothing_else_does(sim, proxy) -> None:
    p, d = sim("prefill"), sim("decode")
    px = proxy(roster([p], [d]), debug_endpoints=True, metrics_key=METRICS_KEY,
               admin_api_key=ADMIN_KEY, api_keys=(SERVING_KEY,))
    for headers in ({}, bearer(SERVING_KEY), bearer(METRICS_KEY + "x"), bearer("")):
        assert statuses(px.url, headers) == dict.fromkeys(READS, 401), headers
    r = requests.get(px.url + "/metrics", headers=bearer(SERVING_KEY), timeout=10)
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_metrics_key" and d.url not in r.text
    for headers in (bearer(METRICS_KEY), {"X-API-Key": METRICS_KEY}, bearer(ADMIN_KEY)):
        assert statuses(px.url, headers) == dict.fromkeys(READS, 200), headers
    page = requests.get(px.url + "/metrics", headers=bearer(METRICS_KEY), timeout=10).text
    assert f'instance="{d.url}"' in page


def test_with_serving_keys_alone_the_reads_are_closed(sim, proxy) -> None:
    px = proxy(roster([sim("prefill")], [sim("decode")]), debug_endpoints=True,
               api_keys=(SERVING_KEY,))
    for headers in ({}, bearer(SERVING_KEY)):
        assert statuses(px.url, headers) == dict.fromkeys(READS, 403)
    r = requests.get(px.url + "/status", headers=bearer(SERVING_KEY), timeout=10)
    assert r.json()["error"]["code"] == "metrics_key_unset"
    assert "EPD_METRICS_KEY" in r.json()["error"]["message"]


@pytest.mark.parametrize("keys", [{}, {"metrics_key": METRICS_KEY, "api_keys": (SERVING_KEY,)}])
def test_health_counts_instances_and_names_none(sim, proxy, keys) -> None:
    p, d1, d2 = sim("prefill"), sim("decode"), sim("decode")
    px = proxy(roster([p], [d1, d2], fail_threshold=1), **keys)
    px.services.registry.record_failure(d2.url, "test: down")
    r = requests.get(px.url + "/health", timeout=10)
    assert r.status_code == 200
    assert r.json()["instances"] == {"prefill": {"live": 1, "evicted": 0},
                                     "decode": {"live": 1, "evicted": 1}}
    for server in (p, d1, d2):
        assert server.url not in r.text and server.url.split("//")[1] not in r.text
