"""gunicorn settings for the benchmark: the real ones (etc/gunicorn.conf.py), plus a probe in
the worker that measures how long its event loop was held by one greenlet.

While the file named by EPD_BENCH_STALL_FLAG exists, a greenlet ticks every millisecond and
logs each time more than STALL_LOG_MS of this thread's CPU time passed between two ticks:
CPU time, not wall time, so a shared machine descheduling the worker does not count as a
stall. Lines are "unix-time cpu-ms" in EPD_BENCH_STALL_LOG. Off, it wakes 10 times a second.
"""

import os

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "etc",
                     "gunicorn.conf.py")
with open(_path, encoding="utf-8") as _f:
    exec(compile(_f.read(), _path, "exec"))

_serve_post_worker_init = post_worker_init  # noqa: F821 (defined by the exec above)
# To compare gunicorn's worker classes (gevent, gevent_pywsgi) on the same workloads.
worker_class = os.environ.get("EPD_BENCH_WORKER_CLASS", worker_class)  # noqa: F821
STALL_LOG_MS = 2.0


def post_worker_init(worker):
    _serve_post_worker_init(worker)
    flag, log = os.environ.get("EPD_BENCH_STALL_FLAG"), os.environ.get("EPD_BENCH_STALL_LOG")
    if flag and log:
        import gevent  # in the worker only: the master never loads gevent

        gevent.spawn(_probe, flag, log)


def _probe(flag, log):
    import time

    import gevent

    with open(log, "a", buffering=1, encoding="utf-8") as out:
        while True:
            if not os.path.exists(flag):
                gevent.sleep(0.1)
                continue
            last = time.thread_time()
            for _ in range(1000):
                gevent.sleep(0.001)
                now = time.thread_time()
                if (now - last) * 1000 > STALL_LOG_MS:
                    out.write(f"{time.time():.4f} {(now - last) * 1000:.2f}\n")
                last = now


# The fleet benchmark's oracle (tests/bench/oracle.py), a policy only benchmarks may name: one
# line in the policy table, as any policy is added, here in the master before the roster is
# checked, so the workers it forks have it too.
def _declare_oracle():
    import sys

    from epd_flask.control import policyspecs

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    policyspecs.POLICIES.setdefault("oracle", "oracle:Oracle")


_declare_oracle()
