"""``make bench-fleet``: routing policies judged on a simulated fleet with a cost model.

Starts 4 prefill + 4 decode simulated instances (and, for the combined variant, 4
prefill_decode), each with the cost model of ``epd_flask/sim/costmodel.py``, and replays a
generated trace of multi-turn chat sessions (chattrace.py) through every target in turn:
epd-flask with each policy (1 worker; with 2 workers; 2 processes behind a round-robin front),
and vllm-router with round_robin, power_of_two, cache_aware and (when the sims publish KV
events) kv_aware. Two scenarios, one invocation:
- ``light``: figures for an 8B model on one H100 (FIGURES; sources in docs/benchmarks.md); the
  trace offers a few percent of the fleet's prefill capacity;
- ``loaded``: the same figures but a prefill throughput scaled down so that round_robin's
  prefill work is ``UTILISATION`` of the fleet's capacity (``loaded_figures``): a fleet at 80 %
  of its capacity without driving 15x the rate through 2 CPUs.
Before each target the sims are reset (counters, prefix caches, engine clocks), so every
target starts cold on the same trace. Reports TTFT p50/p99, inter-token p99, completed,
prefill tokens computed and served from cache (the sims' counters) against an oracle with one
infinite cache, load imbalance (the busiest prefill's share over the mean), and each target
docs/benchmarks.md sets for routing as a measured figure. Bounded: each trace lasts its
scenario's duration and every request has a timeout. A whole run replaces each scenario's block
of docs/benchmarks.md (``fleet-light``, ``fleet-loaded``); a partial one writes only where
``--report`` says.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chattrace
import mooncaketrace
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

sys.path.insert(0, str(ROOT))
from epd_flask.control.roster import Instance
from epd_flask.sim import validate
from epd_flask.sim.kvcache import PrefixCache
from tests.redisserver import RedisServer

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
#: vLLM's --kv-events-config, binding a free port (GET /kv_event_sources names it).
KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
             "topic": "kv"}
#: The loaded scenario's share of the fleet's prefill capacity that round_robin uses.
UTILISATION = 0.8


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
    kv_events: bool = False  # needs the sims' KV events
    light_only: bool = False  # not repeated in the loaded scenario
    load_store: bool = False  # epd-flask's hosts share their load through a redis-server


@dataclass(frozen=True)
class Scenario:
    name: str
    duration: float
    rate: float
    utilisation: float | None = None  # None: FIGURES as they are

    @property
    def label(self) -> str:
        """The scenario's block in docs/benchmarks.md."""
        return f"fleet-{self.name}"


def scenarios(short: bool) -> list[Scenario]:
    """Both scenarios; ``short`` (a smoke run, ~4 minutes against ~11) shortens the traces."""
    if short:
        return [Scenario("light", 6.0, 3.0), Scenario("loaded", 8.0, 4.0, UTILISATION)]
    return [Scenario("light", 15.0, 3.0), Scenario("loaded", 25.0, 4.0, UTILISATION)]


def variants(include_router: bool, kv_events: bool, kv_reader: bool) -> list[Variant]:
    """Every target; the kv_aware ones only when the sims publish KV events (``kv_events``)
    and, for epd-flask's, when its roster takes an instance's event endpoint
    (``kv_reader``)."""
    split = {"decode": "least_loaded"}
    out = [
        Variant("epd round_robin", "epd", routing={}),
        Variant("epd least_loaded", "epd",
                routing={"prefill": "least_loaded", "decode": "least_loaded"}),
        Variant("epd prefix", "epd", routing={"prefill": "prefix", **split}),
        Variant("epd session", "epd", routing={"prefill": "session", **split}),
        *([Variant("epd kv_aware", "epd", routing={"prefill": "kv_aware", **split},
                   kv_events=True)] if kv_reader else []),
        Variant("epd prefix, 2 workers", "epd", workers=2, light_only=True,
                routing={"prefill": "prefix", **split}),
        Variant("epd prefix, 2 hosts x 2 workers", "epd", workers=2, processes=2,
                light_only=True, routing={"prefill": "prefix", **split}),
        *([Variant("epd kv_aware, 2 hosts x 2 workers", "epd", workers=2, processes=2,
                   light_only=True, kv_events=True,
                   routing={"prefill": "kv_aware", **split})] if kv_reader else []),
        Variant("epd round_robin (PD)", "epd", combined=True, routing={}),
        Variant("epd prefix (PD)", "epd", combined=True, routing={"prefill_decode": "prefix"}),
    ]
    if include_router:
        for policy in ("round_robin", "power_of_two", "cache_aware"):
            out.append(Variant(f"vllm-router {policy}", "router",
                               router_args=("--policy", policy)))
        # kv_aware for prefill (fed by the prefills' events); decode has no cache to match.
        out.append(Variant("vllm-router kv_aware", "router", kv_events=True, router_args=(
            "--prefill-policy", "kv_aware", "--decode-policy", "power_of_two")))
        out.append(Variant("vllm-router cache_aware (PD)", "router", combined=True,
                           router_args=("--policy", "cache_aware")))
    return [v for v in out if kv_events or not v.kv_events]


