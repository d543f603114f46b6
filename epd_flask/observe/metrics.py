"""One app's Prometheus metrics: its metric objects (families.py), the observer that feeds them
from the app's events (observer.py), the ``/metrics`` exposition, and the snapshots and recent
history ``/status`` is drawn from (history.py). ``app.build_services`` makes one per app.

Where the values live comes from the app's config. With a multiprocess directory
(``PROMETHEUS_MULTIPROC_DIR``, prepared by the gunicorn master, see metricsdir.py) every
worker writes its values there and any worker's scrape sums them all, through
prometheus_client's multiprocess mode. Without one (tests, a lone process) the app's values
live in a registry of its own: two apps in one process never see each other's.

The value class behind every metric stays a choice of the process, not of the app:
prometheus_client picks it from ``PROMETHEUS_MULTIPROC_DIR`` when it is imported, reads its
module global (``values.ValueClass``) whenever a metric makes a child, and a multiprocess
value writes to ``<kind>_<pid>.db``, one set of files per process. A gunicorn worker holds one
app, so the two agree; an app whose config disagrees with its process is refused when built
rather than writing where nobody reads (``check_value_class``).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epd_flask.control import settings
from epd_flask.control.metricsdir import ENV as MULTIPROC_ENV
from epd_flask.control.statedir import StateDir
from epd_flask.core.events import Events
from epd_flask.observe import mpvalues
from epd_flask.observe.families import Families
from epd_flask.observe.history import History, Key, Snapshot
from epd_flask.observe.mpdir import MultiprocessDir
from epd_flask.observe.observer import MetricsObserver
from epd_flask.observe.shown import Shown

CONTENT_TYPE = CONTENT_TYPE_LATEST


def check_value_class(multiprocess_dir: str | None) -> None:
    """Refuse an app whose metrics would not go where its scrapes read them (see above)."""
    multiprocess = bool(getattr(values.ValueClass, "_multiprocess", False))
    env = settings.read(MULTIPROC_ENV)
    if multiprocess_dir and not multiprocess:
        raise ValueError(f"metrics in {multiprocess_dir} need {MULTIPROC_ENV} set before "
                         "prometheus_client is imported (the gunicorn master sets it)")
    if multiprocess and not multiprocess_dir:
        raise ValueError(f"this process writes multiprocess metrics to {env} "
                         f"({MULTIPROC_ENV} was set when prometheus_client was imported); "
                         "the app must read them from there")
    if multiprocess_dir and env \
            and os.path.realpath(env) != os.path.realpath(multiprocess_dir):
        raise ValueError(f"metrics are written to {env} ({MULTIPROC_ENV}), not to "
                         f"{multiprocess_dir}")


class Metrics:
    def __init__(self, events: Events, multiprocess_dir: str | None = None,
                 state_dir: str | None = None) -> None:
        if multiprocess_dir:
            mpvalues.install()  # before the families below create their values
        check_value_class(multiprocess_dir)
        self.multiprocess_dir = multiprocess_dir
        self._registry = None if multiprocess_dir else CollectorRegistry()
        self.families = Families(self._registry, StateDir(state_dir) if state_dir else None)
        self.observer = MetricsObserver(self.families)
        self.observer.listen(events)
        self.history = History(self.snapshot)
        sources = ([self._registry] if self._registry is not None
                   else [MultiprocessDir(multiprocess_dir or ""), self.families.reloads])
        self._shown = CollectorRegistry()
        models = self.observer.model_labels
        self._shown.register(Shown(sources, {"model": lambda kind, name: models.allowed(name),
                                             "instance": self.observer.shown}))

    def start(self) -> None:
        self.history.start()

    def stop(self) -> None:
        self.history.stop()

    def exposition(self) -> bytes:
        """The ``/metrics`` body: every worker's values summed (or this app's, alone)."""
        return generate_latest(self._shown)

    def snapshot(self, keys: dict[Key, Key] | None = None) -> Snapshot:
        """Every sample now. ``keys``: see ``Snapshot.of``."""
        return Snapshot.of(self._shown.collect(), keys)
