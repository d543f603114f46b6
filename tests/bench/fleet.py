"""``make bench-fleet``: routing policies judged on a simulated fleet with a cost model.

Starts 4 prefill + 4 decode simulated instances (and, for the combined variant, 4
prefill_decode), each with the cost model of ``epd_flask/sim/costmodel.py`` set to figures for
an 8B model on one H100 (FIGURES; sources in docs/benchmarks.md), and replays one generated
trace of multi-turn chat sessions (chattrace.py) through every target in turn: epd-flask with
each policy (1 worker; with 2 workers; 2 processes behind a round-robin front), and
vllm-router with round_robin, power_of_two and cache_aware. Before each target the sims are
reset (counters, prefix caches, engine clocks), so every target starts cold on the same trace.
Reports TTFT p50/p99, inter-token p99, completed, prefill tokens computed and served from
cache (the sims' counters) against an oracle with one infinite cache, and load imbalance
(the busiest prefill's share over the mean). Bounded: the trace lasts ``--duration`` seconds
and every request has a timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chattrace
import report
from run import (
    BIN,
    GUNICORN_CONF,
    ROOT,
    Fleet,
    configure,
    free_port,
    machine,
    router_version,
    wait_up,
)

from epd_flask.sim import validate
from epd_flask.sim.kvcache import PrefixCache

REPLAY = Path(__file__).resolve().parent / "replay.py"
INSTANCES = 4
#: An 8B model (Llama 3.1 8B, bf16) on one H100 80GB; see docs/benchmarks.md for sources.
FIGURES = {
    "prefill_tokens_per_s": 15000.0,   # prefill throughput, tokens/s
    "token_delay": 0.008,              # inter-token time at batch 1, s
    "token_delay_per_stream": 0.00015,  # added per other running stream, s
    "kv_cache_blocks": 28000,          # ~450k tokens of KV in ~56 GB
    "ttft": 0.0,
}
MAX_MODEL_LEN = 32768


@dataclass
class Variant:
    name: str
    kind: str  # "epd" or "router"
    combined: bool = False
    routing: dict[str, str] | None = None
    extra: dict[str, Any] | None = None
    workers: int = 1
    processes: int = 1
    router_args: tuple[str, ...] = ()


def variants(include_router: bool) -> list[Variant]:
    out = [
        Variant("epd round_robin", "epd", routing={}),
        Variant("epd least_loaded", "epd",
                routing={"prefill": "least_loaded", "decode": "least_loaded"}),
        Variant("epd prefix", "epd", routing={"prefill": "prefix", "decode": "least_loaded"}),
        Variant("epd session", "epd", routing={"prefill": "session", "decode": "least_loaded"}),
        Variant("epd prefix, 2 workers", "epd", workers=2,
                routing={"prefill": "prefix", "decode": "least_loaded"}),
        Variant("epd prefix, 2 hosts x 2 workers", "epd", workers=2, processes=2,
                routing={"prefill": "prefix", "decode": "least_loaded"}),
        Variant("epd round_robin (PD)", "epd", combined=True, routing={}),
        Variant("epd prefix (PD)", "epd", combined=True, routing={"prefill_decode": "prefix"}),
    ]
    if include_router:
        for policy in ("round_robin", "power_of_two", "cache_aware"):
            out.append(Variant(f"vllm-router {policy}", "router",
                               router_args=("--policy", policy)))
        out.append(Variant("vllm-router cache_aware (PD)", "router", combined=True,
                           router_args=("--policy", "cache_aware")))
    return out


def post(url: str, path: str) -> None:
    req = urllib.request.Request(url + path, data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5):
        pass


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as resp:
        return json.loads(resp.read())


def oracle_computed(trace: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, tokens an oracle computes): one infinite cache seeing every prompt in
    order, as if every request went where its longest prefix is."""
    cache = PrefixCache(capacity=1 << 30)
    total = computed = 0
    for item in trace:
        req = validate.parse_request("/v1/chat/completions", item["body"], "tiny-llama",
                                     MAX_MODEL_LEN)
        for prompt, tokens in zip(req.prompts, req.prompt_tokens, strict=True):
            total += tokens
            computed += tokens - cache.lookup_and_insert(prompt, tokens)
    return total, computed


