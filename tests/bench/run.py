"""``make bench``: epd-flask next to a direct-to-decode baseline and two peers, same run.

Starts simulated instances (zero latency unless a workload paces tokens), epd-flask under
gunicorn with one gevent worker as shipped (log level info, metrics on, no access log),
vllm-router in P/D mode and vLLM's EPD proxy (its example script, run from a copy outside the
source tree), all on loopback as separate processes; runs each workload through the load
generator (another process) against each target in turn, and measures the target's process
tree through /proc. Bounded: every workload has a request count and a deadline. A whole run
replaces the ``bench`` block of docs/benchmarks.md (``report.write_section``), leaving the
hand-written explanation around it alone; a partial run writes only where ``--report`` says.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import procstat
import report

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
GUNICORN_CONF = Path(__file__).resolve().parent / "gunicorn_bench.conf.py"
CHAT = "/v1/chat/completions"
MODEL = "tiny-llama"
START_TIMEOUT = 30.0
IMAGE_BASE64_BYTES = 4 * 1024 * 1024
ENCODERS = 4
SLOW_ENCODER_MS = 50
FD_LIMIT = 8192
EPD_PROXY = "vllm-epd-proxy"
#: epd-flask as shipped, with tracing on (``--tracing``): every request traced and exported.
TRACED = "epd-flask+tracing"
#: epd-flask with admission control configured (``--admission``): tenants named by a header,
#: every instance bounded far above the load, so the fleet is never full.
ADMITTED = "epd-flask+admission"
#: Its instances' ``max_concurrency``: above any workload's concurrency.
ADMITTED_SEATS = 1024
OTLP_SINK = Path(__file__).resolve().parent / "otlpsink.py"
#: This benchmark's block in docs/benchmarks.md.
LABEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_body(tokens: int, stream: bool, content: Any = "Tell me a story.") -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "stream": stream,
                            "messages": [{"role": "user", "content": content}]}
    return body


def image_content(n_images: int, b64_bytes: int, seed: int = 7) -> list[dict[str, Any]]:
    """Chat content with ``n_images`` distinct inline images, each ``b64_bytes`` of base64."""
    rng = random.Random(seed)
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe these."}]
    for _ in range(n_images):
        raw = rng.randbytes(b64_bytes * 3 // 4)
        url = "data:image/png;base64," + base64.b64encode(raw).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


@dataclass
class Workload:
    name: str
    what: str
    sim: dict[str, Any]
    groups: list[dict[str, Any]]
    repeats: int = 1
    deadline: float = 60.0
    # Knobs per encoder (the rest get ttft 0); None: all at zero latency.
    encoders: list[dict[str, Any]] | None = None
    # Record how long epd-flask's event loop was held (gunicorn_bench.conf.py's probe),
    # counting from this many seconds after the start (after the streams' own ramp).
    stall_probe: float | None = None
    # Requests with media: vLLM's EPD proxy, as published, builds its encoder URL from the
    # whole list of encoder URLs, so every multimodal request fails there; it sits these out.
    media: bool = False


@dataclass
class Target:
    name: str
    url: str
    roots: list[int] = field(default_factory=list)


class Fleet:
    """The processes of one benchmark run; every one of them is ours and stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              ) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def sim(self, role: str, *extra: str) -> tuple[str, int]:
        port = free_port()
        proc = self.spawn(f"sim-{role}-{port}", [
            str(BIN / "epd-flask-sim"), "--role", role, "--port", str(port),
            "--max-model-len", "16384", "--log-level", "WARNING", *extra])
        url = f"http://127.0.0.1:{port}"
        wait_up(url + "/health", proc)
        return url, proc.pid

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not up after {START_TIMEOUT} s")


def configure(url: str, knobs: dict[str, Any]) -> None:
    req = urllib.request.Request(url + "/sim/config", data=json.dumps(knobs).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5):
        pass


