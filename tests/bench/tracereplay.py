"""``make bench-fleet``'s production trace: a Mooncake-format trace (mooncaketrace.py) replayed
through every epd-flask policy, vllm-router's policies and an oracle, on the same simulated
fleet as the chat scenarios (fleet.py), at the load point where round_robin's computed prefill
tokens are ``fleet.UTILISATION`` of the fleet's capacity.

The simulator's costs are published GPU figures (``FIGURES``, sources in docs/benchmarks.md)
run faster or slower by one factor, the same for prefill and decode (a time-lapse of that GPU),
chosen so round_robin's work over the replay's span is the load point. ``oracle`` is epd-flask
with tests/bench/oracle.py's policy for both roles: each choice asks the simulators what they
hold and have queued, so its TTFT is a measured bound for routing on this fleet and trace.
Rows are written as a table into the ``fleet-trace`` block of docs/benchmarks.md and, with
``--bench-json``, as a JSON list (``JSON_KEYS``).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet
import mooncaketrace
import procstat
from run import Fleet, configure, machine, router_version

from epd_flask.sim import textgen
from epd_flask.sim.kvcache import PrefixCache, block_hashes

#: Llama 3.1 8B Instruct (FP8) on one H200 with vLLM, as NVIDIA's Dynamo profiled it
#: (docs/benchmarks.md cites where): prefill throughput, inter-token time of a lone stream and
#: what each other running stream adds, and the prefix cache's blocks of 16 tokens.
FIGURES = {
    "prefill_tokens_per_s": 110000.0,
    "token_delay": 0.0034,
    "token_delay_per_stream": 0.000064,
    "kv_cache_blocks": 58000,
    "ttft": 0.0,
}
#: The block of docs/benchmarks.md a default run replaces.
LABEL = "fleet-trace"
#: The keys of each row ``--bench-json`` writes, in this order.
JSON_KEYS = ("target", "requests", "errors", "shed", "ttft_p50_ms", "ttft_p90_ms",
             "ttft_p99_ms", "prefill_computed_tokens", "oracle_prefill_tokens")
#: The replay's defaults (docs/benchmarks.md says why these).
LIMIT = 400
SPEED = 5.0
#: ``--short``'s (a quick check).
SHORT_LIMIT = 80
#: Answers are cut at this many tokens: TTFT is what routing changes, and each token is an
#: event the proxies and sims relay on this machine's 2 cores.
MAX_TOKENS = 16
#: Llama 3.1's context: the trace's longest prompt is 126,195 tokens.
MAX_MODEL_LEN = 131072
#: A request's time limit: at 80 % load a 126k-token prompt queues behind others.
TIMEOUT = 180.0
#: Statuses that say the target refused work it had no room for, rather than failed it.
SHED_STATUSES = (429, 503)
MODEL = "tiny-llama"


def offline(rows: list[mooncaketrace.Row], instances: int = fleet.INSTANCES,
            blocks: int = int(FIGURES["kv_cache_blocks"])) -> dict[str, int]:
    """The trace's prompt tokens; what one infinite cache seeing every prompt computes (the
    JSON's ``oracle_prefill_tokens``); and what round_robin computes (request i on instance i
    mod n, each with its own bounded cache), through the sim's own prefix cache."""
    infinite = PrefixCache(capacity=1 << 40)
    caches = [PrefixCache(capacity=blocks) for _ in range(instances)]
    total = oracle = rr = 0
    for i, row in enumerate(rows):
        ids = textgen.token_ids(mooncaketrace.prompt_text(row))
        hashes = block_hashes(ids, infinite.block_size)
        total += len(ids)
        oracle += len(ids) - infinite.insert_hashes(hashes, ids)
        rr += len(ids) - caches[i % instances].insert_hashes(hashes, ids)
    return {"prompt_tokens": total, "oracle": oracle, "round_robin": rr}


#: The request line's per-stage timings (``serving/context.py``) ``stages`` reads.
STAGES = ("first_byte_ms", "prefill_ms", "decode_first_byte_ms")


