"""Turning benchmark runs into markdown, and writing each run into its own section of
docs/benchmarks.md: medians over repeats, ratios against the same run.

Nothing here measures; it only summarises what the benchmarks collected. Every benchmark that
writes the page (``run.py``, ``fleet.py``, ``fleetmodel.py`` and the micro-benchmarks) goes
through ``write_section``: a run replaces the block between its own markers and nothing else,
so the page always holds one latest block per benchmark, each saying when it ran, on which
commit, under what load and with what command.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
#: Options that only say where a run's output goes: a recorded command leaves them out.
OUTPUT_OPTIONS = ("--report", "--json", "--bench-json")
#: What a benchmark measures; uncommitted changes here make a run's figures not a commit's.
MEASURED = ("epd_flask", "tests/bench", "etc", "setup.cfg", "gunicorn.conf.py", "wsgi.py")

STREAMING = {"b", "c", "d-streams"}
SLOW_MS = 50  # run.SLOW_ENCODER_MS
EPD_PROXY = "vllm-epd-proxy"  # run.EPD_PROXY
TRACED = "epd-flask+tracing"  # run.TRACED
ADMITTED = "epd-flask+admission"  # run.ADMITTED
#: Admission configured and the fleet not full may cost at most this much proxy CPU per
#: request over admission off (a32).
ADMISSION_CPU_LIMIT = 1.1
#: Tracing on, every request recorded, may cost at most this much proxy CPU per request
#: over tracing off (a32).
TRACING_CPU_LIMIT = 1.2


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def group_summary(runs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One group of one target, median over repeats (counts summed, peaks maxed)."""
    groups = [next(g for g in run["groups"] if g["name"] == name) for run in runs]
    ms = 1000.0
    return {
        "completed": sum(g["completed"] for g in groups),
        "errors": sum(g["errors"] for g in groups),
        "error_samples": [s for g in groups for s in g["error_samples"]][:3],
        "rps": _median([g["completed"] / g["wall_s"] if g["wall_s"] else None for g in groups]),
        "lat_p50": _median([_ms(pct(g["latency_s"], 50)) for g in groups]),
        "lat_p99": _median([_ms(pct(g["latency_s"], 99)) for g in groups]),
        "ttft_p50": _median([_ms(pct(g["ttft_s"], 50)) for g in groups]),
        "ttft_p99": _median([_ms(pct(g["ttft_s"], 99)) for g in groups]),
        "max_gap": _median([max(g["max_gap_s"]) * ms if g["max_gap_s"] else None
                            for g in groups]),
        # A stall of the worker hits every stream it carries at once, so it lifts the median
        # of the per-stream largest gaps; scheduling noise on a shared machine hits a few.
        "med_gap": _median([_ms(pct(g["max_gap_s"], 50)) for g in groups]),
    }


def run_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "cpu_ms": _median([r["cpu_s"] * 1000 / r["requests"] if r["requests"] else None
                           for r in runs]),
        "sim_cpu_ms": _median([r["sim_cpu_s"] * 1000 / r["requests"] if r["requests"] else None
                               for r in runs]),
        "client_cpu_ms": _median([r["client_cpu_s"] * 1000 / r["requests"]
                                  if r["requests"] else None for r in runs]),
        "rss": max(r["peak_rss_mb"] for r in runs),
        "stall_ms": max((max(r["stalls_ms"], default=0.0) for r in runs if "stalls_ms" in r),
                        default=None),
        "repeats": len(runs),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def progress_line(workload: str, rep: int, run: dict[str, Any]) -> str:
    parts = []
    for g in run["groups"]:
        lat = pct(g["latency_s"], 50)
        parts.append(f"{g['name']}: {g['completed']} ok {g['errors']} err "
                     f"{g['completed'] / g['wall_s']:.0f} req/s p50 {_f(_ms(lat), 2)} ms")
    cpu = run["cpu_s"] * 1000 / run["requests"] if run["requests"] else 0.0
    return (f"[{workload} #{rep + 1}] {run['target']}: " + "; ".join(parts)
            + f"; cpu {cpu:.2f} ms/req, rss {run['peak_rss_mb']:.0f} MB")


