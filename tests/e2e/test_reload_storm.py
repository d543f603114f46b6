"""SIGHUP after SIGHUP through real gunicorn (2 gevent workers) under a load of streamed
completions, with admin registrations and removals in between: no reload may leave the
state directory's lock with a worker (docs/behaviour.md#roster)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.load import Load
from tests.rosters import roster

pytestmark = pytest.mark.e2e

KEY = "storm-admin-key"
SIGHUP_EVERY = 2.0
LOCK_ERROR = "stayed locked"


def admin(method: str, url: str, **kw: Any) -> int:
    """One admin call on its own connection; its status (0: no answer at all)."""
    try:
        with requests.Session() as s:
            return s.request(method, url, headers={"X-API-Key": KEY}, timeout=30,
                             **kw).status_code
    except requests.RequestException:
        return 0


def storm(procs: Any, tmp_path: Path, seconds: float) -> None:
    p = procs["sim"]("prefill")
    d1, d2 = procs["sim"]("decode"), procs["sim"]("decode")
    doc = roster([p], [d1], probe_interval=0.5)
    gw = procs["gunicorn"](doc, workers=2, env={"ADMIN_API_KEY": KEY},
                           roster_file=tmp_path / "roster.yaml")
    calls: list[tuple[str, int]] = []
    hups = 0
    with Load(gw.url, clients=4, max_tokens=8) as load:
        end = time.monotonic() + seconds
        while time.monotonic() < end and hups < seconds / SIGHUP_EVERY + 1:
            next_hup = time.monotonic() + SIGHUP_EVERY
            os.kill(gw.proc.pid, signal.SIGHUP)
            hups += 1
            # After every other SIGHUP the file is left as that reload read it, so gunicorn's
            # own pass finds nothing to do and forks the new workers at once, while the
            # master's reload thread may still be writing the state directory.
            if hups % 2 == 0:
                time.sleep(SIGHUP_EVERY / 4)
                calls.append(("POST", admin("POST", gw.url + "/instances",
                                            json={"role": "decode", "url": d2.url})))
                time.sleep(SIGHUP_EVERY / 4)
                calls.append(("DELETE", admin("DELETE", gw.url + "/instances",
                                              params={"url": d2.url})))
            time.sleep(max(0.0, next_hup - time.monotonic()))
    log = gw.log.read_text(errors="replace").splitlines()
    lock_errors = [line for line in log if LOCK_ERROR in line]
    refused = [(method, status) for method, status in calls if not 200 <= status < 300]
    reloads = sum("reloaded: generation" in line for line in log)
    print(f"\n{hups} SIGHUPs in {seconds:g} s, {reloads} roster passes; {len(calls)} admin "
          f"calls, {len(refused)} not 2xx {refused[:6]}; {len(lock_errors)} lock errors "
          f"logged; load: {load.summary()}")
    assert not lock_errors, lock_errors[:3]
    assert not refused
    assert gw.proc.poll() is None
    assert load.completed > 0


def test_sighups_under_load_never_leave_the_lock_with_a_worker(procs, tmp_path) -> None:
    storm(procs, tmp_path, 20.0)


@pytest.mark.slow
def test_a_minute_of_sighups_under_load(procs, tmp_path) -> None:
    storm(procs, tmp_path, 60.0)