def stages(logs: list[Path]) -> dict[str, tuple[float, float]]:
    """(p50, p90) in ms, over the request lines in ``logs`` (an epd-flask target's masters'
    logs at ``--proxy-log-level info``), of the prefill leg, decode's first byte and the rest
    of the time to the first byte (the proxy's own: ``/tokenize``, routing, queueing): which
    of them a target loses TTFT in (a prompt decode computed alone counts a prefill leg of 0).
    {} without request lines."""
    found: dict[str, list[float]] = {"prefill": [], "decode_first_byte": [], "proxy": []}
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            if " request_id=" not in line or "first_byte_ms=" not in line:
                continue
            ms = {k: float(v) for k, v in (part.split("=", 1) for part in line.split()
                                           if part.startswith(STAGES))}
            first = ms.get("first_byte_ms", 0.0)
            prefill, decode = ms.get("prefill_ms", 0.0), ms.get("decode_first_byte_ms", 0.0)
            found["prefill"].append(prefill)
            found["decode_first_byte"].append(decode)
            found["proxy"].append(first - prefill - decode)
    return {k: (fleet.pct(v, 0.5) or 0.0, fleet.pct(v, 0.9) or 0.0)
            for k, v in found.items() if v}


def span(rows: list[mooncaketrace.Row]) -> float:
    """The replay's length in seconds, first arrival to last (at least one second)."""
    return max(1.0, rows[-1].t if rows else 0.0)


def time_factor(rr_computed: int, seconds: float, figures: dict[str, Any],
                utilisation: float, instances: int = fleet.INSTANCES) -> float:
    """How much faster than ``figures`` the simulated GPUs must run for round_robin's
    ``rr_computed`` tokens over ``seconds`` to keep ``instances`` prefills ``utilisation``
    busy."""
    return rr_computed / seconds / (instances * utilisation
                                    * float(figures["prefill_tokens_per_s"]))


def scaled(figures: dict[str, Any], factor: float) -> dict[str, Any]:
    """``figures`` as a GPU ``factor`` times as fast: prefill throughput times it, decode
    steps divided by it; the cache's size stays."""
    return {**figures,
            "prefill_tokens_per_s": round(float(figures["prefill_tokens_per_s"]) * factor, 1),
            "token_delay": float(figures["token_delay"]) / factor,
            "token_delay_per_stream": float(figures["token_delay_per_stream"]) / factor}


#: epd-flask's roster settings on the trace: the engines' queues read every second (the
#: replay lasts ~30 s; the default 5 s would give each target a handful of reads), and an
#: idle decode computes a prompt while every prefill has ~0.5 s of work queued at the load
#: point (``IDLE_DECODE``; one row runs kv_aware without it, the change measured in the run).
IDLE_DECODE = {"disaggregate_max_prefill_queue_tokens": 30000}
EPD_SETTINGS = {"probe_interval": 1.0, "engine_metrics_interval": 1.0, **IDLE_DECODE}


WITHOUT_IDLE_DECODE = "epd kv_aware, no idle-decode prefill"
#: 2 proxy hosts of 2 workers each, sharing their open calls through a Redis
#: (``load_store``); and the same without it.
SHARED_HOSTS = "epd kv_aware, 2 hosts x 2 workers"
WITHOUT_LOAD_STORE = "epd kv_aware, 2 hosts x 2 workers, no load store"


