"""Snapshots of one app's metrics, and the last few minutes of them that ``/status`` draws its
rates, percentiles and plots from."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

from epd_flask.core.periodic import Periodic

# /status compares the newest sample with one this old.
STATUS_WINDOW_SECONDS = 300.0
SAMPLE_INTERVAL_SECONDS = 10.0

Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Snapshot:
    """Every sample of one collection, keyed by sample name and sorted labels."""

    taken: float
    values: dict[Key, float]

    @classmethod
    def of(cls, families: Iterable[Metric], keys: dict[Key, Key] | None = None) -> Snapshot:
        """Every sample of ``families``. ``keys``: the keys of an earlier snapshot, whose
        objects this one reuses (see ``History``)."""
        values: dict[Key, float] = {}
        for family in families:
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                key: Key = (s.name, tuple(sorted(s.labels.items())))
                if keys is not None:
                    key = keys.get(key, key)
                values[key] = s.value
        return cls(time.monotonic(), values)

    def series(self, name: str) -> Iterator[tuple[dict[str, str], float]]:
        for (sample, labels), value in self.values.items():
            if sample == name:
                yield dict(labels), value


class History:
    """Snapshots of the last few minutes, so /status can show rates and percentiles over a
    recent window instead of since the start. One sampling greenlet per app, started with
    its services."""

    def __init__(self, snapshot: Callable[[dict[Key, Key] | None], Snapshot],
                 interval: float = SAMPLE_INTERVAL_SECONDS,
                 window: float = STATUS_WINDOW_SECONDS) -> None:
        self.snapshot = snapshot
        self.interval = interval
        self.window = window
        self._samples: deque[Snapshot] = deque()
        # The newest sample's keys: each sample shares them with the one before instead of
        # holding its own copy of every label string (a fleet of 1,000 instances has tens of
        # thousands of series, and a window of 30 samples held them 30 times).
        self._keys: dict[Key, Key] = {}
        self._loop = Periodic("metrics sample", self.sample, lambda: self.interval)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def sample(self) -> Snapshot:
        snap = self.snapshot(self._keys)
        self._keys = {key: key for key in snap.values}
        self._samples.append(snap)
        while len(self._samples) > 1 and snap.taken - self._samples[1].taken >= self.window:
            self._samples.popleft()
        return snap

    def samples(self) -> list[Snapshot]:
        """The kept samples, oldest first (the status page's plots)."""
        return list(self._samples)

    def baseline(self, now: Snapshot) -> Snapshot | None:
        """The oldest kept sample within the window before ``now`` (None: nothing older)."""
        for snap in self._samples:
            if snap is not now and now.taken - snap.taken <= self.window + self.interval:
                return snap
        return None
