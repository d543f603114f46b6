"""The series ``/metrics`` and ``/status`` show: those whose model and instance may still label
something (observer.py's ``LabelWindow``s), out of every series the values hold.

The values keep every series they were ever given (prometheus_client cannot remove a series
from a multiprocess file), so a fleet whose instances come and go, or whose adapters churn,
would otherwise show its departed members for the life of the workers
(docs/behaviour.md#models, #discovery).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class Shown(Collector):
    def __init__(self, sources: Sequence[Collector],
                 keep: Mapping[str, Callable[[str, str], bool]]) -> None:
        """``keep``: per label name, whether a series of a metric of that type (``counter``,
        ``gauge``, ...) with that label's value shows."""
        self._sources = sources
        self._keep = tuple(keep.items())

    def collect(self) -> Iterator[Metric]:
        keep = self._keep
        for source in self._sources:
            for metric in source.collect():
                kind = metric.type
                metric.samples = [s for s in metric.samples
                                  if all(label not in s.labels or shows(kind, s.labels[label])
                                         for label, shows in keep)]
                yield metric