def variants(include_router: bool, kv_events: bool) -> list[fleet.Variant]:
    """The trace's targets: every epd-flask policy on split instances, kv_aware also
    without ``IDLE_DECODE``, on 1 host x 4 workers (the workers sharing exact counts
    through their load board) and on 2 hosts x 2 workers with and without the hosts
    sharing theirs (``load_store``), the oracle, and vllm-router's policies."""
    split = {"decode": "least_loaded"}

    def epd(name: str, routing: dict[str, str], settings: dict[str, Any] | None = None,
            **kw: Any) -> fleet.Variant:
        return fleet.Variant(name, "epd", routing=routing,
                             extra={**EPD_SETTINGS, **(settings or {})}, **kw)
    out = [
        epd("epd round_robin", {}),
        epd("epd least_loaded", {"prefill": "least_loaded", "decode": "least_loaded"}),
        epd("epd prefix", {"prefill": "prefix", **split}),
        epd("epd session", {"prefill": "session", **split}),
    ]
    if kv_events:
        out += [epd("epd kv_aware", {"prefill": "kv_aware", **split}, kv_events=True),
                epd(WITHOUT_IDLE_DECODE, {"prefill": "kv_aware", **split},
                    {k: 0 for k in IDLE_DECODE}, kv_events=True),
                epd("epd kv_aware, 1 host x 4 workers", {"prefill": "kv_aware", **split},
                    workers=4, kv_events=True),
                epd(SHARED_HOSTS, {"prefill": "kv_aware", **split},
                    workers=2, processes=2, kv_events=True, load_store=True),
                epd(WITHOUT_LOAD_STORE, {"prefill": "kv_aware", **split},
                    workers=2, processes=2, kv_events=True)]
    out.append(epd("oracle", {"prefill": "oracle", "decode": "oracle"}))
    if include_router:
        for policy in ("round_robin", "power_of_two", "cache_aware"):
            out.append(fleet.Variant(f"vllm-router {policy}", "router",
                                     router_args=("--policy", policy)))
        if kv_events:
            out.append(fleet.Variant("vllm-router kv_aware", "router", kv_events=True,
                                     router_args=("--prefill-policy", "kv_aware",
                                                  "--decode-policy", "power_of_two")))
    return out


def summarize(variant: fleet.Variant, result: dict[str, Any],
              sims: list[dict[str, Any]], oracle: int) -> dict[str, Any]:
    """One target's row: the JSON's keys, and what the page's table adds."""
    reqs = result["requests"]
    ok = [r for r in reqs if r["ok"]]
    shed = [r for r in reqs if not r["ok"] and r.get("status") in SHED_STATUSES]
    ttfts = [r["ttft"] for r in ok]
    computed = sum(s.get("prefix_computed_tokens", 0) for s in sims)
    cached = sum(s.get("prefix_cached_tokens", 0) for s in sims)

    def ms(q: float) -> float | None:
        value = fleet.pct(ttfts, q)
        return None if value is None else round(value * 1000, 1)
    return {
        "target": variant.name, "requests": len(reqs), "errors": len(reqs) - len(ok) - len(shed),
        "shed": len(shed), "ttft_p50_ms": ms(0.5), "ttft_p90_ms": ms(0.9),
        "ttft_p99_ms": ms(0.99), "prefill_computed_tokens": computed,
        "oracle_prefill_tokens": oracle,
        # The page's table only:
        "kind": variant.kind, "workers": variant.workers * variant.processes,
        "cached": cached, "why": sorted({r.get("error", "")[:120] for r in reqs
                                         if not r["ok"]})[:3],
    }


def json_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: r[k] for k in JSON_KEYS} for r in rows]


