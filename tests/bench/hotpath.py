"""CPU per request of the proxy's own per-request work, upstream calls left out.

    .venv/bin/python -m gevent.monkey tests/bench/hotpath.py [--multiprocess] [--repeats 7]
        [--report docs/benchmarks.md]

Drives the app's WSGI callable in this process with a prepared environ; the pipeline is
replaced by a stand-in that does what a non-stream P/D request does around its two upstream
calls (two legs, two routing decisions, stage timings, the request's finish: log line and
metrics), so what is measured is the edge, dispatch, log line and metrics. CPU time
(``time.thread_time``), the minimum over repeats, so a busy machine's noise drops out.
``--multiprocess`` points prometheus_client at a fresh multiprocess directory, as under
gunicorn. Parts:

- ``app``: the whole WSGI chain as served (the completion fast path);
- ``admission``: the same, from an app whose roster turns admission control on (two tenants,
  the request's named by ``X-Tenant``; ``max_concurrency`` on both instances) while the fleet
  is not full (docs/behaviour.md#admission);
- ``limited``: as ``admission``, the request's tenant limited to a million requests and
  tokens a minute (counted in this process: the local store; one Redis round trip more with
  ``admission.store``); each call yields to the hub once, so the greenlet that corrects the
  charge after the answer runs (and is counted) within the measurement;
- ``flask``: the same chain with Flask dispatching the completion route;
- ``observer``: the metric updates of one request (its events, fired directly);
- ``logline``: the request's log line, formatted and written to a discarding handler
  (formatted as the packaged gunicorn configuration does);
- ``format``: only the line's text.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

PREFILL, DECODE = "http://127.0.0.1:18001", "http://127.0.0.1:18002"
BODY = (b'{"model":"m","messages":[{"role":"user","content":"Hello there, how are you?"}],'
        b'"max_tokens":16}')
ANSWER = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":' \
         b'{"role":"assistant","content":"fine"}}],"usage":{"prompt_tokens":7}}'


def environ() -> dict[str, Any]:
    return {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions", "SCRIPT_NAME": "",
        "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1", "REMOTE_PORT": "40000",
        "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(BODY)),
        "HTTP_HOST": "127.0.0.1:8000", "HTTP_USER_AGENT": "OpenAI/Python 1.50.0",
        "HTTP_ACCEPT": "application/json", "HTTP_AUTHORIZATION": "Bearer sk-none",
        "wsgi.input": io.BytesIO(BODY), "wsgi.input_terminated": True,
        "wsgi.url_scheme": "http", "wsgi.errors": sys.stderr, "wsgi.version": (1, 0),
        "wsgi.multithread": False, "wsgi.multiprocess": False, "wsgi.run_once": False,
    }


def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
    return None


def cpu_per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Microseconds of this thread's CPU per call, the minimum over ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--multiprocess", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--parts", default="app,admission,limited,flask,observer,logline")
    parser.add_argument("--report", default="",
                        help="markdown file whose `hotpath` block the figures replace")
    args = parser.parse_args()
    started, info = report.now(), report.machine()
    if args.multiprocess:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="epd-hotpath-")

    from epd_flask.app import create_app, services
    from epd_flask.control.config import ProxyConfig
    from epd_flask.control.roster import Instance, parse
    from epd_flask.core.events import FleetEntry
    from epd_flask.core.headers import REQUEST_ID_HEADER
    from epd_flask.fleet.policies import Decision, Placement
    from epd_flask.serving.context import RequestContext
    from epd_flask.serving.pipeline import Reply
    try:
        from epd_flask.web.fastpath import FastPath
    except ImportError:  # measuring a tree from before it
        FastPath = type(None)
    from epd_flask.web.inflight import InFlightMiddleware
    from epd_flask.web.slowbody import BodyDeadline

    # As the packaged gunicorn configuration sets it up (control/gunicorn_config.py).
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115
    handler.setFormatter(logging.Formatter("%(asctime)s [%(process)d] [%(levelname)s] "
                                           "%(name)s: %(message)s"))
    log = logging.getLogger("epd_flask")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)

    roster = parse({"instances": [{"role": "prefill", "url": PREFILL},
                                  {"role": "decode", "url": DECODE}]}, "bench")
    app = create_app(ProxyConfig.from_env(), roster)
    svc = services(app)
    ev = svc.events
    svc.metrics.observer.fleet([FleetEntry("prefill", PREFILL, True),
                                FleetEntry("decode", DECODE, True)])
    svc.metrics.observer.models(["m"])
    admitted_app = create_app(ProxyConfig.from_env(), parse({
        "settings": {"admission": {"tenant_header": "X-Tenant"}},
        "tenants": {"chat": {"weight": 4, "priority": "high", "requests_per_minute": 10**6,
                             "tokens_per_minute": 10**6}, "batch": {"priority": "low"}},
        "instances": [{"role": "prefill", "url": PREFILL, "max_concurrency": 64},
                      {"role": "decode", "url": DECODE, "max_concurrency": 64}]}, "bench"))

    decisions = {role: Decision(Placement(Instance(role=role, url=url)), "round_robin",
                                "rotation", "")
                 for role, url in (("prefill", PREFILL), ("decode", DECODE))}

    def completion(path: str, body: dict[str, Any], ctx: RequestContext,
                   plan: object = None) -> Reply:
        # What the pipeline works out first when admission did not (the model, the keys).
        if plan is None:
            svc.pipeline.plan(body, ctx)
        ctx.model = "m"
        for role, url in (("prefill", PREFILL), ("decode", DECODE)):
            ctx.decided(role, decisions[role])
            ctx.instances[role] = url
            started = time.monotonic()
            with ctx.leg(role, role, url) as call:
                call.status = 200
            ctx.mark(role if role == "prefill" else "decode_first_byte", started)
        ctx.bytes_out = len(ANSWER)
        ctx.finish(status=200)
        return Reply(200, [("Content-Type", "application/json"),
                           (REQUEST_ID_HEADER, ctx.request_id)], ANSWER)

    svc.pipeline.completion = completion  # type: ignore[method-assign]
    services(admitted_app).pipeline.completion = completion  # type: ignore[method-assign]
    served = app.wsgi_app
    fast = served.app.app
    flask_only = InFlightMiddleware(BodyDeadline(fast.inner, svc.config.body_timeout),
                                    svc.inflight) if isinstance(fast, FastPath) else served

    def request(wsgi: Callable[..., Any], yields: bool = False,
                **extra: str) -> Callable[[], object]:
        def once() -> object:
            result = wsgi({**environ(), **extra}, start_response)
            body = b"".join(result)
            result.close()
            if yields:
                gevent.sleep(0)
            return body
        return once

    def observer() -> None:
        ctx = RequestContext("r", "/v1/chat/completions", {}, events=ev)
        ctx.model = "m"
        ctx.instances.update(prefill=PREFILL, decode=DECODE)
        ctx.timings.update(prefill=1.5, decode_first_byte=2.5, first_byte=4.0, total=4.0)
        ctx.bytes_out = len(ANSWER)
        ctx.status = 200
        ev.load.fire(1, 32)
        for role, url in (("prefill", PREFILL), ("decode", DECODE)):
            ev.routed.fire(role, "round_robin", "rotation", url)
            ev.upstream_opened.fire(role, url)
            ev.upstream_closed.fire(role, url)
        ev.request_finished.fire(ctx)
        ev.load.fire(0, 32)

    logline_ctx = RequestContext("0123456789abcdef0123456789abcdef", "/v1/chat/completions",
                                 {}, upstream_id="fedcba9876543210fedcba9876543210")
    logline_ctx.model = "m"
    logline_ctx.instances.update(prefill=PREFILL, decode=DECODE)
    logline_ctx.timings.update(prefill=1.512, decode_first_byte=2.503, first_byte=4.01,
                               total=4.02)
    logline_ctx.bytes_out = len(ANSWER)
    logline_ctx.status = 200
    requests_logger = logging.getLogger("epd_flask.requests")

    def logline() -> None:
        requests_logger.info("%s", logline_ctx.log_line())

    parts: dict[str, Callable[[], object]] = {
        "app": request(served), "flask": request(flask_only),
        "admission": request(admitted_app.wsgi_app, HTTP_X_TENANT="batch"),
        "limited": request(admitted_app.wsgi_app, yields=True, HTTP_X_TENANT="chat"),
        "observer": observer,
        "logline": logline, "format": logline_ctx.log_line}
    rows = []
    for name in args.parts.split(","):
        parts[name]()
        us = cpu_per_call(parts[name], args.calls, args.repeats)
        rows.append(f"| {name} | {us:.1f} |")
        print(f"{name:10s} {us:8.1f} us CPU per call (min of {args.repeats} x {args.calls}"
              f"{', multiprocess' if args.multiprocess else ''})")
    if args.report:
        command = report.recorded_command(
            ".venv/bin/python -m gevent.monkey tests/bench/hotpath.py", sys.argv[1:])
        report.write_section(Path(args.report), "hotpath", "\n".join([
            report.stamp(started, info, command),
            f"CPU per call, the minimum of {args.repeats} x {args.calls} calls"
            f"{' (metrics in multiprocess mode, as under gunicorn)' if args.multiprocess else ''}:",
            "", "| part | us |", "|---|---:|", *rows]))


if __name__ == "__main__":
    main()