def build_workloads(quick: bool, workdir: Path) -> list[Workload]:
    def body_file(name: str, n_images: int, b64_bytes: int) -> str:
        path = workdir / name
        path.write_bytes(json.dumps(chat_body(16, False, image_content(n_images, b64_bytes)))
                         .encode())
        return str(path)

    big = body_file("big-4mb.json", 1, IMAGE_BASE64_BYTES)
    scale = 0.3 if quick else 1.0

    def n(count: int) -> int:
        return max(1, int(count * scale))

    stage = ("epd-flask: E+P+D over 4 encoders, which answer empty metadata as LLaVA does, so "
             "the media also reach prefill and decode; vllm-router has no encoder stage: P+D")
    items = [Workload(
        f"e{k}", f"{k} image(s) of 64 KB base64 per request, concurrency 4 ({stage})",
        {"token_delay": 0.0, "output_tokens": 16},
        [{"name": f"e{k}", "path": CHAT, "body_file": body_file(f"e{k}.json", k, 64 * 1024),
          "concurrency": 4, "requests": n(200)}], media=True) for k in (1, 2, 4, 8)]
    return [
        Workload("a1", "non-stream, 16 tokens, concurrency 1",
                 {"token_delay": 0.0, "output_tokens": 16},
                 [{"name": "a1", "path": CHAT, "body": chat_body(16, False),
                   "concurrency": 1, "requests": n(400)}], repeats=4),
        Workload("a32", "non-stream, 16 tokens, concurrency 32",
                 {"token_delay": 0.0, "output_tokens": 16},
                 [{"name": "a32", "path": CHAT, "body": chat_body(16, False),
                   "concurrency": 32, "requests": n(3000)}], repeats=4),
        Workload("b", "stream, 64 tokens at 5 ms/token, concurrency 64",
                 {"token_delay": 0.005, "output_tokens": 64},
                 [{"name": "b", "path": CHAT, "body": chat_body(64, True),
                   "concurrency": 64, "requests": n(640)}], repeats=4),
        Workload("c", "500 concurrent streams, 200 tokens at 20 ms/token (started over 2 s)",
                 {"token_delay": 0.02, "output_tokens": 200},
                 [{"name": "c", "path": CHAT, "body": chat_body(200, True),
                   "concurrency": n(500), "requests": n(500), "ramp": 2.0}], repeats=1),
        Workload("d", "a chat request with a 4 MB base64 image, 5 times one after the other, "
                 f"while 100 streams (200 tokens at 20 ms) flow on the same worker ({stage})",
                 {"token_delay": 0.02, "output_tokens": 200},
                 [{"name": "d-streams", "path": CHAT, "body": chat_body(200, True),
                   "concurrency": 100, "requests": 100, "ramp": 0.5},
                  {"name": "d-big", "path": CHAT, "body_file": big,
                   "concurrency": 1, "requests": 5, "delay": 1.5}], repeats=1,
                 stall_probe=1.4, media=True),
        Workload("d-alone", "the 4 MB request alone, one after the other (its own proxy CPU)",
                 {"token_delay": 0.0, "output_tokens": 16},
                 [{"name": "d-alone", "path": CHAT, "body_file": big,
                   "concurrency": 1, "requests": n(20)}], repeats=1, media=True),
        *items,
        Workload("e8-even", "8 images per request, concurrency 1, all 4 encoders at zero latency",
                 {"token_delay": 0.0, "output_tokens": 16},
                 [{"name": "e8-even", "path": CHAT,
                   "body_file": str(workdir / "e8.json"), "concurrency": 1,
                   "requests": n(40)}], media=True),
        Workload("e8-skew", "8 images per request, concurrency 1, one of the 4 encoders takes "
                 f"{SLOW_ENCODER_MS} ms, the others none: wall time should track the slowest",
                 {"token_delay": 0.0, "output_tokens": 16},
                 [{"name": "e8-skew", "path": CHAT,
                   "body_file": str(workdir / "e8.json"), "concurrency": 1,
                   "requests": n(40)}],
                 encoders=[{"ttft": SLOW_ENCODER_MS / 1000}, {}, {}, {}], media=True),
    ]