def sim_publishes_events() -> bool:
    """Whether this tree's simulator takes vLLM's ``--kv-events-config``."""
    out = subprocess.run([str(BIN / "epd-flask-sim"), "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    return "--kv-events-config" in out


def event_endpoints(urls: list[str]) -> dict[str, str]:
    """Where each sim publishes its KV events, from vLLM's ``GET /kv_event_sources`` (the sim
    binds a port the OS picks, as ``tcp://*:0`` asks)."""
    out = {}
    for url in urls:
        with urllib.request.urlopen(url + "/kv_event_sources", timeout=5) as resp:
            sources = json.loads(resp.read())
        out[url] = sources["0"]["endpoint"]
    return out


#: vllm-router's counters of how its cache-aware policies decided, kept in the report: a
#: kv_aware that never matched a block (it could not tokenize through the instance) balances
#: load only, and its row must say so.
ROUTER_COUNTERS = ("vllm_router_prefix_routing_decisions_total",
                   "vllm_router_kv_routing_inputs_total")


def router_counters(url: str) -> dict[str, float]:
    """``{"prefill:prefix_hit": n, "inputs:tokenize": m, ...}`` from ROUTER_COUNTERS (decisions
    by stage and outcome, KV inputs by result); {} if the exporter is silent."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return parse_router_counters(resp.read().decode("utf-8", "replace"))
    except OSError:
        return {}


def parse_router_counters(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(ROUTER_COUNTERS) or "{" not in line:
            continue
        name, _, value = line.rpartition(" ")
        labels = dict(part.split("=", 1) for part in
                      name[name.index("{") + 1:name.rindex("}")].replace('"', "").split(","))
        key = (f"inputs:{labels.get('result')}" if "kv_routing_inputs" in name
               else f"{labels.get('stage')}:{labels.get('outcome')}")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def post(url: str, path: str) -> None:
    req = urllib.request.Request(url + path, data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5):
        pass


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as resp:
        return json.loads(resp.read())


def _prompts(trace: list[dict[str, Any]]) -> list[list[tuple[str, int]]]:
    """Each request's (prompt, tokens) pairs, as the sims count them."""
    out = []
    for item in trace:
        req = validate.parse_request("/v1/chat/completions", item["body"], "tiny-llama",
                                     MAX_MODEL_LEN)
        out.append(list(zip(req.prompts, req.prompt_tokens, strict=True)))
    return out


def oracle_computed(trace: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, tokens an oracle computes): one infinite cache seeing every prompt in
    order, as if every request went where its longest prefix is."""
    cache = PrefixCache(capacity=1 << 30)
    total = computed = 0
    for prompts in _prompts(trace):
        for prompt, tokens in prompts:
            total += tokens
            computed += tokens - cache.lookup_and_insert(prompt, tokens)
    return total, computed


def round_robin_computed(trace: list[dict[str, Any]], instances: int = INSTANCES,
                         blocks: int = int(FIGURES["kv_cache_blocks"])) -> int:
    """The prefill tokens the fleet computes when request i goes to instance i mod n, each
    instance with its own bounded prefix cache: round_robin's work, the same in every run
    (where the rotation starts moves which instance computes what, not how much)."""
    caches = [PrefixCache(capacity=blocks) for _ in range(instances)]
    computed = 0
    for i, prompts in enumerate(_prompts(trace)):
        for prompt, tokens in prompts:
            computed += tokens - caches[i % instances].lookup_and_insert(prompt, tokens)
    return computed


def loaded_figures(figures: dict[str, Any], computed: int, duration: float,
                   utilisation: float, instances: int = INSTANCES) -> dict[str, Any]:
    """``figures`` with a prefill throughput at which ``computed`` tokens over ``duration``
    seconds keep ``instances`` prefills busy ``utilisation`` of the time.

    Capacity is measured against the tokens round_robin *computes*, not those the trace
    offers: a cached token costs the engine nothing, and 70 % of this trace's prompt tokens
    are cache hits even under round_robin, so sizing on the offered tokens would leave
    round_robin itself ~25 % busy and the run would not be loaded. With round_robin's
    work as the reference the baseline runs at ``utilisation`` and a policy that computes
    less runs below it unless it concentrates that work on a few instances, which is what
    the 80 % target is about. Only the prefill rate is scaled: the decode figures stay, so
    inter-token times are those of the light scenario.
    """
    rate = computed / duration / (instances * utilisation)
    return {**figures, "prefill_tokens_per_s": round(rate, 1)}


def replay(urls: list[str], trace: list[dict[str, Any]], timeout: float,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The client's results for ``trace`` sent to ``urls`` (replay.py; ``extra`` adds to its
    spec)."""
    spec = {"urls": urls, "trace": trace, "timeout": timeout,
            "deadline": trace[-1]["t"] + 1.0 if trace else 0, **(extra or {})}
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


def summarize(variant: Variant, result: dict[str, Any], prefill_stats: list[dict[str, Any]],
              oracle: int) -> dict[str, Any]:
    reqs = result["requests"]
    ok = [r for r in reqs if r["ok"]]
    gaps = [g for r in ok for g in r.get("gaps", [])]
    work = [s.get("prefix_computed_tokens", 0) for s in prefill_stats]
    computed = sum(work)
    cached = sum(s.get("prefix_cached_tokens", 0) for s in prefill_stats)
    served = [s.get("completions", 0) for s in prefill_stats]
    mean = statistics.mean(served) if served else 0
    mean_work = statistics.mean(work) if work else 0
    return {
        "target": variant.name, "kind": variant.kind, "combined": variant.combined,
        "workers": variant.workers * variant.processes,
        "sent": len(reqs), "completed": len(ok),
        "errors": sorted({r.get("error", "")[:120] for r in reqs if not r["ok"]})[:3],
        "ttft_p50": pct([r["ttft"] for r in ok], 0.5),
        "ttft_p99": pct([r["ttft"] for r in ok], 0.99),
        "itl_p99": pct(gaps, 0.99),
        "computed": computed, "cached": cached,
        "vs_oracle": computed / oracle if oracle else None,
        "imbalance": max(served) / mean if mean else None,
        "work_imbalance": max(work) / mean_work if mean_work else None,
        "per_instance": served, "work_per_instance": work,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _load(values: Any) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "not met")


def _peers(rows: list[dict[str, Any]], kind: str, combined: bool) -> list[dict[str, Any]]:
    """One worker's rows of ``kind`` on split (or combined) instances, all requests done."""
    return [r for r in rows if r["kind"] == kind and r["combined"] == combined
            and r["workers"] == 1 and r["completed"] == r["sent"]]


def _find(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["target"] == name), None)


def targets(scenario: Scenario, rows: list[dict[str, Any]]) -> list[str]:
    """The routing targets of docs/benchmarks.md as measured in this run, one line each
    (figures, no prose)."""
    out = []
    for combined in (False, True):
        tag = " (PD)" if combined else ""
        epd = [r for r in _peers(rows, "epd", combined) if r["ttft_p50"] is not None]
        base = _find(rows, f"epd round_robin{tag}")
        routers = [r for r in _peers(rows, "router", combined) if r["ttft_p50"] is not None]
        if not epd or base is None:
            continue
        best = min(epd, key=lambda r: r["ttft_p50"])
        ratio = _div(best["ttft_p50"], base["ttft_p50"])
        line = (f"- TTFT p50{tag}: best epd-flask policy `{best['target']}` "
                f"{_ms(best['ttft_p50'])} ms, {_ratio(ratio)}x `epd round_robin{tag}` "
                f"({_ms(base['ttft_p50'])} ms; target ≤ 0.5x: "
                f"{_verdict(None if ratio is None else ratio <= 0.5)})")
        if routers:
            rbest = min(routers, key=lambda r: r["ttft_p50"])
            line += (f"; vllm-router's best `{rbest['target']}` {_ms(rbest['ttft_p50'])} ms "
                     f"(target ≤ it: {_verdict(best['ttft_p50'] <= rbest['ttft_p50'])})")
        out.append(line + ".")
        least = min(epd, key=lambda r: r["vs_oracle"] or 0.0)
        near = None if least["vs_oracle"] is None else least["vs_oracle"] <= 1.2
        out.append(f"- Prefill computed{tag}: least for epd-flask `{least['target']}`, "
                   f"{_ratio(least['vs_oracle'])}x the oracle (target ≤ 1.2x: "
                   f"{_verdict(near)}).")
    for policy in ("epd prefix", "epd kv_aware"):
        hit = {}
        for name in (policy, f"{policy}, 2 workers", f"{policy}, 2 hosts x 2 workers"):
            row = _find(rows, name)
            if row is not None and row["computed"] + row["cached"]:
                hit[name] = 100.0 * row["cached"] / (row["computed"] + row["cached"])
        if policy in hit and len(hit) > 1:
            worst = max(abs(v - hit[policy]) for v in hit.values())
            out.append("- Cache hits (cached / prompt tokens at prefill): " + ", ".join(
                f"`{k}` {v:.1f} %" for k, v in hit.items())
                + f"; largest gap {worst:.1f} points (target ≤ 5: {_verdict(worst <= 5.0)}).")
    if scenario.utilisation is not None:
        ratios = []
        for r in rows:
            tag = " (PD)" if r["combined"] else ""
            base_name = ("epd round_robin" if r["kind"] == "epd" else "vllm-router round_robin")
            base = _find(rows, base_name + tag)
            if base is None or r is base or r["ttft_p99"] is None:
                continue
            ratios.append((r["target"], base["target"], _div(r["ttft_p99"], base["ttft_p99"])))
        if ratios:
            worst_epd = max((x for n, _, x in ratios if n.startswith("epd") and x is not None),
                            default=None)
            out.append(
                f"- TTFT p99 at {scenario.utilisation:.0%} of capacity, against round_robin "
                "of the same proxy and instances: " + ", ".join(
                    f"`{n}` {_ratio(x)}x" for n, _, x in ratios)
                + f" (target: no epd-flask policy above 1.10x: "
                f"{_verdict(None if worst_epd is None else worst_epd <= 1.10)}).")
    return out


def render(scenario: Scenario, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    load = ""
    if scenario.utilisation is not None:
        load = (f" Round_robin computes {meta['round_robin_computed']} prompt tokens, "
                f"{meta['round_robin_computed'] / scenario.duration:.0f}/s: at "
                f"{meta['figures']['prefill_tokens_per_s']:g} tokens/s per prefill the "
                f"{INSTANCES} prefills are {scenario.utilisation:.0%} busy under round_robin.")
    lines = [
        f"Scenario `{scenario.name}`. Run {meta['started']} to {meta['finished']} (UTC) on "
        f"{meta['machine'].get('code', 'unknown code')}, {meta['machine']['nproc']} CPUs "
        f"({meta['machine']['cpu']}), load average before {_load(meta['machine']['load_before'])}, "
        f"after {_load(meta['load_after'])}. Trace: {meta['requests']} requests "
        f"({meta['sessions']} sessions, seed {meta['seed']}, {scenario.duration:g} s, "
        f"{scenario.rate:g} sessions/s), {meta['prompt_tokens']} prompt tokens, an oracle "
        f"with one infinite cache computes {meta['oracle']} of them.{load} vllm-router: "
        f"{meta['router_version'] or 'not run'}. Cost model: {meta['figures']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| target | completed | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | prefill tokens "
        "computed | cached | computed / oracle | imbalance: requests | imbalance: computed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['completed']}/{r['sent']} | {_ms(r['ttft_p50'])} | "
            f"{_ms(r['ttft_p99'])} | {_ms(r['itl_p99'])} | {r['computed']} | {r['cached']} | "
            f"{_ratio(r['vs_oracle'])} | {_ratio(r['imbalance'])} | "
            f"{_ratio(r['work_imbalance'])} |")
    counted = [r for r in rows if r.get("router_counters")]
    if counted:
        lines += ["", "vllm-router's own counts of its cache-aware decisions: " + "; ".join(
            f"`{r['target']}`: " + ", ".join(f"{k} {v:g}" for k, v in
                                            sorted(r["router_counters"].items()))
            for r in counted) + "."]
    errors = [(r["target"], r["errors"]) for r in rows if r["errors"]]
    if errors:
        lines += ["", "Errors: " + "; ".join(f"{t}: {e}" for t, e in errors)]
    found = targets(scenario, rows)
    if found:
        lines += ["", "Targets, as measured in this run:", "", *found]
    lines.append("")
    return "\n".join(lines)


def roster_text(prefills: list[str], decodes: list[str], combined: list[str],
                variant: Variant, events: dict[str, str] | None = None) -> str:
    routing = json.dumps(variant.routing or {})
    extra = "".join(f", {k}: {json.dumps(v)}" for k, v in (variant.extra or {}).items())
    lines = [f"settings: {{connector: nixl, routing: {routing}{extra}}}", "instances:"]

    def entry(role: str, url: str) -> str:
        kv = f", kv_events: \"{events[url]}\"" if variant.kv_events and events and \
            url in events else ""
        return f"  - {{role: {role}, url: \"{url}\"{kv}}}"
    if variant.combined:
        lines += [entry("prefill_decode", u) for u in combined]
    else:
        lines += [entry("prefill", u) for u in prefills]
        lines += [entry("decode", u) for u in decodes]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def running(workdir: Path, variant: Variant) -> Iterator[Variant]:
    """``variant`` as it runs: with ``load_store``, a redis-server of its own (the tests',
    on a free loopback port, nothing saved) started for it and named in its roster's
    settings."""
    if not variant.load_store:
        yield variant
        return
    server = RedisServer(workdir).start()
    try:
        yield dataclasses.replace(variant, extra={**(variant.extra or {}),
                                                  "load_store": server.url})
    finally:
        server.stop()


def start_epd(fleet: Fleet, variant: Variant, roster: Path, log_level: str) -> list[str]:
    """``variant``'s gunicorn masters; ``log_level`` info (the proxy's default, as shipped)
    writes every request's line (its instances, routing decisions and per-stage timings)
    into each master's log."""
    urls = []
    for _ in range(variant.processes):
        port = free_port()
        proc = fleet.spawn(f"epd-{port}", [str(BIN / "gunicorn"), "-c", str(GUNICORN_CONF),
                                           "wsgi:app"], env={
            "EPD_WORKERS": str(variant.workers), "EPD_BIND": f"127.0.0.1:{port}",
            "EPD_ROSTER": str(roster), "EPD_LOG_LEVEL": log_level})
        url = f"http://127.0.0.1:{port}"
        wait_up(url + "/ready", proc)
        urls.append(url)
    return urls


def start_router(fleet: Fleet, router: str, variant: Variant, prefills: list[str],
                 decodes: list[str], combined: list[str],
                 events: dict[str, str] | None = None) -> tuple[list[str], str]:
    """The router's URL, and where its Prometheus exporter answers."""
    port = free_port()
    # Its Prometheus exporter binds a fixed port by default; a lingering router or another
    # run on the machine would make the next one fail to start.
    metrics = free_port()
    argv = [router, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            *variant.router_args]
    events = events if variant.kv_events else None
    if variant.combined:
        argv += ["--worker-urls", *combined]
        for u in combined:
            argv += ["--kv-event-source", f"{u}={events[u]}"] if events else []
    else:
        argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for u in prefills:
            argv += ["--prefill", u]
        for u in decodes:
            argv += ["--decode", u]
        for u in prefills:
            argv += ["--pd-kv-events", f"{u}={events[u]}"] if events else []
    proc = fleet.spawn(f"router-{port}", argv)
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health", proc)
    return [url], f"http://127.0.0.1:{metrics}/metrics"


def run_scenario(scenario: Scenario, args: argparse.Namespace, workdir: Path,
                 fleet: dict[str, list[str]], chosen: list[Variant],
                 events: dict[str, str]) -> tuple[
                     dict[str, Any], list[dict[str, Any]]]:
    spec = chattrace.TraceSpec(seed=args.seed, duration=scenario.duration, rate=scenario.rate)
    trace = chattrace.generate(spec)
    total, oracle = oracle_computed(trace)
    rr_computed = round_robin_computed(trace)
    figures = dict(FIGURES) if scenario.utilisation is None else loaded_figures(
        FIGURES, rr_computed, scenario.duration, scenario.utilisation)
    for url in fleet["prefill"] + fleet["decode"] + fleet["prefill_decode"]:
        configure(url, figures)
    started = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    rows = []
    for variant in chosen:
        if variant.light_only and scenario.utilisation is not None:
            continue
        runners = Fleet(workdir)
        try:
            roster = workdir / f"roster-{scenario.name}-{len(rows)}.yaml"
            roster.write_text(roster_text(fleet["prefill"], fleet["decode"],
                                          fleet["prefill_decode"], variant, events))
            metrics = ""
            if variant.kind == "epd":
                urls = start_epd(runners, variant, roster, args.proxy_log_level)
            else:
                urls, metrics = start_router(runners, args.router, variant, fleet["prefill"],
                                             fleet["decode"], fleet["prefill_decode"], events)
            time.sleep(0.5)  # first probes
            for url in fleet["prefill"] + fleet["decode"] + fleet["prefill_decode"]:
                post(url, "/sim/reset")
            result = replay(urls, trace, args.timeout)
            computing = fleet["prefill_decode"] if variant.combined else fleet["prefill"]
            row = summarize(variant, result, [stats(u) for u in computing], oracle)
            row["router_counters"] = router_counters(metrics) if metrics else {}
        finally:
            runners.stop()
        rows.append(row)
        print(f"{scenario.name} {row['target']}: {row['completed']}/{row['sent']} ok, TTFT "
              f"p50 {_ms(row['ttft_p50'])} ms p99 {_ms(row['ttft_p99'])} ms, computed "
              f"{row['computed']} cached {row['cached']}", file=sys.stderr, flush=True)
    finished = datetime.datetime.now(datetime.timezone.utc)
    meta = {"started": started.isoformat(timespec="seconds"),
            "finished": finished.isoformat(timespec="seconds"), "machine": info,
            "load_after": os.getloadavg(), "requests": len(trace),
            "sessions": len({r["session"] for r in trace}), "seed": args.seed,
            "prompt_tokens": total, "oracle": oracle, "round_robin_computed": rr_computed,
            "figures": figures, "command": args.command,
            "router_version": router_version(args.router) if args.router else None}
    return meta, rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The run's options; ``report`` is where its blocks go ('' for nowhere)."""
    import tracereplay  # it imports this module, so not at the top
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", default="", help="vllm-router executable (bench venv)")
    p.add_argument("--short", action="store_true",
                   help="short traces for a quick check (~4 minutes); writes no report "
                        "unless --report is given")
    p.add_argument("--scenario", default="light,loaded,trace",
                   help="comma-separated: light, loaded, trace")
    p.add_argument("--trace", default=str(mooncaketrace.DEFAULT),
                   help="the trace scenario's file, Mooncake's format (default: the one in "
                        "tests/bench/traces)")
    p.add_argument("--trace-speed", type=float, default=tracereplay.SPEED,
                   help="the trace's arrival times are divided by this")
    p.add_argument("--trace-limit", type=int, default=tracereplay.LIMIT,
                   help="replay the trace's first N requests (0: all)")
    p.add_argument("--bench-json", default="",
                   help="write the trace scenario's rows here as a JSON list")
    p.add_argument("--duration", type=float, default=0.0,
                   help="trace length, seconds (default: the scenario's)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="new sessions per second (default: the scenario's)")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--only", default="", help="comma-separated substrings of target names")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--report", default=None,
                   help="markdown file whose scenario blocks the tables replace (default: "
                        "docs/benchmarks.md for a whole run; none when --short, --only, "
                        "--duration, --rate or --seed make it a partial one; '' for none)")
    p.add_argument("--json", default="")
    p.add_argument("--proxy-log-level", default="info",
                   help="epd-flask's log level (default: info, the proxy's own, as "
                        "shipped): info writes every request's line (routing, per-stage "
                        "timings) into the kept process logs, whose directory the run names")
    args = p.parse_args(argv)
    args.trace = str(Path(args.trace).resolve())
    if args.short and args.trace_limit == p.get_default("trace_limit"):
        args.trace_limit = tracereplay.SHORT_LIMIT
    partial = bool(args.short or args.only or args.duration or args.rate
                   or args.seed != p.get_default("seed")
                   or any(getattr(args, k) != p.get_default(k)
                          for k in ("trace", "trace_speed", "trace_limit")))
    if args.report is None:
        args.report = "" if partial else str(report.PAGE)
        if partial:
            print("a partial run: docs/benchmarks.md is left as it is (--report FILE writes "
                  "it somewhere)", file=sys.stderr)
    args.command = report.recorded_command(".venv/bin/python tests/bench/fleet.py",
                                           sys.argv[1:] if argv is None else list(argv))
    return args


def main(argv: list[str] | None = None) -> int:
    import tracereplay  # it imports this module, so not at the top

    args = parse_args(argv)
    wanted = args.scenario.split(",")
    chosen_scenarios = [sc for sc in scenarios(args.short) if sc.name in wanted]
    chosen_scenarios = [Scenario(sc.name, args.duration or sc.duration, args.rate or sc.rate,
                                 sc.utilisation) for sc in chosen_scenarios]
    with_trace = "trace" in wanted
    include_router = bool(args.router and Path(args.router).exists())
    if not include_router:
        print("vllm-router not found (make bench-fleet installs it); running without it",
              file=sys.stderr)
        args.router = ""
    kv_events = sim_publishes_events()
    kv_reader = "kv_events" in Instance.model_fields
    if not kv_events:
        print("the sims publish no KV events: kv_aware targets not run", file=sys.stderr)
    chosen = [v for v in variants(include_router, kv_events, kv_reader)
              if not args.only or any(s in v.name for s in args.only.split(","))]
    workdir = Path(tempfile.mkdtemp(prefix="epd-bench-fleet-"))
    sims_fleet = Fleet(workdir)
    results = {}
    try:
        def sims(role: str) -> list[str]:
            extra = ("--kv-events-config", json.dumps(KV_EVENTS)) if kv_events else ()
            return [sims_fleet.sim(role, "--prompt-tokens-details", "--max-model-len",
                                   str(MAX_MODEL_LEN), *extra)[0] for _ in range(INSTANCES)]
        fleet = {"prefill": sims("prefill"), "decode": sims("decode"),
                 "prefill_decode": sims("prefill_decode") if chosen_scenarios and any(
                     v.combined for v in chosen) else []}
        events = event_endpoints(fleet["prefill"] + fleet["prefill_decode"]) \
            if kv_events else {}
        for scenario in chosen_scenarios:
            meta, rows = run_scenario(scenario, args, workdir, fleet, chosen, events)
            results[scenario.name] = {"meta": meta, "rows": rows}
            text = render(scenario, meta, rows)
            print(text, flush=True)
            if args.report:
                report.write_section(Path(args.report), scenario.label, text)
        if with_trace:
            meta, rows = tracereplay.run(args, workdir, fleet, events, kv_events and kv_reader)
            results["trace"] = {"meta": meta, "rows": rows}
            text = tracereplay.render(meta, rows)
            print(text, flush=True)
            if args.report:
                report.write_section(Path(args.report), tracereplay.LABEL, text)
            if args.bench_json:
                Path(args.bench_json).write_text(json.dumps(tracereplay.json_rows(rows),
                                                            indent=1) + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(results))
    except BaseException:
        sims_fleet.stop()
        print(f"benchmark failed; process logs kept in {workdir}", file=sys.stderr)
        raise
    sims_fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
