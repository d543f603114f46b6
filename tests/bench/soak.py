"""``make soak``: the proxy as shipped, for minutes, under a steady mixed load with abandoned
streams, roster reloads and admin changes; what a day in production does to a worker.

Starts simulated instances (two encoders, two prefills, two decodes) and epd-flask under
gunicorn (2 gevent workers, admin API on, log level info, metrics on), then for ``--seconds``:
- an open-loop load of ``--rate`` requests per second (chat, completions and multimodal, each
  streamed or not), a share ``--abandon`` of the streams hung up after their first event;
- a SIGHUP every ``--hup-every`` seconds, after an edit of the roster (the decode policy
  alternates between round_robin and least_loaded, so every reload changes something);
- an admin registration and removal (``POST``/``DELETE /instances``) every ``--admin-every``
  seconds, which must always be answered 2xx;
- ``GET /health`` once a second, its latency kept;
- every worker's RSS and open file descriptors, sampled every ten seconds.
Afterwards every decode must be idle again (no upstream work left for a client that went),
and the gunicorn log is searched for errors and tracebacks.

``--proxy-root`` may be given several times (a checkout and the Python that runs it,
``--proxy-root DIR:PYTHON``): each is soaked in turn against the same fleet and the table
puts them side by side, so a change is compared with what it changed in one run. Bounded:
every request has a timeout, the load stops at ``--seconds``, at most ``MAX_OPEN`` requests
are open at once.

    python tests/bench/soak.py --seconds 600 --rate 29 [--report]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import gevent.pool
import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

from tests.chaos.harness import KINDS, Outcome, request_for, send_one  # noqa: E402
from tests.e2e.conftest import Process  # noqa: E402
from tests.helpers import eventually, free_port  # noqa: E402
from tests.rosters import roster  # noqa: E402

#: The most requests the load keeps open at once: past it an arrival is counted as not sent.
MAX_OPEN = 400
ADMIN_KEY = "soak-admin-key"
SAMPLE_EVERY = 10.0
IDLE_WAIT = 45.0


@dataclass
class Target:
    root: Path
    python: str
    label: str


@dataclass
class Soak:
    target: Target
    outcomes: list[Outcome] = field(default_factory=list)
    abandoned: int = 0
    abandoned_cut: int = 0
    not_sent: int = 0
    health_ms: list[float] = field(default_factory=list)
    health_failed: int = 0
    admin: list[int] = field(default_factory=list)
    reloads: int = 0
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (t, newest worker max)
    fds: list[tuple[float, int]] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    decode_busy_after: int = 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def abandon_one(session: requests.Session, base: str, kind: str, n: int) -> bool:
    """A stream whose client reads its first event and hangs up; True when it got one."""
    path, body = request_for(kind, n)
    body["stream"] = True
    try:
        with session.post(base + path, json=body, stream=True, timeout=30,
                          headers={"X-Request-Id": f"soak-gone-{n}"}) as resp:
            for piece in resp.iter_content(None):
                if piece:
                    return True
    except (requests.RequestException, OSError):
        return False
    return False


class Run:
    def __init__(self, target: Target, sims: dict[str, list[str]], args: argparse.Namespace,
                 work: Path) -> None:
        self.target = target
        self.args = args
        self.work = work
        self.sims = sims
        self.result = Soak(target)
        self.roster_file = work / f"roster-{target.label}.yaml"
        self.policy = "round_robin"
        self.write_roster()
        port = free_port()
        self.gateway = Process(
            [target.python, "-m", "gunicorn", "-c", "etc/gunicorn.conf.py", "wsgi:app"],
            f"http://127.0.0.1:{port}", cwd=target.root,
            log=work / f"gunicorn-{target.label}.log",
            env={"EPD_ROSTER": str(self.roster_file), "PORT": str(port),
                 "EPD_WORKERS": str(args.workers), "ADMIN_API_KEY": ADMIN_KEY,
                 "EPD_LOG_LEVEL": "info",
                 "EPD_STATE_DIR": str(work / f"state-{target.label}")})

    def write_roster(self) -> None:
        doc = roster(self.sims["prefill"], self.sims["decode"], encoders=self.sims["encode"],
                     routing={"decode": self.policy, "prefill": "prefix"})
        tmp = self.roster_file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc))
        os.replace(tmp, self.roster_file)

    # -- the loops ---------------------------------------------------------------------------

    def load(self, until: float) -> None:
        pool = gevent.pool.Pool(MAX_OPEN)
        interval = 1.0 / self.args.rate
        rng = random.Random(7)
        n = 0
        next_at = time.monotonic()
        with requests.Session() as session:
            session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=MAX_OPEN))
            while time.monotonic() < until:
                n += 1
                kind = KINDS[n % len(KINDS)]
                if pool.full():
                    self.result.not_sent += 1
                elif kind.endswith("stream") and rng.random() < self.args.abandon:
                    pool.spawn(self._abandon, session, kind, n)
                else:
                    pool.spawn(self._send, session, kind, n)
                next_at += interval
                gevent.sleep(max(0.0, next_at - time.monotonic()))
            pool.join(timeout=40)

    def _send(self, session: requests.Session, kind: str, n: int) -> None:
        self.result.outcomes.append(send_one(session, self.gateway.url, kind, n))

    def _abandon(self, session: requests.Session, kind: str, n: int) -> None:
        self.result.abandoned += 1
        if abandon_one(session, self.gateway.url, kind, n):
            self.result.abandoned_cut += 1

    def reloads(self, until: float) -> None:
        while True:
            gevent.sleep(self.args.hup_every)
            if time.monotonic() >= until:
                return
            self.policy = "least_loaded" if self.policy == "round_robin" else "round_robin"
            self.write_roster()
            os.kill(self.gateway.proc.pid, signal.SIGHUP)
            self.result.reloads += 1

    def admin(self, until: float) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        spare = f"http://127.0.0.1:{free_port()}"  # nobody listens: probes evict it meanwhile
        while True:
            gevent.sleep(self.args.admin_every)
            if time.monotonic() >= until:
                return
            for method, kwargs in (("POST", {"json": {"role": "decode", "url": spare}}),
                                   ("DELETE", {"params": {"url": spare}})):
                try:
                    r = requests.request(method, self.gateway.url + "/instances",
                                         headers=headers, timeout=30, **kwargs)
                    self.result.admin.append(r.status_code)
                except requests.RequestException:
                    self.result.admin.append(0)

    def health(self, until: float) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                ok = requests.get(self.gateway.url + "/health", timeout=10).status_code == 200
            except requests.RequestException:
                ok = False
            if ok:
                self.result.health_ms.append((time.monotonic() - started) * 1000)
            else:
                self.result.health_failed += 1
            gevent.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    def samples(self, until: float) -> None:
        start = time.monotonic()
        while time.monotonic() < until:
            workers = sorted(self.gateway.workers())
            if workers:
                self.result.rss_mb.append((time.monotonic() - start,
                                           max(rss_mb(p) for p in workers)))
                self.result.fds.append((time.monotonic() - start,
                                        sum(fd_count(p) for p in
                                            [self.gateway.proc.pid, *workers])))
            gevent.sleep(SAMPLE_EVERY)

    # -- one soak ----------------------------------------------------------------------------

    def run(self, decodes: list[str]) -> Soak:
        self.gateway.wait_up("/ready")
        until = time.monotonic() + self.args.seconds
        jobs = [gevent.spawn(f, until) for f in (self.reloads, self.admin, self.health,
                                                 self.samples)]
        self.load(until)
        gevent.joinall(jobs, timeout=self.args.hup_every + 40)
        gevent.killall(jobs)

        def idle() -> bool:
            return all(requests.get(d + "/sim/stats", timeout=5).json()["in_flight"] == 0
                       for d in decodes)
        with contextlib.suppress(AssertionError):
            eventually(idle, IDLE_WAIT, interval=0.5)
        self.result.decode_busy_after = sum(
            requests.get(d + "/sim/stats", timeout=5).json()["in_flight"] for d in decodes)
        self.gateway.stop()
        log = (self.work / f"gunicorn-{self.target.label}.log").read_text(errors="replace")
        self.result.log_errors = [line for line in log.splitlines()
                                  if "[ERROR]" in line or "Traceback" in line
                                  or "stayed locked" in line]
        return self.result


def start_sims(work: Path) -> tuple[dict[str, list[str]], list[Process]]:
    plan = {"encode": ["--ec-metadata", "empty", "--ttft-ms", "20"],
            "prefill": ["--ttft-ms", "30"],
            "decode": ["--token-delay-ms", "15", "--output-tokens", "40"]}
    urls: dict[str, list[str]] = {}
    procs = []
    for role, extra in plan.items():
        for _ in range(2):
            port = free_port()
            p = Process([sys.executable, "-m", "epd_flask.sim.cli", "--role", role, "--port",
                         str(port), "--record-limit", "1000", *extra],
                        f"http://127.0.0.1:{port}", log=work / f"sim-{role}-{port}.log")
            p.wait_up()
            procs.append(p)
            urls.setdefault(role, []).append(p.url)
    return urls, procs


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def render(soaks: list[Soak], args: argparse.Namespace) -> str:
    rows = [
        ("requests sent", lambda s: len(s.outcomes) + s.abandoned),
        ("answered completely", lambda s: sum(o.result == "succeeded" for o in s.outcomes)),
        ("clean errors (OpenAI shape)", lambda s: sum(o.result == "failed" for o in s.outcomes)),
        ("lost (cut, reset, no answer)", lambda s: sum(o.result == "lost" for o in s.outcomes)),
        ("streams abandoned by their client", lambda s: s.abandoned),
        ("arrivals not sent (load generator full)", lambda s: s.not_sent),
        ("reloads (SIGHUP)", lambda s: s.reloads),
        ("admin calls / answered 2xx",
         lambda s: f"{len(s.admin)} / {sum(200 <= c < 300 for c in s.admin)}"),
        ("/health p50 / p99 / max (ms)",
         lambda s: f"{pct(s.health_ms, .5):.1f} / {pct(s.health_ms, .99):.1f} / "
                   f"{max(s.health_ms, default=float('nan')):.1f}"),
        ("/health unanswered", lambda s: s.health_failed),
        ("worker RSS first / last / max (MB)",
         lambda s: f"{s.rss_mb[0][1]:.0f} / {s.rss_mb[-1][1]:.0f} / "
                   f"{max(v for _, v in s.rss_mb):.0f}" if s.rss_mb else "-"),
        ("open fds first / last / max (master + workers)",
         lambda s: f"{s.fds[0][1]} / {s.fds[-1][1]} / {max(v for _, v in s.fds)}"
         if s.fds else "-"),
        ("decode calls still open 45 s after the load", lambda s: s.decode_busy_after),
        ("ERROR lines or tracebacks in the log", lambda s: len(s.log_errors)),
    ]
    head = "| | " + " | ".join(s.target.label for s in soaks) + " |\n"
    head += "|---|" + "---:|" * len(soaks) + "\n"
    body = "".join(f"| {name} | " + " | ".join(str(f(s)) for s in soaks) + " |\n"
                   for name, f in rows)
    errors = ""
    for s in soaks:
        if s.log_errors:
            shown = "\n".join(f"    {line[:200]}" for line in s.log_errors[:5])
            errors += f"\nFirst log errors of {s.target.label}:\n\n{shown}\n"
    return (f"{args.seconds:.0f} s at {args.rate:g} requests/s, {args.abandon:.0%} of streams "
            f"abandoned after their first event, a SIGHUP every {args.hup_every:g} s, an "
            f"admin registration and removal every {args.admin_every:g} s, "
            f"{args.workers} workers.\n\n" + head + body + errors)


def target(spec: str) -> Target:
    root, _, python = spec.partition(":")
    path = Path(root).resolve()
    return Target(path, python or sys.executable, report.code_version(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--rate", type=float, default=29.0)
    p.add_argument("--abandon", type=float, default=0.1)
    p.add_argument("--hup-every", type=float, default=60.0)
    p.add_argument("--admin-every", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--proxy-root", action="append", default=[],
                   help="DIR[:PYTHON]: a checkout to soak (repeatable; default this one)")
    p.add_argument("--report", nargs="?", const=str(ROOT / "docs" / "benchmarks.md"),
                   help="write the soak block of this page (default docs/benchmarks.md)")
    args = p.parse_args(argv)
    targets = [target(s) for s in args.proxy_root] or [target(str(ROOT))]
    started, info = report.now(), report.machine()
    soaks = []
    with tempfile.TemporaryDirectory(prefix="epd-soak-") as tmp:
        work = Path(tmp)
        urls, sims = start_sims(work)
        try:
            for t in targets:
                print(f"soaking {t.label} ({t.root}) for {args.seconds:.0f} s", flush=True)
                soaks.append(Run(t, urls, args, work).run(urls["decode"]))
        finally:
            for s in sims:
                s.stop()
    text = render(soaks, args)
    print(text)
    if args.report:
        command = report.recorded_command("python tests/bench/soak.py", argv or sys.argv[1:])
        report.write_section(Path(args.report), "soak",
                             report.stamp(started, info, command) + "\n" + text)
    return 0 if all(not s.log_errors for s in soaks) else 1


if __name__ == "__main__":
    sys.exit(main())