def run_loadgen(url: str, workload: Workload) -> tuple[dict[str, Any], float]:
    spec = {"url": url, "deadline": workload.deadline, "groups": workload.groups}
    proc = subprocess.Popen([sys.executable, str(LOADGEN)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {err.decode(errors='replace')[-2000:]}")
    return json.loads(out), usage.ru_utime + usage.ru_stime


def read_stalls(log: Path, since: float) -> list[float]:
    """CPU milliseconds the worker's loop was held, each stretch over the probe's threshold."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        stamp, ms = line.split()
        if float(stamp) >= since:
            out.append(float(ms))
    return out


def start_profiler(target: Target, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy (from the developer's venv, never a dependency) on the target's worker."""
    pyspy = shutil.which("py-spy", path=str(BIN)) or shutil.which("py-spy")
    if pyspy is None:
        raise RuntimeError("--profile needs py-spy: pip install py-spy into the venv")
    pids = procstat.tree(target.roots[0])
    worker = pids[-1]  # one gevent worker under the gunicorn master
    proc = subprocess.Popen([pyspy, "record", "--pid", str(worker), "--rate", "250",
                             "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches before the load starts
    return proc


def measure(target: Target, sims: list[int], workload: Workload,
            profile: Path | None = None) -> dict[str, Any]:
    profiler = start_profiler(target, profile) if profile else None
    procstat.reset_peak(target.roots)
    before = procstat.sample(target.roots)
    sims_before = procstat.sample(sims)
    result, client_cpu = run_loadgen(target.url, workload)
    after = procstat.sample(target.roots)
    sims_after = procstat.sample(sims)
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(30)
    requests = sum(g["completed"] + g["errors"] for g in result["groups"])
    return {
        "target": target.name,
        "groups": result["groups"],
        "requests": requests,
        "cpu_s": after.cpu_s - before.cpu_s,
        "peak_rss_mb": after.peak_rss_mb,
        "sim_cpu_s": sims_after.cpu_s - sims_before.cpu_s,
        "client_cpu_s": client_cpu,
    }


machine = report.machine


def router_version(router: str) -> str:
    pip = Path(router).parent / "pip"
    try:
        out = subprocess.run([str(pip), "show", "vllm-router"], capture_output=True,
                             text=True, timeout=30).stdout
    except OSError:
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def peer_version(python: str) -> str:
    """The libraries vLLM's EPD proxy runs on, as installed in the bench venv."""
    code = ("import importlib.metadata as m; print(', '.join(f'{n} {m.version(n)}' for n in "
            "('fastapi', 'uvicorn', 'aiohttp', 'uvloop')))")
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=30).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def spans_received(sink: str) -> dict[str, int]:
    """What the collector received, once the traced proxy's last batch is out (its export
    runs every 5 s while a batch is not full)."""
    time.sleep(6.0)
    with urllib.request.urlopen(sink + "/count", timeout=5) as resp:
        counts: dict[str, int] = json.loads(resp.read())
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The run's options; ``report`` is where its block goes ('' for nowhere)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", default="", help="vllm-router executable (bench venv)")
    p.add_argument("--epd-proxy", default="",
                   help="vLLM's disagg_epd_proxy.py, copied outside the source tree")
    p.add_argument("--epd-proxy-python", default="",
                   help="a Python with fastapi, aiohttp, uvicorn and uvloop (the bench venv)")
    p.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    p.add_argument("--targets", default=f"direct,epd-flask,vllm-router,{EPD_PROXY}")
    p.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    p.add_argument("--repeats", type=int, default=0, help="override every workload's repeats")
    p.add_argument("--json", default="", help="also write the raw results here")
    p.add_argument("--report", default=None,
                   help="markdown file whose `bench` block the report replaces (default: "
                   "docs/benchmarks.md for a whole run; none when --only, --quick, --repeats, "
                   "--targets or --profile make it a partial one; '' for none)")
    p.add_argument("--tracing", action="store_true",
                   help=f"also run {TRACED}: epd-flask with every request traced, its spans "
                   "exported to a collector process (otlpsink.py), side by side")
    p.add_argument("--admission", action="store_true",
                   help=f"also run {ADMITTED}: epd-flask with admission control configured "
                   "(tenants, max_concurrency) and the fleet never full, side by side")
    p.add_argument("--profile", default="",
                   help="directory: record py-spy stacks of the epd-flask worker per workload "
                   "(CPU figures of profiled runs are inflated; don't report them)")
    args = p.parse_args(argv)
    partial = bool(args.only or args.quick or args.repeats or args.profile
                   or args.targets != p.get_default("targets"))
    if args.report is None:
        args.report = "" if partial else str(report.PAGE)
        if partial:
            print("a partial run: docs/benchmarks.md is left as it is (--report FILE writes "
                  "it somewhere)", file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(FD_LIMIT, hard)), hard))
    targets_wanted = args.targets.split(",")
    if "vllm-router" in targets_wanted and not (args.router and Path(args.router).exists()):
        print("vllm-router not found (make bench installs it); running without it",
              file=sys.stderr)
        targets_wanted.remove("vllm-router")
    if EPD_PROXY in targets_wanted and not (args.epd_proxy and Path(args.epd_proxy).exists()
                                            and args.epd_proxy_python):
        print(f"vLLM's EPD proxy not found at {args.epd_proxy or '(no --epd-proxy)'} "
              "(docs/benchmarks.md says where it comes from); running without it",
              file=sys.stderr)
        targets_wanted.remove(EPD_PROXY)

    workdir = Path(tempfile.mkdtemp(prefix="epd-bench-"))
    fleet = Fleet(workdir)
    started = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    try:
        prefill, prefill_pid = fleet.sim("prefill")
        decode, decode_pid = fleet.sim("decode")
        # Sims in separate processes share no embedding store, so the encoders answer as
        # vLLM's LLaVA does (empty metadata): items stay media, keyed, for the next stage.
        encoders = [fleet.sim("encode", "--ec-metadata", "empty") for _ in range(ENCODERS)]
        sims = [prefill_pid, decode_pid, *(pid for _, pid in encoders)]
        roster = workdir / "roster.yaml"
        roster.write_text(
            "settings: {connector: nixl}\ninstances:\n"
            + "".join(f"  - {{role: encode, url: \"{url}\"}}\n" for url, _ in encoders)
            + f"  - {{role: prefill, url: \"{prefill}\"}}\n"
            f"  - {{role: decode, url: \"{decode}\"}}\n")
        targets: list[Target] = []
        stall_flag, stall_log = workdir / "stall-probe-on", workdir / "stalls.log"
        if "direct" in targets_wanted:
            targets.append(Target("direct", decode, []))
        def epd_flask(name: str, env: dict[str, str] | None = None,
                      roster: Path = roster) -> None:
            port = free_port()
            proc = fleet.spawn(name, [str(BIN / "gunicorn"), "-c", str(GUNICORN_CONF),
                                      "wsgi:app"], env={
                "EPD_WORKERS": "1", "EPD_BIND": f"127.0.0.1:{port}", "EPD_ROSTER": str(roster),
                "EPD_BENCH_STALL_FLAG": str(stall_flag),
                "EPD_BENCH_STALL_LOG": str(stall_log), **(env or {})})
            url = f"http://127.0.0.1:{port}"
            wait_up(url + "/ready", proc)
            targets.append(Target(name, url, [proc.pid]))

        if "epd-flask" in targets_wanted:
            epd_flask("epd-flask")
        sink = ""
        if args.tracing:
            # The collector runs in a process of its own: its CPU is not the proxy's. The
            # default sampler records every request (none carries a traceparent).
            port = free_port()
            proc = fleet.spawn("otlp-sink", [sys.executable, str(OTLP_SINK), str(port)])
            sink = f"http://127.0.0.1:{port}"
            wait_up(sink + "/count", proc)
            epd_flask(TRACED, {"OTEL_EXPORTER_OTLP_ENDPOINT": sink})
        if args.admission:
            admitted = workdir / "roster-admission.yaml"
            admitted.write_text(
                "settings: {connector: nixl, admission: {tenant_header: X-Tenant}}\n"
                "tenants: {chat: {weight: 4, priority: high}, batch: {priority: low}}\n"
                "instances:\n"
                + "".join(f"  - {{role: encode, url: \"{url}\"}}\n" for url, _ in encoders)
                + f"  - {{role: prefill, url: \"{prefill}\", max_concurrency: {ADMITTED_SEATS}}}\n"
                f"  - {{role: decode, url: \"{decode}\", max_concurrency: {ADMITTED_SEATS}}}\n")
            epd_flask(ADMITTED, roster=admitted)
        if "vllm-router" in targets_wanted:
            port = free_port()
            proc = fleet.spawn("vllm-router", [
                args.router, "--vllm-pd-disaggregation", "--prefill", prefill,
                "--decode", decode, "--policy", "round_robin", "--kv-connector", "nixl",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
            url = f"http://127.0.0.1:{port}"
            wait_up(url + "/health", proc)
            targets.append(Target("vllm-router", url, [proc.pid]))
        if EPD_PROXY in targets_wanted:
            port = free_port()
            peer = workdir / "disagg_epd_proxy.py"  # the run's own copy, deleted with workdir
            shutil.copyfile(args.epd_proxy, peer)
            proc = fleet.spawn(EPD_PROXY, [
                args.epd_proxy_python, str(peer), "--host", "127.0.0.1", "--port", str(port),
                "--encode-servers-urls", ",".join(url for url, _ in encoders),
                "--prefill-servers-urls", prefill, "--decode-servers-urls", decode])
            url = f"http://127.0.0.1:{port}"
            wait_up(url + "/health", proc)
            targets.append(Target(EPD_PROXY, url, [proc.pid]))
        workloads = build_workloads(args.quick, workdir)
        only = set(filter(None, args.only.split(",")))
        results: list[dict[str, Any]] = []
        for wl in workloads:
            if only and wl.name not in only:
                continue
            for url in (prefill, decode):
                configure(url, wl.sim)
            for i, (url, _) in enumerate(encoders):
                configure(url, {"ttft": 0.0, **(wl.encoders[i] if wl.encoders else {})})
            runs: dict[str, list[dict[str, Any]]] = {
                t.name: [] for t in targets if not (wl.media and t.name == EPD_PROXY)}
            for rep in range(args.repeats or wl.repeats):
                # Every other repeat runs the targets in reverse, so each leads as often as
                # it follows (the cheap workloads repeat an even number of times): always
                # second, admission's a32 measured 1.15x its peer in six repeats; alternating,
                # 0.96x in the next six.
                for target in (targets if rep % 2 == 0 else targets[::-1]):
                    if wl.media and target.name == EPD_PROXY:
                        continue
                    prof = (Path(args.profile) / f"{target.name}-{wl.name}-{rep + 1}.txt"
                            if args.profile and target.name in ("epd-flask", TRACED, ADMITTED)
                            else None)
                    probe = wl.stall_probe is not None and target.name in ("epd-flask", TRACED,
                                                                            ADMITTED)
                    if probe:
                        stall_flag.touch()
                        time.sleep(0.3)  # the probe notices the flag
                    started_at = time.time()
                    run = measure(target, sims, wl, prof)
                    if probe:
                        stall_flag.unlink()
                        run["stalls_ms"] = read_stalls(stall_log,
                                                       started_at + (wl.stall_probe or 0.0))
                    runs[target.name].append(run)
                    print(report.progress_line(wl.name, rep, run), file=sys.stderr, flush=True)
            results.append({"workload": wl.name, "what": wl.what, "runs": runs})
        finished = datetime.datetime.now(datetime.timezone.utc)
        meta = {"started": started.isoformat(timespec="seconds"),
                "finished": finished.isoformat(timespec="seconds"), "machine": info,
                "load_after": os.getloadavg(),
                "router_version": router_version(args.router) if args.router else None,
                "epd_proxy": (peer_version(args.epd_proxy_python)
                              if EPD_PROXY in targets_wanted else None),
                "tracing": spans_received(sink) if sink else None,
                "command": report.recorded_command(
                    ".venv/bin/python tests/bench/run.py",
                    sys.argv[1:] if argv is None else list(argv))}
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "results": results}))
        text = report.render(meta, results)
        print(text)
        if args.report:
            report.write_section(Path(args.report), LABEL, text)
    except BaseException:
        fleet.stop()
        print(f"benchmark failed; process logs kept in {workdir}", file=sys.stderr)
        raise
    fleet.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
