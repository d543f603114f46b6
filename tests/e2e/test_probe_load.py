"""Health probes scale with workers x instances: every gunicorn worker probes every instance
once per probe_interval (docs/deploy.md, "Probe load")."""

from __future__ import annotations

import time

import pytest

from tests.rosters import roster

pytestmark = pytest.mark.e2e

INTERVAL = 0.1
WINDOW = 1.0


def test_probes_per_instance_grow_with_workers(procs) -> None:
    one, three = procs["sim"]("decode"), procs["sim"]("decode")
    for sim, workers in ((one, 1), (three, 3)):
        procs["gunicorn"](roster(decodes=[sim], probe_interval=INTERVAL), workers=workers)
    before = one.stats()["health_checks"], three.stats()["health_checks"]
    time.sleep(WINDOW)
    after = one.stats()["health_checks"], three.stats()["health_checks"]
    by_one, by_three = after[0] - before[0], after[1] - before[1]
    print(f"\nprobes of one instance in {WINDOW} s at probe_interval {INTERVAL} s: "
          f"{by_one} from 1 worker, {by_three} from 3 workers")
    assert by_one >= 1
    # Three workers probe an instance about three times as often as one does.
    assert by_three >= 2 * by_one
