"""The multiprocess directory as one collector: every worker's values summed at a scrape
(prometheus_client's own merge), less the series of model names that may not label anything
now (observe/observer.py's ``ModelLabels``): a worker's files keep every series it ever wrote,
and only the exposition can leave them out."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Collection, Iterator

from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector


class MultiprocessDir(Collector):
    def __init__(self, path: str, by_model: Collection[str] = (),
                 allowed: Callable[[str], bool] = lambda name: True) -> None:
        self.path = path
        self._by_model = frozenset(by_model)
        self._allowed = allowed

    def files(self) -> list[str]:
        return glob.glob(os.path.join(self.path, "*.db"))

    def collect(self) -> Iterator[Metric]:
        for metric in MultiProcessCollector.merge(self.files(), accumulate=True):
            if metric.name in self._by_model:
                metric.samples = [s for s in metric.samples
                                  if self._allowed(s.labels.get("model", ""))]
            yield metric
