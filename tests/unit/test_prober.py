"""What the prober remembers per instance lasts while the instance is listed: a fleet whose
addresses churn (pods) leaves a worker bounded."""

from __future__ import annotations

import time

from epd_flask.control.roster import Instance, Roster, Settings
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.prober import Prober
from epd_flask.upstream.transport import Transport


def test_instances_that_left_are_forgotten() -> None:
    kept = Instance(role="decode", url="http://127.0.0.1:9")
    churned = [Instance(role="decode", url=f"http://127.0.0.1:{1000 + i}") for i in range(50)]
    live = LiveFleet(Roster(settings=Settings(), instances=(kept,)))
    prober = Prober(live, Transport())
    for generation, inst in enumerate(churned, start=2):
        live.adopt(Roster(settings=Settings(), instances=(kept, inst)), generation)
        prober._engine_tried[inst.url] = time.monotonic()  # as a read of it does
    live.adopt(Roster(settings=Settings(), instances=(kept,)), 100)
    assert set(prober._engine_tried) <= {kept.url}