def summaries(results: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for res in results:
        for target, runs in res["runs"].items():
            if not runs:
                continue
            whole = run_summary(runs)
            for g in runs[0]["groups"]:
                out[(res["workload"], g["name"], target)] = {**group_summary(runs, g["name"]),
                                                            **whole}
    return out


def render(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    m = meta["machine"]
    lines = [
        f"Run {meta['started']} to {meta['finished']} (UTC) on {m.get('code', 'unknown code')}. "
        f"Machine: {m['nproc']} CPUs "
        f"({m['cpu']}), {m['mem_gb']} GB RAM, Python {m['python']}, Linux {m['kernel']}; "
        f"load average {m['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after "
        "(the machine is shared: read ratios, not absolute times). "
        f"vllm-router {meta.get('router_version') or 'not run'}; vLLM's EPD proxy "
        f"{'on ' + meta['epd_proxy'] if meta.get('epd_proxy') else 'not run'}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "Workloads:",
        "",
    ]
    for res in results:
        lines.append(f"- **{res['workload']}**: {res['what']}")
    lines += [
        "",
        "| workload | target | ok | err | req/s | latency p50 / p99 ms | TTFT p50 / p99 ms "
        "| largest gap: max / median ms | proxy CPU ms/req | x router | x EPD proxy "
        "| sim CPU ms/req | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = summaries(results)
    for (workload, group, target), s in table.items():
        direct = target == "direct"
        ratios = {peer: None if direct else _ratio(s, table.get((workload, group, peer)))
                  for peer in ("vllm-router", EPD_PROXY)}
        stream = group in STREAMING
        lines.append(
            f"| {group} | {target} | {s['completed']} | {s['errors']} | {_f(s['rps'], 0)} "
            f"| {_f(s['lat_p50'], 2)} / {_f(s['lat_p99'], 2)} "
            f"| {_f(s['ttft_p50'], 1) if stream else '-'} / "
            f"{_f(s['ttft_p99'], 1) if stream else '-'} "
            f"| {_f(s['max_gap'], 1) + ' / ' + _f(s['med_gap'], 1) if stream else '-'} "
            f"| {'-' if direct else _f(s['cpu_ms'], 2)} | {_f(ratios['vllm-router'], 2)} "
            f"| {_f(ratios[EPD_PROXY], 2)} "
            f"| {_f(s['sim_cpu_ms'], 2)} | {'-' if direct else _f(s['rss'], 0)} |")
    lines += ["", *targets_section(table)]
    if meta.get("tracing"):
        got = meta["tracing"]
        lines += ["", f"{TRACED}: the collector received {got['spans']} spans in "
                  f"{got['posts']} posts."]
    errors = [(k, s["error_samples"]) for k, s in table.items() if s["error_samples"]]
    if errors:
        lines += ["", "Error samples:", ""]
        for (_workload, group, target), samples in errors:
            lines.append(f"- {group} / {target}: {samples[0][:200]}")
    return "\n".join(lines) + "\n"


def _ratio(ours: dict[str, Any], peer: dict[str, Any] | None) -> float | None:
    if not peer or not peer["cpu_ms"] or ours["cpu_ms"] is None:
        return None
    return ours["cpu_ms"] / peer["cpu_ms"]


def targets_section(table: dict[tuple[str, str, str], dict[str, Any]]) -> list[str]:
    """The targets of docs/benchmarks.md#targets-of-make-bench, each with the figure this run
    measured."""

    def get(workload: str, target: str, group: str | None = None) -> dict[str, Any] | None:
        return table.get((workload, group or workload, target))

    out = ["| target | measured | met |", "|---|---|---|"]

    def ratio_row(workload: str, peer: str, limit: float) -> None:
        ours, other = get(workload, "epd-flask"), get(workload, peer)
        if not ours or not other or not other["cpu_ms"]:
            return
        r = ours["cpu_ms"] / other["cpu_ms"]
        out.append(f"| {workload}: proxy CPU/request ≤ {limit:g}x {peer}'s "
                   f"| {ours['cpu_ms']:.2f} vs {other['cpu_ms']:.2f} ms = {r:.2f}x "
                   f"| {'yes' if r <= limit else 'no'} |")

    ratio_row("a32", EPD_PROXY, 0.5)
    ratio_row("a32", "vllm-router", 3)
    ratio_row("b", EPD_PROXY, 0.5)
    ratio_row("b", "vllm-router", 1.5)
    ours, direct = get("a1", "epd-flask"), get("a1", "direct")
    if ours and direct and ours["lat_p50"] is not None and direct["lat_p50"] is not None:
        added = ours["lat_p50"] - direct["lat_p50"]
        router = get("a1", "vllm-router")
        extra = ""
        if router and router["lat_p50"] is not None:
            extra = f" (vllm-router adds {router['lat_p50'] - direct['lat_p50']:.2f} ms)"
        out.append(f"| a1: added latency p50 ≤ 1 ms | {added:.2f} ms{extra} "
                   f"| {'yes' if added <= 1 else 'no'} |")
    c = get("c", "epd-flask")
    if c:
        total = c["completed"] + c["errors"]
        out.append(f"| c: all 500 streams complete | {c['completed']}/{total} "
                   f"| {'yes' if c['errors'] == 0 and c['completed'] >= 500 else 'no'} |")
        router = get("c", "vllm-router")
        if c["ttft_p99"] is not None and router and router["ttft_p99"]:
            r = c["ttft_p99"] / router["ttft_p99"]
            out.append(f"| c: TTFT p99 ≤ 1.5x vllm-router's | {c['ttft_p99']:.1f} vs "
                       f"{router['ttft_p99']:.1f} ms = {r:.2f}x | {'yes' if r <= 1.5 else 'no'} |")
        out.append(f"| c: RSS ≤ 150 MB | {c['rss']:.0f} MB "
                   f"| {'yes' if c['rss'] <= 150 else 'no'} |")
    d = get("d", "epd-flask", "d-streams")
    d_direct = get("d", "direct", "d-streams")
    if d and d["med_gap"] is not None:
        base = (f"; direct to decode: {d_direct['med_gap']:.1f} / {d_direct['max_gap']:.1f} ms"
                if d_direct and d_direct["med_gap"] is not None else "")
        out.append("| d: no stall > 20 ms for the other streams (their largest inter-chunk "
                   "gap, median over streams, ≤ 20 ms on top of the 20 ms pace) "
                   f"| median {d['med_gap']:.1f} ms, max {d['max_gap']:.1f} ms{base} "
                   f"| {'yes' if d['med_gap'] <= 40 else 'no'} |")
    if d and d.get("stall_ms") is not None:
        out.append("| d: no stall > 20 ms: the longest the worker's event loop was held "
                   "while the large requests ran (CPU time of the worker between two ticks of "
                   "a 1 ms probe, so not inflated by a busy machine) "
                   f"| {d['stall_ms']:.1f} ms "
                   f"| {'yes' if d['stall_ms'] <= 20 else 'no'} |")
    alone = get("d-alone", "epd-flask")
    if alone:
        router = get("d-alone", "vllm-router")
        extra = f" (vllm-router {router['cpu_ms']:.1f} ms)" if router else ""
        out.append(f"| d: the 4 MB request's own proxy CPU ≤ 30 ms | {alone['cpu_ms']:.1f} ms"
                   f"{extra} | {'yes' if alone['cpu_ms'] <= 30 else 'no'} |")
    per_items = [(k, get(f"e{k}", "epd-flask")) for k in (1, 2, 4, 8)]
    per_items = [(k, e) for k, e in per_items if e and e["cpu_ms"] is not None]
    if len(per_items) >= 2:
        (k0, e0), (k1, e1) = per_items[0], per_items[-1]
        slope = (e1["cpu_ms"] - e0["cpu_ms"]) / (k1 - k0)
        figures = ", ".join(f"{k}: {e['cpu_ms']:.2f}" for k, e in per_items)
        fitted = ", ".join(f"{k}: {e0['cpu_ms'] + slope * (k - k0):.2f}" for k, e in per_items)
        worst = max(abs(e["cpu_ms"] - (e0["cpu_ms"] + slope * (k - k0))) / e["cpu_ms"]
                    for k, e in per_items)
        out.append(f"| e: encoder fan-out cost grows linearly with items | proxy CPU ms/request "
                   f"by images {figures}; the line through the ends gives {fitted} "
                   f"({slope:.2f} ms per image, largest miss {100 * worst:.0f}%) "
                   f"| {'yes' if worst <= 0.25 else 'no'} |")
    skew, flat = get("e8-skew", "epd-flask"), get("e8-even", "epd-flask")
    if skew and flat and skew["lat_p50"] is not None and flat["lat_p50"] is not None:
        extra = skew["lat_p50"] - flat["lat_p50"]
        out.append(f"| e: wall time tracks the slowest encoder (one of 4 takes {SLOW_MS} ms) "
                   f"| p50 {skew['lat_p50']:.1f} ms vs {flat['lat_p50']:.1f} ms with none slow: "
                   f"+{extra:.1f} ms (items run at once: about +{SLOW_MS} ms, not the sum) "
                   f"| {'yes' if 0.7 * SLOW_MS <= extra <= 1.5 * SLOW_MS else 'no'} |")
    for marker, what, limit in ((TRACED, "tracing on (every request recorded)", TRACING_CPU_LIMIT),
                                (ADMITTED, "admission configured and the fleet not full",
                                 ADMISSION_CPU_LIMIT)):
        for (workload, group, target), row in table.items():
            off = get(workload, "epd-flask", group)
            if target != marker or not off or not off["cpu_ms"] or row["cpu_ms"] is None:
                continue
            r = row["cpu_ms"] / off["cpu_ms"]
            bound = workload == "a32"
            out.append(f"| {group}: proxy CPU/request, {what} "
                       f"{'≤ ' + format(limit, 'g') + 'x' if bound else 'vs'} off "
                       f"| {row['cpu_ms']:.2f} vs {off['cpu_ms']:.2f} ms = {r:.2f}x "
                       f"| {('yes' if r <= limit else 'no') if bound else '-'} |")
    a32_direct, a32 = get("a32", "direct"), get("a32", "epd-flask")
    if a32_direct and a32 and a32["rps"]:
        out.append(f"| simulator never the bottleneck | direct-to-decode a32 "
                   f"{a32_direct['rps']:.0f} req/s vs {a32['rps']:.0f} req/s through "
                   f"epd-flask ({a32_direct['rps'] / a32['rps']:.1f}x) | "
                   f"{'yes' if a32_direct['rps'] > 1.5 * a32['rps'] else 'no'} |")
    return out


class MissingSection(ValueError):
    """The page has no place for this benchmark's block: a run never appends one of its own,
    which would turn the page into a diary of runs."""


def markers(label: str) -> tuple[str, str]:
    return f"<!-- bench:{label}:start -->", f"<!-- bench:{label}:end -->"


def write_section(path: Path, label: str, text: str) -> None:
    """Replace the block between this label's markers with ``text``, keeping the rest of the
    page as it is. A page without the markers is refused (``MissingSection``); a file that does
    not exist yet (a scratch report) is created holding the block alone."""
    start, end = markers(label)
    block = f"{start}\n{text.rstrip(chr(10))}\n{end}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Benchmarks\n\n{block}\n")
        return
    old = path.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    found = pattern.findall(old)
    if len(found) != 1:
        raise MissingSection(f"{path} must hold exactly one {start} ... {end} block for this "
                             f"benchmark (found {len(found)}); add it where the figures belong")
    path.write_text(pattern.sub(lambda _: block, old))


def recorded_command(program: str, args: list[str]) -> str:
    """The command a reader runs to measure again: ``program`` and its arguments, without
    the options that only say where the output goes, paths in the checkout relative to it
    and the home directory as ``~`` (the page names no machine's paths)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in OUTPUT_OPTIONS:
            skip = "=" not in arg
            continue
        kept.append(_portable(arg))
    return " ".join([program, *(a if re.fullmatch(r"[\w@%+=:,./~-]+", a) else shlex.quote(a)
                                for a in kept)])


def _portable(arg: str) -> str:
    for base, shown in ((str(ROOT) + "/", ""), (str(Path.home()) + "/", "~/")):
        arg = arg.replace(base, shown)
    return arg


def code_version(root: Path = ROOT) -> str:
    """The commit a run measured, and whether the measured files differed from it."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
                                capture_output=True, text=True, timeout=30, check=True
                                ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no", "--", *MEASURED],
                               capture_output=True, text=True, timeout=30, check=True
                               ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown code (not a git checkout)"
    return f"commit {commit}" + (" with uncommitted changes" if dirty else "")


def machine() -> dict[str, Any]:
    """The machine and code a run measured, read when it starts."""
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {"nproc": os.cpu_count(), "cpu": model, "mem_gb": round(mem_kb / 1024 / 1024, 1),
            "python": platform.python_version(), "kernel": platform.release(),
            "load_before": os.getloadavg(), "code": code_version()}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def stamp(started: str, info: dict[str, Any], command: str) -> str:
    """The first lines of a block: when, on which code and machine, under what load, how."""
    load = ", ".join(f"{v:.1f}" for v in info["load_before"])
    after = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"Run {started} to {now()} (UTC) on {info['code']}. Machine: {info['nproc']} CPUs "
            f"({info['cpu']}), Python {info['python']}; load average {load} before, {after} "
            f"after.\n\nCommand: `{command}`\n")
