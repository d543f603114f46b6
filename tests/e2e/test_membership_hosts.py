"""One fleet, many proxies (docs/behaviour.md#discovery): two gunicorn hosts (two workers
each) share one etcd. A registration through one host's admin API reaches every worker of the
other; a killed registrant's instance leaves every worker without a client request failing;
an etcd outage changes nothing clients see, and the changes made right after it reach every
worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import pytest
import requests

from tests.e2e.conftest import Launcher, Process
from tests.helpers import eventually
from tests.membership import Etcd, needs_etcd

pytestmark = [pytest.mark.e2e, needs_etcd]
KEY = "hosts-admin-key"
PREFIX = "/hosts/"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Etcd, Launcher,
                                                                        list[Process]]]:
    etcd = Etcd(tmp_path_factory.mktemp("etcd")).start()
    launcher = Launcher(tmp_path_factory.mktemp("hosts"))
    roster = {"settings": {"probe_interval": 0.5},
              "discovery": {"etcd": {"endpoints": [etcd.url], "prefix": PREFIX}}}
    try:
        hosts = [launcher.gunicorn(roster, workers=2, env={"ADMIN_API_KEY": KEY})
                 for _ in range(2)]
        yield etcd, launcher, hosts
    finally:
        launcher.stop_all()
        etcd.stop()


def views(host: Process, tries: int = 12) -> dict[int, set[str]]:
    """The instance URLs each worker of ``host`` lists, by pid (new connections land on
    either worker)."""
    seen: dict[int, set[str]] = {}
    for _ in range(tries):
        doc = requests.get(host.url + "/instances", headers={"X-API-Key": KEY,
                           "Connection": "close"}, timeout=5).json()
        seen[doc["worker"]] = {row["url"] for row in doc["data"]}
    return seen


def everywhere(hosts: list[Process], check: Any) -> bool:
    return all(len(v := views(h)) == 2 and all(check(urls) for urls in v.values())
               for h in hosts)


def test_a_registration_through_one_host_reaches_every_worker_of_the_other(
        fleet: tuple[Etcd, Launcher, list[Process]]) -> None:
    _etcd, launcher, (a, b) = fleet
    decode = launcher.sim("prefill_decode")
    answer = requests.post(a.url + "/instances", json={"role": "prefill_decode",
                                                       "url": decode.url},
                           headers={"X-API-Key": KEY}, timeout=5)
    assert answer.status_code == 201
    registered = time.monotonic()
    assert eventually(lambda: everywhere([b], lambda urls: decode.url in urls), seconds=2)
    assert time.monotonic() - registered < 2
    assert requests.post(b.url + "/v1/chat/completions", json=CHAT, timeout=10).ok
    requests.delete(a.url + "/instances", params={"url": decode.url},
                    headers={"X-API-Key": KEY}, timeout=5)
    assert eventually(lambda: everywhere([a, b], lambda urls: decode.url not in urls))


def test_a_killed_registrant_leaves_every_worker_and_no_request_fails(
        fleet: tuple[Etcd, Launcher, list[Process]], tmp_path: Path) -> None:
    etcd, launcher, hosts = fleet
    stays, goes = launcher.sim("prefill_decode"), launcher.sim("prefill_decode")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "epd_flask.control.cli", "register", "--etcd", etcd.url,
         "--prefix", PREFIX, "--role", "prefill_decode", "--url", d.url, "--ttl", "3",
         "--interval", "0.3"], stdout=(tmp_path / f"reg-{n}.log").open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True) for n, d in enumerate((stays, goes))]
    try:
        assert eventually(lambda: everywhere(hosts, lambda u: {stays.url, goes.url} <= u),
                          seconds=10)
        failures: list[int] = []
        done = gevent.event.Event()

        def load() -> None:
            while not done.is_set():
                for h in hosts:
                    r = requests.post(h.url + "/v1/chat/completions", json=CHAT, timeout=10)
                    if r.status_code != 200:
                        failures.append(r.status_code)
                gevent.sleep(0.02)

        runner = gevent.spawn(load)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the instance itself keeps running
        procs[1].wait()
        # Gone with its lease (3 s), from every worker of both hosts.
        assert eventually(lambda: everywhere(hosts, lambda u: goes.url not in u
                                             and stays.url in u), seconds=10)
        served = goes.stats()["completions"]
        gevent.sleep(1)
        done.set()
        runner.get(timeout=15)
        assert goes.stats()["completions"] == served  # nothing routed there since
        assert failures == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(10)


def test_an_etcd_outage_changes_nothing_and_later_writes_reach_every_worker(
        fleet: tuple[Etcd, Launcher, list[Process]]) -> None:
    etcd, launcher, hosts = fleet
    d1, d2 = launcher.sim("prefill_decode"), launcher.sim("prefill_decode")
    etcd.put_record(PREFIX, "d1", {"role": "prefill_decode", "url": d1.url})
    assert eventually(lambda: everywhere(hosts, lambda u: d1.url in u))
    etcd.stop()
    stopped = time.monotonic()
    while time.monotonic() - stopped < 5:
        for h in hosts:
            assert requests.post(h.url + "/v1/chat/completions", json=CHAT, timeout=10).ok
        gevent.sleep(0.2)
    metrics = requests.get(hosts[0].url + "/metrics", headers={"X-API-Key": KEY},
                           timeout=5).text
    assert 'epd_discovery_up{source="etcd"} 0.0' in metrics
    etcd.start()
    etcd.put_record(PREFIX, "d2", {"role": "prefill_decode", "url": d2.url})
    etcd.client.delete(f"{PREFIX}instances/d1")
    back = time.monotonic()
    assert eventually(lambda: everywhere(hosts, lambda u: d2.url in u and d1.url not in u),
                      seconds=7)
    assert time.monotonic() - back < 7
    assert json.loads(etcd.client.get(f"{PREFIX}instances/d2").value)["url"] == d2.url