def replay(urls: list[str], trace: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    spec = {"urls": urls, "trace": trace, "timeout": timeout,
            "deadline": trace[-1]["t"] + 1.0 if trace else 0}
    proc = subprocess.run([sys.executable, str(REPLAY)], input=json.dumps(spec).encode(),
                          capture_output=True, timeout=trace[-1]["t"] + timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"replay failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(proc.stdout)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(name: str, result: dict[str, Any], prefill_stats: list[dict[str, Any]],
              oracle: int) -> dict[str, Any]:
    reqs = result["requests"]
    ok = [r for r in reqs if r["ok"]]
    gaps = [g for r in ok for g in r.get("gaps", [])]
    computed = sum(s.get("prefix_computed_tokens", 0) for s in prefill_stats)
    cached = sum(s.get("prefix_cached_tokens", 0) for s in prefill_stats)
    served = [s.get("completions", 0) for s in prefill_stats]
    mean = statistics.mean(served) if served else 0
    return {
        "target": name, "sent": len(reqs), "completed": len(ok),
        "errors": sorted({r.get("error", "")[:120] for r in reqs if not r["ok"]})[:3],
        "ttft_p50": pct([r["ttft"] for r in ok], 0.5),
        "ttft_p99": pct([r["ttft"] for r in ok], 0.99),
        "itl_p99": pct(gaps, 0.99),
        "computed": computed, "cached": cached,
        "vs_oracle": computed / oracle if oracle else None,
        "imbalance": max(served) / mean if mean else None,
        "per_instance": served,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Run {meta['started']} - {meta['finished']} on {meta['machine']['nproc']} CPUs "
        f"({meta['machine']['cpu']}), load average before {meta['machine']['load_before']}, "
        f"after {meta['load_after']}. Trace: {meta['requests']} requests "
        f"({meta['sessions']} sessions, seed {meta['seed']}, {meta['duration']:g} s, "
        f"{meta['rate']:g} sessions/s), {meta['prompt_tokens']} prompt tokens, an oracle "
        f"with one infinite cache computes {meta['oracle']} of them. vllm-router: "
        f"{meta['router_version'] or 'not run'}. Cost model: {meta['figures']}.",
        "",
        "| target | completed | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | prefill tokens "
        "computed | cached | computed / oracle | imbalance (max/mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['completed']}/{r['sent']} | {_ms(r['ttft_p50'])} | "
            f"{_ms(r['ttft_p99'])} | {_ms(r['itl_p99'])} | {r['computed']} | {r['cached']} | "
            f"{_ratio(r['vs_oracle'])} | {_ratio(r['imbalance'])} |")
    errors = [(r["target"], r["errors"]) for r in rows if r["errors"]]
    if errors:
        lines += ["", "Errors: " + "; ".join(f"{t}: {e}" for t, e in errors)]
    lines.append("")
    return "\n".join(lines)


def roster_text(prefills: list[str], decodes: list[str], combined: list[str],
                variant: Variant) -> str:
    routing = json.dumps(variant.routing or {})
    extra = "".join(f", {k}: {json.dumps(v)}" for k, v in (variant.extra or {}).items())
    lines = [f"settings: {{connector: nixl, routing: {routing}{extra}}}", "instances:"]
    if variant.combined:
        lines += [f"  - {{role: prefill_decode, url: \"{u}\"}}" for u in combined]
    else:
        lines += [f"  - {{role: prefill, url: \"{u}\"}}" for u in prefills]
        lines += [f"  - {{role: decode, url: \"{u}\"}}" for u in decodes]
    return "\n".join(lines) + "\n"


def start_epd(fleet: Fleet, variant: Variant, roster: Path) -> list[str]:
    urls = []
    for _ in range(variant.processes):
        port = free_port()
        proc = fleet.spawn(f"epd-{port}", [str(BIN / "gunicorn"), "-c", str(GUNICORN_CONF),
                                           "wsgi:app"], env={
            "EPD_WORKERS": str(variant.workers), "EPD_BIND": f"127.0.0.1:{port}",
            "EPD_ROSTER": str(roster), "EPD_LOG_LEVEL": "warning"})
        url = f"http://127.0.0.1:{port}"
        wait_up(url + "/ready", proc)
        urls.append(url)
    return urls


def start_router(fleet: Fleet, router: str, variant: Variant, prefills: list[str],
                 decodes: list[str], combined: list[str]) -> list[str]:
    port = free_port()
    argv = [router, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *variant.router_args]
    if variant.combined:
        argv += ["--worker-urls", *combined]
    else:
        argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for u in prefills:
            argv += ["--prefill", u]
        for u in decodes:
            argv += ["--decode", u]
    proc = fleet.spawn(f"router-{port}", argv)
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health", proc)
    return [url]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--router", default="", help="vllm-router executable (bench venv)")
    p.add_argument("--duration", type=float, default=15.0, help="trace length, seconds")
    p.add_argument("--rate", type=float, default=3.0, help="new sessions per second")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--only", default="", help="comma-separated substrings of target names")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--report", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--label", default="fleet", help="name of the report section")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)

    spec = chattrace.TraceSpec(seed=args.seed, duration=args.duration, rate=args.rate)
    trace = chattrace.generate(spec)
    total, oracle = oracle_computed(trace)
    include_router = bool(args.router and Path(args.router).exists())
    if not include_router:
        print("vllm-router not found (make bench-fleet installs it); running without it",
              file=sys.stderr)
    chosen = [v for v in variants(include_router)
              if not args.only or any(s in v.name for s in args.only.split(","))]
    workdir = Path(tempfile.mkdtemp(prefix="epd-bench-fleet-"))
    fleet = Fleet(workdir)
    started = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    rows = []
    try:
        def sims(role: str) -> list[str]:
            urls = [fleet.sim(role, "--prompt-tokens-details", "--max-model-len",
                              str(MAX_MODEL_LEN))[0] for _ in range(INSTANCES)]
            for url in urls:
                configure(url, FIGURES)
            return urls
        prefills, decodes = sims("prefill"), sims("decode")
        combined = sims("prefill_decode") if any(v.combined for v in chosen) else []
        for variant in chosen:
            runners = Fleet(workdir)
            try:
                roster = workdir / f"roster-{len(rows)}.yaml"
                roster.write_text(roster_text(prefills, decodes, combined, variant))
                urls = (start_epd(runners, variant, roster) if variant.kind == "epd"
                        else start_router(runners, args.router, variant, prefills, decodes,
                                          combined))
                time.sleep(0.5)  # first probes
                for url in prefills + decodes + combined:
                    post(url, "/sim/reset")
                result = replay(urls, trace, args.timeout)
                computing = combined if variant.combined else prefills
                row = summarize(variant.name, result, [stats(u) for u in computing], oracle)
            finally:
                runners.stop()
            rows.append(row)
            print(f"{row['target']}: {row['completed']}/{row['sent']} ok, TTFT p50 "
                  f"{_ms(row['ttft_p50'])} ms p99 {_ms(row['ttft_p99'])} ms, computed "
                  f"{row['computed']} cached {row['cached']}", file=sys.stderr, flush=True)
        finished = datetime.datetime.now(datetime.timezone.utc)
        meta = {"started": started.isoformat(timespec="seconds"),
                "finished": finished.isoformat(timespec="seconds"), "machine": info,
                "load_after": os.getloadavg(), "requests": len(trace),
                "sessions": len({r["session"] for r in trace}), "seed": args.seed,
                "duration": args.duration, "rate": args.rate, "prompt_tokens": total,
                "oracle": oracle, "figures": FIGURES,
                "router_version": router_version(args.router) if include_router else None}
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}))
        text = render(meta, rows)
        print(text)
        if args.report:
            report.write_section(Path(args.report), args.label, text)
    except BaseException:
        fleet.stop()
        print(f"benchmark failed; process logs kept in {workdir}", file=sys.stderr)
        raise
    fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