def run(args: Any, workdir: Path, sims: dict[str, list[str]], events: dict[str, str],
        kv_events: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Replay the trace through every target; (what the run was, one row per target)."""
    rows = mooncaketrace.load(Path(args.trace), args.trace_limit, args.trace_speed)
    work = offline(rows)
    seconds = span(rows)
    factor = time_factor(work["round_robin"], seconds, FIGURES, fleet.UTILISATION)
    figures = scaled(FIGURES, factor)
    for url in sims["prefill"] + sims["decode"]:
        configure(url, {**figures, "max_model_len": MAX_MODEL_LEN, "output_tokens": MAX_TOKENS})
    trace = [mooncaketrace.as_json(r) for r in rows]
    chosen = [v for v in variants(bool(args.router), kv_events)
              if not args.only or any(s in v.name for s in args.only.split(","))]
    started = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    out = []
    for listed in chosen:
        with fleet.running(workdir, listed) as variant:
            runners = Fleet(workdir)
            try:
                roster = workdir / f"roster-trace-{len(out)}.yaml"
                roster.write_text(fleet.roster_text(sims["prefill"], sims["decode"], [], variant,
                                                    events))
                if variant.kind == "epd":
                    urls = fleet.start_epd(runners, variant, roster, args.proxy_log_level)
                else:
                    urls, _ = fleet.start_router(runners, args.router, variant, sims["prefill"],
                                                 sims["decode"], [], events)
                time.sleep(0.5)  # first probes
                for url in sims["prefill"] + sims["decode"]:
                    fleet.post(url, "/sim/reset")
                roots = [p.pid for p in runners.procs]
                cpu_before, busy_before = procstat.sample(roots).cpu_s, procstat.machine_busy()
                result = fleet.replay(urls, trace, TIMEOUT,
                                      {"mooncake": {"model": MODEL, "max_tokens": MAX_TOKENS}})
                cpu = procstat.sample(roots).cpu_s - cpu_before
                busy, wall = (a - b for a, b in zip(procstat.machine_busy(), busy_before,
                                                    strict=True))
                row = summarize(variant, result, [fleet.stats(u) for u in
                                                  sims["prefill"] + sims["decode"]],
                                work["oracle"])
                row["target_cpu_s"], row["machine_busy"] = round(cpu, 2), round(busy / wall, 3)
            finally:
                runners.stop()
        out.append(row)
        print(f"trace {row['target']}: {row['requests']} sent, {row['errors']} errors, "
              f"{row['shed']} shed, TTFT p50 {row['ttft_p50_ms']} p90 {row['ttft_p90_ms']} "
              f"p99 {row['ttft_p99_ms']} ms, computed {row['prefill_computed_tokens']}; the "
              f"target's processes {row['target_cpu_s']} CPU-s, the machine "
              f"{row['machine_busy']:.0%} busy during the replay (logs in {workdir})",
              file=sys.stderr, flush=True)
        if variant.kind == "epd" and args.proxy_log_level == "info":
            found = stages([workdir / f"epd-{url.rsplit(':', 1)[1]}.log" for url in urls])
            print(f"trace {row['target']}: p50/p90 ms: " + ", ".join(
                f"{k} {a:.0f}/{b:.0f}" for k, (a, b) in found.items()), file=sys.stderr,
                flush=True)
    finished = datetime.datetime.now(datetime.timezone.utc)
    meta = {"started": started.isoformat(timespec="seconds"),
            "finished": finished.isoformat(timespec="seconds"), "machine": info,
            "load_after": os.getloadavg(), "trace": Path(args.trace).name,
            "limit": args.trace_limit, "speed": args.trace_speed, "requests": len(rows),
            "span": seconds, "factor": factor, "figures": figures, **work,
            "command": args.command,
            "router_version": router_version(args.router) if args.router else None}
    return meta, out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _x(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    load = ", ".join(f"{v:.1f}" for v in meta["machine"]["load_before"])
    after = ", ".join(f"{v:.1f}" for v in meta["load_after"])
    lines = [
        f"Run {meta['started']} to {meta['finished']} (UTC) on "
        f"{meta['machine'].get('code', 'unknown code')}, {meta['machine']['nproc']} CPUs "
        f"({meta['machine']['cpu']}), load average before {load}, after {after}. Trace: "
        f"`{meta['trace']}`, the first {meta['requests']} requests at {meta['speed']:g}x speed "
        f"({meta['span']:.0f} s), {meta['prompt_tokens']} prompt tokens; one infinite cache "
        f"computes {meta['oracle']} of them, round_robin {meta['round_robin']}. Costs: the "
        f"published figures run {meta['factor']:.2f}x as fast, so round_robin keeps the "
        f"{fleet.INSTANCES} prefills {fleet.UTILISATION:.0%} busy: {meta['figures']}. "
        f"vllm-router: {meta['router_version'] or 'not run'}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| target | requests | errors | shed | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | "
        "prefill tokens computed | computed / oracle's | computed / one infinite cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    oracle = next((r for r in rows if r["target"] == "oracle"), None)
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['requests']} | {r['errors']} | {r['shed']} | "
            f"{_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p90_ms'])} | {_ms(r['ttft_p99_ms'])} | "
            f"{r['prefill_computed_tokens']} | "
            f"{_x(r['prefill_computed_tokens'], oracle and oracle['prefill_computed_tokens'])}"
            f" | {_x(r['prefill_computed_tokens'], r['oracle_prefill_tokens'])} |")
    why = [(r["target"], r["why"]) for r in rows if r["why"]]
    if why:
        lines += ["", "Failures: " + "; ".join(f"{t}: {w}" for t, w in why)]
    found = targets(rows)
    if found:
        lines += ["", "Targets, as measured in this run:", "", *found]
    lines.append("")
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The trace's targets of docs/benchmarks.md as this run measured them, one line each."""
    find = {r["target"]: r for r in rows}
    oracle = find.get("oracle")
    routers = [r for r in rows if r["kind"] == "router" and r["ttft_p50_ms"] is not None
               and not r["errors"] and not r["shed"]]
    out = []
    for name in ("epd kv_aware", SHARED_HOSTS):
        row = find.get(name)
        if row is None or oracle is None or row["ttft_p50_ms"] is None \
                or oracle["ttft_p50_ms"] is None:
            continue
        p50 = row["ttft_p50_ms"] / oracle["ttft_p50_ms"]
        p90 = row["ttft_p90_ms"] / oracle["ttft_p90_ms"]
        work = row["prefill_computed_tokens"] / max(1, oracle["prefill_computed_tokens"])
        line = (f"- `{name}`: TTFT p50 {p50:.2f}x and p90 {p90:.2f}x the oracle's (target "
                f"≤ 1.2x: {_verdict(p50 <= 1.2 and p90 <= 1.2)}); prefill computed {work:.2f}x "
                f"the oracle's (target ≤ 1.1x: {_verdict(work <= 1.1)})")
        if routers:
            best = min(routers, key=lambda r: (r["ttft_p50_ms"], r["ttft_p90_ms"]))
            ok = row["ttft_p50_ms"] <= best["ttft_p50_ms"] \
                and row["ttft_p90_ms"] <= best["ttft_p90_ms"]
            line += (f"; p50/p90 {_ms(row['ttft_p50_ms'])}/{_ms(row['ttft_p90_ms'])} ms against "
                     f"vllm-router's best `{best['target']}` {_ms(best['ttft_p50_ms'])}/"
                     f"{_ms(best['ttft_p90_ms'])} ms (target ≤ it: {_verdict(ok)})")
        out.append(line + ".")
    with_it, without = find.get("epd kv_aware"), find.get(WITHOUT_IDLE_DECODE)
    if with_it and without and with_it["ttft_p50_ms"] is not None \
            and without["ttft_p50_ms"] is not None:
        setting = ", ".join(f"`{k}: {v}`" for k, v in IDLE_DECODE.items())
        out.append(f"- The idle decode computing the prompt ({setting}), one change in "
                   f"this run: `epd kv_aware` TTFT p50/p90/p99 {_ms(with_it['ttft_p50_ms'])}/"
                   f"{_ms(with_it['ttft_p90_ms'])}/{_ms(with_it['ttft_p99_ms'])} ms with it, "
                   f"{_ms(without['ttft_p50_ms'])}/{_ms(without['ttft_p90_ms'])}/"
                   f"{_ms(without['ttft_p99_ms'])} ms without.")
    shared, alone = find.get(SHARED_HOSTS), find.get(WITHOUT_LOAD_STORE)
    if shared and alone and shared["ttft_p50_ms"] is not None \
            and alone["ttft_p50_ms"] is not None:
        out.append(f"- The hosts sharing their open calls through Redis (`load_store`), one "
                   f"change in this run: `{SHARED_HOSTS}` TTFT p50/p90/p99 "
                   f"{_ms(shared['ttft_p50_ms'])}/{_ms(shared['ttft_p90_ms'])}/"
                   f"{_ms(shared['ttft_p99_ms'])} ms with it, {_ms(alone['ttft_p50_ms'])}/"
                   f"{_ms(alone['ttft_p90_ms'])}/{_ms(alone['ttft_p99_ms'])} ms without.")
    failing = [r["target"] for r in rows if r["kind"] == "epd" and (r["errors"] or r["shed"])]
    out.append("- Errors and shed requests for every epd-flask target: "
               + (f"{_verdict(False)} ({', '.join(failing)})" if failing else "0 (met)") + ".")
    return out
