"""The admin API over real HTTP: keys, validation, persistence, and changes reaching every
worker (two apps sharing one state directory stand in for two gunicorn workers)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from epd_flask.control.roster import load
from epd_flask.control.statedir import StateDir
from tests.bodies import chat
from tests.helpers import sample, scrape
from tests.rosters import roster

KEY = "s3cret-admin"
AUTH = {"X-API-Key": KEY}
CHAT = chat("hi", max_tokens=4)


@pytest.fixture
def fleet(sim, proxy, tmp_path: Path) -> Any:
    """A prefill, a decode in the roster file, and a decode not yet registered."""
    p, d1, d2 = sim("prefill"), sim("decode"), sim("decode")
    doc = roster([p], [d1], probe_interval=60)
    path = tmp_path / "roster.yaml"
    path.write_text("# operators' notes\n" + yaml.safe_dump(doc))

    def start(**config: Any) -> Any:
        config.setdefault("admin_api_key", KEY)
        return proxy(doc, roster_path=str(path), **config)

    return p, d1, d2, path, start


def post(px: Any, doc: Any, headers: dict[str, str] = AUTH) -> requests.Response:
    return requests.post(px.url + "/instances", json=doc, headers=headers, timeout=5)


def test_without_a_key_the_admin_api_is_disabled_and_says_so(fleet) -> None:
    _, _, d2, path, start = fleet
    px = start(admin_api_key=None)
    for r in (requests.get(px.url + "/instances", headers=AUTH, timeout=5),
              post(px, {"role": "decode", "url": d2.url})):
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "admin_api_disabled"
        assert "ADMIN_API_KEY" in r.json()["error"]["message"]
    assert d2.url not in path.read_text()


def test_keys_are_checked(fleet) -> None:
    _, d1, _, _, start = fleet
    px = start()
    assert requests.get(px.url + "/instances", timeout=5).status_code == 403
    wrong = requests.get(px.url + "/instances", headers={"X-API-Key": KEY + "x"}, timeout=5)
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_admin_key"
    for headers in (AUTH, {"Authorization": f"Bearer {KEY}"}):
        r = requests.get(px.url + "/instances", headers=headers, timeout=5)
        assert r.status_code == 200
        assert d1.url in [row["url"] for row in r.json()["data"]]


def test_the_other_proxies_spelling_is_the_same_api(fleet) -> None:
    """``POST /instances/add`` and ``X-Admin-API-Key``, as other EPD proxies' launchers send
    them: the same validation, authorization and answers as ``POST /instances``."""
    _, d1, d2, path, start = fleet
    px = start()
    alias = {"X-Admin-API-Key": KEY}

    def add(doc: Any, headers: dict[str, str] = alias) -> requests.Response:
        return requests.post(px.url + "/instances/add", json=doc, headers=headers, timeout=5)

    assert add({"role": "decode", "url": d2.url}, {}).json()["error"]["code"] == \
        "missing_admin_key"
    wrong = add({"role": "decode", "url": d2.url}, {"x-admin-api-key": KEY + "x"})
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_admin_key"
    assert d2.url not in path.read_text()
    r = add({"role": "decode", "url": d2.url})
    assert r.status_code == 201 and r.json()["status"] == "registered"
    assert d2.url in path.read_text()
    again = add({"role": "decode", "url": d2.url}, AUTH)
    assert again.status_code == 200 and again.json()["status"] == "unchanged"
    assert post(px, {"role": "decode", "url": d2.url}, alias).json()["status"] == "unchanged"
    assert add({"role": "prefill", "url": d1.url}).json()["error"]["code"] == "role_conflict"
    assert add({"role": "decoder", "url": d2.url}).status_code == 422
    listed = requests.get(px.url + "/instances", headers=alias, timeout=5)
    assert listed.status_code == 200
    assert d2.url in [row["url"] for row in listed.json()["data"]]
    gone = requests.delete(px.url + "/instances", params={"url": d2.url}, headers=alias,
                           timeout=5)
    assert gone.status_code == 200 and gone.json()["status"] == "removed"


def test_registration_applies_at_once_and_persists(fleet) -> None:
    _, _, d2, path, start = fleet
    px = start()
    r = post(px, {"role": "decode", "url": d2.url + "/"})
    assert r.status_code == 201 and r.json()["status"] == "registered"
    assert r.json()["instance"] == {"role": "decode", "url": d2.url}
    text = path.read_text()
    assert text.startswith("# operators' notes") and d2.url in text
    assert d2.url in [i.url for i in load(path).instances]
    for _ in range(4):
        assert requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10).ok
    assert d2.state.stats()["completions"] >= 1
    gone = requests.delete(px.url + "/instances", params={"url": d2.url}, headers=AUTH,
                           timeout=5)
    assert gone.status_code == 200 and gone.json()["status"] == "removed"
    before = d2.state.stats()["completions"]
    for _ in range(4):
        assert requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10).ok
    assert d2.state.stats()["completions"] == before
    assert d2.url not in path.read_text()
    missing = requests.delete(px.url + "/instances", params={"url": d2.url}, headers=AUTH,
                              timeout=5)
    assert missing.status_code == 404
    assert requests.delete(px.url + "/instances", headers=AUTH, timeout=5).status_code == 400


def test_conflicts_are_409_and_bad_fields_422(fleet) -> None:
    _, d1, d2, path, start = fleet
    px = start()
    before = path.read_text()
    role_change = post(px, {"role": "prefill", "url": d1.url})
    assert role_change.status_code == 409
    assert role_change.json()["error"]["code"] == "role_conflict"
    assert "DELETE it first" in role_change.json()["error"]["message"]
    mixed = post(px, {"role": "prefill_decode", "url": d2.url})
    assert mixed.status_code == 409 and "mixed" in mixed.json()["error"]["message"]
    for bad in ({"role": "decoder", "url": d2.url}, {"role": "decode", "url": "ftp://x"},
                {"role": "decode", "url": d2.url, "dp_size": 0},
                {"role": "decode", "url": d2.url, "colour": "red"}, ["decode"]):
        r = post(px, bad)
        assert r.status_code == 422, bad
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    not_json = requests.post(px.url + "/instances", data=b"{", headers=AUTH, timeout=5)
    assert not_json.status_code == 400
    assert path.read_text() == before


def reloads(px: Any) -> dict[str, float]:
    samples = scrape(px.url, AUTH)
    return {f"{s}/{o}": sample(samples, "epd_roster_reloads_total", source=s, outcome=o)
            for s in ("admin", "sighup") for o in ("ok", "rejected")}


@pytest.mark.parametrize("shared", [False, True])
def test_admin_changes_count_as_reloads(fleet, tmp_path: Path, shared: bool) -> None:
    """Applied and refused admin changes move ``epd_roster_reloads_total``; with a state
    directory (gunicorn's workers) every worker shows the same tally."""
    _, d1, d2, _, start = fleet
    config = {}
    if shared:
        StateDir(tmp_path / "state").ensure()
        config["state_dir"] = str(tmp_path / "state")
    a = start(**config)
    b = start(**config) if shared else a
    assert set(reloads(b).values()) == {0}
    assert post(a, {"role": "decode", "url": d2.url}).status_code == 201
    assert post(a, {"role": "prefill", "url": d1.url}).status_code == 409
    assert requests.delete(a.url + "/instances", params={"url": "http://nowhere:1"},
                           headers=AUTH, timeout=5).status_code == 404
    assert post(a, {"role": "decoder", "url": d2.url}).status_code == 422  # not a change
    assert reloads(b) == {"admin/ok": 1, "admin/rejected": 2, "sighup/ok": 0,
                          "sighup/rejected": 0}
    if shared:
        assert StateDir(tmp_path / "state").reloads() == {"admin/ok": 1, "admin/rejected": 2}


def test_re_registering_never_resets_health(fleet) -> None:
    _, d1, _, path, start = fleet
    px = start()
    registry = px.services.registry
    for _ in range(3):
        registry.record_failure(d1.url, "refused")
    assert d1.url in registry.snapshot()["decode"]["evicted"]
    before = path.stat().st_mtime_ns
    r = post(px, {"role": "decode", "url": d1.url})
    assert r.status_code == 200 and r.json()["status"] == "unchanged"
    assert d1.url in registry.snapshot()["decode"]["evicted"]
    assert path.stat().st_mtime_ns == before
    r = post(px, {"role": "decode", "url": d1.url, "dp_size": 2})
    assert r.status_code == 200 and r.json()["status"] == "updated"
    assert d1.url in registry.snapshot()["decode"]["evicted"]  # same URL and role: kept


def test_an_invalid_roster_file_is_not_overwritten(fleet) -> None:
    _, _, d2, path, start = fleet
    px = start()
    path.write_text("instances: [{role: decode, url: 'http://h:1', typo: 1}]\n")
    r = post(px, {"role": "decode", "url": d2.url})
    assert r.status_code == 409 and r.json()["error"]["code"] == "roster_file_invalid"
    assert "typo" in r.json()["error"]["message"] and "typo" in path.read_text()


def test_a_read_only_roster_is_a_409_that_says_so(fleet, tmp_path: Path) -> None:
    """A roster that turned read-only after start (gunicorn refuses to start on one) is not
    a server fault: 409 ``roster_read_only`` naming the fix, and nothing changes."""
    _, _, d2, path, start = fleet
    folder = path.parent
    px = start()
    as_root = os.geteuid() == 0
    if as_root:
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
        if made.returncode != 0:
            pytest.skip(f"cannot make a directory unwritable for root here: {made.stderr!r}")
    else:
        folder.chmod(0o555)
    try:
        r = post(px, {"role": "decode", "url": d2.url})
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
        folder.chmod(0o755)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "roster_read_only" and "SIGHUP" in err["message"]
    assert d2.url not in path.read_text()
    assert d2.url not in [i.url for i in px.services.registry.instances("decode")]


def test_a_change_in_one_worker_reaches_the_others(fleet, tmp_path: Path) -> None:
    """Two apps over one state directory, as gunicorn's workers are: the one that did not
    take the call follows the published roster, and a later worker inherits health."""
    _, d1, d2, _, start = fleet
    state = tmp_path / "state"
    StateDir(state).ensure()
    a, b = start(state_dir=str(state)), start(state_dir=str(state))
    # a's sync greenlet stays off: in one test process every app writes the same
    # health-<pid>.json, and a's view (d1 live) written after b's would hide b's eviction.
    b.services.roster_sync.start()
    assert post(a, {"role": "decode", "url": d2.url}).status_code == 201
    b.services.roster_sync.sync()  # what b's sync greenlet does every SYNC_INTERVAL
    assert b.services.roster_sync.generation == a.services.roster_sync.generation
    assert d2.url in [i.url for i in b.services.registry.instances("decode")]
    for _ in range(4):
        b.services.registry.record_failure(d1.url, "refused")
    b.services.roster_sync.sync()  # writes b's health snapshot
    c = start(state_dir=str(state))
    c.services.roster_sync.start()
    assert d1.url in c.services.registry.snapshot()["decode"]["evicted"]


def test_a_sibling_writing_later_does_not_hide_an_eviction(fleet, tmp_path: Path) -> None:
    """b evicts d1; a, which has seen d1 fail only once, writes its snapshot afterwards (its
    sync greenlet does so whenever its registry changes). The next worker still inherits
    the eviction: a's snapshot neither replaces b's nor outranks it."""
    _, d1, _, _, start = fleet
    state = tmp_path / "state"
    StateDir(state).ensure()
    a, b = start(state_dir=str(state)), start(state_dir=str(state))
    a.services.roster_sync.start()
    b.services.roster_sync.start()
    for _ in range(4):
        b.services.registry.record_failure(d1.url, "refused")
    b.services.roster_sync.sync()
    a.services.registry.record_failure(d1.url, "refused")  # below the threshold: still live
    a.services.roster_sync.sync()
    assert len(list(state.glob("health-*.json"))) == 2
    c = start(state_dir=str(state))
    c.services.roster_sync.start()
    assert d1.url in c.services.registry.snapshot()["decode"]["evicted"]


def test_a_worker_follows_a_roster_published_while_it_booted(fleet, tmp_path: Path) -> None:
    """The roster a worker boots with is read before its services start; a publication in
    between must still be adopted (it once went unnoticed, leaving the worker on the old
    roster until the next reload)."""
    _, _, d2, _, start = fleet
    state = tmp_path / "state"
    StateDir(state).ensure()
    a, b = start(state_dir=str(state)), start(state_dir=str(state))  # b booted, not started
    a.services.roster_sync.start()
    assert post(a, {"role": "decode", "url": d2.url}).status_code == 201
    b.services.roster_sync.start()
    assert d2.url in [i.url for i in b.services.registry.instances("decode")]


def test_instance_urls_pass_the_ssrf_policy(fleet) -> None:
    _, _, d2, path, start = fleet
    px = start(instance_networks=("10.0.0.0/8",))
    before = path.read_text()
    for doc in ({"role": "decode", "url": d2.url},  # 127.0.0.1 is outside 10/8
                {"role": "decode", "url": "http://169.254.169.254:80"}):
        r = post(px, doc)
        assert r.status_code == 422, doc
        assert r.json()["error"]["code"] == "instance_url_not_allowed"
    open_px = start()
    r = post(open_px, {"role": "decode", "url": "http://169.254.169.254"})  # metadata service
    assert r.status_code == 422 and "link-local" in r.json()["error"]["message"]
    assert path.read_text() == before


def test_the_admin_api_can_live_under_a_prefix(fleet) -> None:
    _, d1, _, _, start = fleet
    px = start(admin_prefix="/_admin")
    r = requests.get(px.url + "/_admin/instances", headers=AUTH, timeout=5)
    assert r.status_code == 200 and d1.url in [row["url"] for row in r.json()["data"]]
    bare = requests.delete(px.url + "/instances", params={"url": d1.url}, headers=AUTH,
                           timeout=5)
    assert bare.status_code == 405  # not the admin API any more
