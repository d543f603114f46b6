"""Instances that come and go (pods churning behind DNS or etcd, or the admin API) must not
stay in ``/metrics`` for the life of the workers: the gauges of an instance that left go at
once (an alert on ``epd_instance_live == 0`` must not fire for it), its counts stay while it
is among the last ``RECENT_INSTANCES`` to leave, and then go too
(docs/behaviour.md#discovery)."""

from __future__ import annotations

from pathlib import Path

import requests
import yaml

from epd_flask.observe.observer import RECENT_INSTANCES
from tests.bodies import chat
from tests.helpers import sample, scrape
from tests.rosters import roster

KEY = "s3cret-admin"
AUTH = {"X-API-Key": KEY}


def instances_shown(px) -> set[str]:
    return {dict(labels)["instance"] for (_, labels) in scrape(px.url, AUTH)
            if dict(labels).get("instance")}


def test_departed_instances_leave_the_exposition(sim, proxy, tmp_path: Path) -> None:
    p, d1, d2 = sim("prefill"), sim("decode"), sim("decode")
    doc = roster([p], [d1], probe_interval=60)
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(doc))
    px = proxy(doc, roster_path=str(path), admin_api_key=KEY)

    def register(url: str) -> None:
        r = requests.post(px.url + "/instances", json={"role": "decode", "url": url},
                          headers=AUTH, timeout=5)
        assert r.status_code == 201, r.text

    def remove(url: str) -> None:
        r = requests.delete(px.url + "/instances", params={"url": url}, headers=AUTH,
                            timeout=5)
        assert r.status_code == 200, r.text

    register(d2.url)
    for _ in range(6):
        r = requests.post(px.url + "/v1/chat/completions", json=chat("hi", max_tokens=2),
                          timeout=10)
        assert r.status_code == 200, r.text
    assert d2.state.stats()["completions"] >= 1
    served = scrape(px.url, AUTH)
    assert sample(served, "epd_instance_live", role="decode", instance=d2.url) == 1
    assert sample(served, "epd_upstream_in_flight", role="decode", instance=d2.url) == 0
    duration = [k for k in served if k[0] == "epd_request_duration_seconds_count"
                and dict(k[1])["instance"] == d2.url]
    assert duration, "d2 served a request and has its series"

    remove(d2.url)
    left = scrape(px.url, AUTH)
    assert not [k for k in left if k[0].startswith(("epd_instance_", "epd_upstream_in_flight"))
                and dict(k[1]).get("instance") == d2.url]
    assert all(left[k] == served[k] for k in duration)  # a scrape after it left: its counts

    # Others come and go: once RECENT_INSTANCES left after it, nothing of it shows.
    churned = [f"http://127.0.0.1:{20000 + i}" for i in range(RECENT_INSTANCES + 8)]
    for url in churned:
        register(url)
        remove(url)
    shown = instances_shown(px)
    assert d2.url not in shown
    assert shown <= {p.url, d1.url, *churned[-RECENT_INSTANCES:]}, shown - {p.url, d1.url}
    assert {p.url, d1.url} <= shown
    # Back again: labelled and shown as before.
    register(d2.url)
    assert requests.post(px.url + "/v1/chat/completions", json=chat("hi", max_tokens=2),
                         timeout=10).status_code == 200
    back = scrape(px.url, AUTH)
    assert sample(back, "epd_instance_live", role="decode", instance=d2.url) == 1
