"""The lean multiprocess values (observe/mpvalues.py) write exactly what prometheus_client's
own would, at once, and a forked child still gets files of its own.

Multiprocess mode is chosen when prometheus_client is imported, so each case runs in a fresh
interpreter, gevent-patched as a gunicorn worker is, with its own multiprocess directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import json, os, sys
import gevent.monkey
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from epd_flask.observe import mpvalues

lean = sys.argv[1] == "lean"
if lean:
    assert mpvalues.install()

def scrape():
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in registry.collect() for s in family.samples}

counter = Counter("t_requests", "c", ["route"])
hist = Histogram("t_seconds", "h", ["route"], buckets=(0.001, 0.01, 0.1, 1.0))
gauge = Gauge("t_in_flight", "g", ["role"], multiprocess_mode="livesum")
recent = Gauge("t_live", "g", ["role"], multiprocess_mode="livemostrecent")
seen = []
for i in range(500):
    counter.labels("/v1/completions").inc()
    counter.labels("passthrough").inc(i % 3)
    hist.labels("/v1/completions").observe((i % 17) * 0.0123)
    gauge.labels("decode").inc()
    gauge.labels("decode").dec() if i % 2 else None
    recent.labels("decode").set(i % 2)
    if i in (0, 250):
        seen.append(scrape())  # every update is in the files at once
# The interpreter's own fork and wait: gevent's watch the child from the hub, which this
# script never runs.
pid = gevent.monkey.get_original("os", "fork")()
if pid == 0:
    counter.labels("/v1/completions").inc(5)
    os._exit(0)
gevent.monkey.get_original("os", "waitpid")(pid, 0)
files = sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
print(json.dumps({"seen": seen, "final": scrape(), "child_file": f"counter_{pid}.db" in files,
                  "class": type(counter.labels("x")._value).__name__}))
'''


def run(tmp_path: Path, kind: str) -> dict[str, object]:
    directory = tmp_path / kind
    directory.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "gevent.monkey", str(tmp_path / "script.py"), kind],
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=True, cwd=Path(__file__).parents[2])
    return json.loads(out.stdout)


def test_lean_values_write_what_prometheus_client_writes(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    lean, base = run(tmp_path, "lean"), run(tmp_path, "base")
    assert lean["class"] == "GreenletValue" and base["class"] == "MmapedValue"
    assert lean["seen"] == base["seen"] and lean["final"] == base["final"]
    final = lean["final"]
    assert isinstance(final, dict)
    assert final["t_requests_total[('route', '/v1/completions')]"] == 505
    assert final["t_seconds_count[('route', '/v1/completions')]"] == 500
    assert lean["child_file"] and base["child_file"]
