"""What a scrape costs after many worker generations, with and without folding their files.

One real worker writes a realistic set of series (an app in multiprocess mode serving a P+D
fleet's requests, through its events); its files are then copied under ``--generations``
pids that no process has, as the workers of that many reloads would leave them. The scrape's
CPU time is measured reading every file (prometheus_client's merge, what ``/metrics`` did
before folding) and after ``MultiprocessDir`` folded them (what it does now):

    .venv/bin/python -m gevent.monkey tests/bench/mpfold.py --generations 1000
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

WORKER = textwrap.dedent("""
    from epd_flask.control.config import ProxyConfig
    from epd_flask.control.roster import parse
    from epd_flask.app import create_app, services
    from epd_flask.serving.context import RequestContext
    roster = parse({"instances": [{"role": "prefill", "url": "http://p:1"},
                                  {"role": "decode", "url": "http://d:1"}]}, "bench")
    svc = services(create_app(ProxyConfig.from_env(), roster))
    for i in range(50):
        ctx = RequestContext("r", ("/v1/chat/completions", "/v1/completions")[i % 2], {},
                             events=svc.events)
        ctx.instances.update(prefill="http://p:1", decode="http://d:1")
        ctx.timings.update(prefill=1.5 * i, decode_first_byte=2.5, first_byte=4.0, total=9.0)
        ctx.status, ctx.chunks, ctx.bytes_out = (200, 500)[i % 7 == 0], 9, 100
        svc.events.request_finished.fire(ctx)
""")
#: Above Linux's largest pid: no process has these.
FAKE_PID = 5_000_000


def cpu_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="epd-mpfold-"))
    try:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
        script = directory / "worker.py"
        script.write_text(WORKER)
        subprocess.run([sys.executable, "-m", "gevent.monkey", str(script)], env=env,
                       check=True, timeout=120, cwd=Path(__file__).parents[2])
        written = [p for p in directory.glob("*.db")
                   if p.name.startswith(("counter_", "histogram_"))]
        for n in range(args.generations):
            for path in written:
                kind = path.name.rsplit("_", 1)[0]
                shutil.copy(path, directory / f"{kind}_{FAKE_PID + n}.db")
        for path in written:
            path.unlink()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        from prometheus_client.multiprocess import MultiProcessCollector

        from epd_flask.observe.mpdir import MultiprocessDir
        files = sorted(str(p) for p in directory.glob("*.db"))
        size = sum(os.path.getsize(f) for f in files)
        unfolded = cpu_ms(lambda: list(MultiProcessCollector.merge(files, True)), args.repeats)
        found = MultiprocessDir(str(directory))
        start = time.thread_time()
        gone = found.fold()
        fold_ms = (time.thread_time() - start) * 1000
        folded = cpu_ms(lambda: list(found.collect()), args.repeats)
        left = sorted(p.name for p in directory.glob("*.db"))
        print(f"{args.generations} dead generations: {len(files)} files, {size / 1e6:.1f} MB; "
              f"a scrape reading them all: {unfolded:.1f} ms CPU")
        print(f"fold once: {gone} files in {fold_ms:.1f} ms CPU, leaving {left}; "
              f"a scrape after it: {folded:.2f} ms CPU")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
