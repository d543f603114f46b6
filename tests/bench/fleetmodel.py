"""The fleet benchmark's prefill stage as arithmetic: many traces in seconds, no processes.

``fleet.py`` runs one trace per scenario through real processes, and a p99 over a few hundred
requests is the third-slowest of them: one trace cannot say whether a policy's tail is worse
than round_robin's or the trace was unlucky. This replays many seeds through the *same*
decisions epd-flask makes (``fleet.routing.Router.pick`` over a ``LiveFleet`` with the roster's
defaults, the load being the prefill requests in flight per instance and their estimated
prompt tokens, as one worker counts them) and the sim's
cost model (``sim.costmodel.EngineClock``: a prefill waits for the uncached tokens queued
before it; ``sim.kvcache.PrefixCache`` per instance), and prints each policy's TTFT p50 and p99
against round_robin's on the same trace, and how often p99 is over the 80 % target's 1.10x.
A last row, ``ideal``, is no router's: each request goes where it would finish first,
knowing every instance's cache and queue exactly; it bounds what routing alone can win.
What it leaves out: the proxy's and the sims' own CPU time and the decode stage (a TTFT here
is the prefill's wait and work plus one decode step), and kv_aware (its picture comes from
the sims' events). On seed 14 it comes within a few percent of what the bench measures (see
docs/benchmarks.md).

    python tests/bench/fleetmodel.py --seeds 30 --utilisation 0.8 [--report docs/benchmarks.md]

``--report`` replaces the page's ``fleetmodel-loaded`` block (``fleetmodel-light`` with
``--utilisation 0``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chattrace
import fleet
import report

from epd_flask.control.roster import Instance, Roster, Settings
from epd_flask.fleet import affinity, routing
from epd_flask.fleet.live import LiveFleet
from epd_flask.sim.costmodel import EngineClock
from epd_flask.sim.kvcache import PrefixCache

POLICIES = ("round_robin", "least_loaded", "prefix", "session", "ideal")


def replay(trace: list[dict[str, Any]], policy: str, rate: float,
           instances: int = fleet.INSTANCES) -> dict[str, Any]:
    """TTFTs (s) and prefill tokens computed when ``trace``'s prompts are routed by
    ``policy`` to ``instances`` prefills computing ``rate`` tokens/s each."""
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(instances)]
    insts = [Instance(role="prefill", url=u) for u in urls]
    routed = {"prefill": policy} if policy != "ideal" else {}
    live = LiveFleet(Roster(settings=Settings(routing=routed), instances=tuple(insts)))
    registry = live.registry
    router = routing.Router(live, seed=0)
    caches = {u: PrefixCache(capacity=int(fleet.FIGURES["kv_cache_blocks"])) for u in urls}
    clocks = {u: EngineClock() for u in urls}
    running: list[tuple[float, str, int]] = []
    ttfts, computed = [], 0
    step = float(fleet.FIGURES["token_delay"])
    for item, prompts in zip(trace, fleet._prompts(trace), strict=True):
        now = item["t"]
        for _done, url, estimate in [r for r in running if r[0] <= now]:
            registry.track(url, -1, tokens=estimate)
        running = [r for r in running if r[0] > now]
        prompt, tokens = prompts[0]
        request = affinity.route_request(item["body"])
        if policy == "ideal":
            url = min(urls, key=lambda u: (max(now, clocks[u].busy_until) + (
                tokens - copy.deepcopy(caches[u]).lookup_and_insert(prompt, tokens)) / rate))
        else:
            url = router.pick("prefill", request, lambda role, decision: None).url
        work = tokens - caches[url].lookup_and_insert(prompt, tokens)
        computed += work
        ttft = clocks[url].prefill(work, rate, now) + step
        registry.track(url, +1, tokens=request.prompt_tokens)
        running.append((now + ttft, url, request.prompt_tokens))
        ttfts.append(ttft)
    return {"ttfts": ttfts, "computed": computed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=30, help="how many traces")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=25.0)
    p.add_argument("--rate", type=float, default=4.0, help="new sessions per second")
    p.add_argument("--utilisation", type=float, default=fleet.UTILISATION,
                   help="round_robin's share of the prefill capacity; 0: FIGURES as they are")
    p.add_argument("--report", default="",
                   help="markdown file whose fleetmodel block the table replaces")
    args = p.parse_args(argv)
    started, info = report.now(), report.machine()
    ratios: dict[str, list[tuple[float, float, float]]] = {pol: [] for pol in POLICIES}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        trace = chattrace.generate(chattrace.TraceSpec(seed=seed, duration=args.duration,
                                                       rate=args.rate))
        _, oracle = fleet.oracle_computed(trace)
        rate = float(fleet.FIGURES["prefill_tokens_per_s"]) if not args.utilisation else \
            fleet.loaded_figures(fleet.FIGURES, fleet.round_robin_computed(trace),
                                 args.duration, args.utilisation)["prefill_tokens_per_s"]
        base = None
        for pol in POLICIES:
            out = replay(trace, pol, rate)
            p50 = fleet.pct(out["ttfts"], 0.5) or 0.0
            p99 = fleet.pct(out["ttfts"], 0.99) or 0.0
            if base is None:
                base = (p50, p99)
            ratios[pol].append((p50 / base[0], p99 / base[1], out["computed"] / oracle))
    seeds = f"{args.seeds} traces (seeds {args.first_seed}-{args.first_seed + args.seeds - 1})"
    lines = [f"{seeds} of {args.duration:g} s at {args.rate:g} sessions/s, round_robin at "
             f"{args.utilisation:.0%} of the prefill capacity:" if args.utilisation
             else f"{seeds} of {args.duration:g} s at {args.rate:g} sessions/s, the cost "
             "model's figures as they are:", "",
             "| policy | TTFT p50 / round_robin (mean) | TTFT p99 / round_robin (mean, max) "
             "| traces with p99 > 1.10x | computed / oracle (mean) |",
             "|---|---|---|---|---|"]
    for pol, values in ratios.items():
        p50s, p99s, work = zip(*values, strict=True)
        lines.append(f"| {pol} | {statistics.mean(p50s):.2f} | {statistics.mean(p99s):.2f}, "
                     f"{max(p99s):.2f} | {sum(x > 1.10 for x in p99s)}/{len(p99s)} | "
                     f"{statistics.mean(work):.2f} |")
    print("\n".join(lines))
    if args.report:
        command = report.recorded_command(".venv/bin/python tests/bench/fleetmodel.py",
                                          sys.argv[1:] if argv is None else list(argv))
        label = "fleetmodel-loaded" if args.utilisation else "fleetmodel-light"
        report.write_section(Path(args.report), label,
                             "\n".join([report.stamp(started, info, command), *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
