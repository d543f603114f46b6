"""``make bench-tenants``: an interactive tenant's time to first token while a batch tenant
floods the fleet, through epd-flask with admission control, without it, and through
vllm-router's concurrency limit (docs/behaviour.md#admission).

The fleet: two simulated prefill_decode engines with the cost model of
``epd_flask/sim/costmodel.py`` (an 8B model's figures, as bench-fleet's) and vLLM's batch bound
(``--max-num-seqs``: the requests past it wait in the engine, first come, first served). The
load, open loop from a separate process (replay.py), for ``DURATION`` seconds:
- ``chat``: streamed questions with a long prompt, Poisson at ``INTERACTIVE_RATE``;
- ``batch``: non-streamed jobs with short prompts and long answers, Poisson at ten times its
  weighted share of the fleet (its weight over both tenants' weights, times the fleet's
  throughput measured with batch alone).
Each tenant is its own client process, as an interactive service and a batch job are: a
flood's own client work (its connections, the refusals it reads) never delays the times taken
of the interactive requests.
The engines run vLLM's ``--scheduling-policy priority`` in every target: a request without a
``priority`` gets 0, so only a target that sends one sees anything but first come, first served.
Targets, each on a fresh fleet state: chat alone through epd-flask with admission (the
reference), then chat + batch through epd-flask with admission (one class, sharing by
requests, and by tokens; then chat ``high`` and batch ``low`` with ``forward_priority``, so
the engines compute chat's prompts first, and ``reserve``, so batch leaves a few places of each
engine free while chat is active), through epd-flask without admission (what it did
before), and through vllm-router with ``--max-concurrent-requests`` (its rate limiter: one
global first-come queue). Reported:
chat's TTFT p50/p99 and its ratio to alone, batch's completions per second against its share,
and what was lost: a request that neither completed nor got a 429/503 with ``Retry-After``.
Bounded: every request has a timeout, every run its duration plus a drain.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report
from run import BIN, GUNICORN_CONF, MODEL, Fleet, configure, free_port, wait_up

REPLAY = Path(__file__).resolve().parent / "replay.py"
LABEL = "tenants"
INSTANCES = 2
#: vLLM's --max-num-seqs per engine, and the proxy's max_concurrency to match.
SEATS = 64
#: The proxy's max_concurrency per engine (``--bound``; a whole run: the engine's seats).
BOUND = SEATS
#: The engines' figures: bench-fleet's 8B model on one H100 (docs/benchmarks.md), a decode
#: step's cost per running stream taken per token of its context (0.15 ms for ~1,500 tokens
#: of KV, so 0.1 us a token): the tenants' streams hold 200 to 1,500 tokens, where one figure
#: per stream would charge a batch job's short context as a chat's long one.
FIGURES = {"prefill_tokens_per_s": 15000.0, "token_delay": 0.008,
           "token_delay_per_context_token": 0.0000001, "ttft": 0.0, "output_tokens": 1000}
DURATION = 60.0
#: The loaded targets: admission sharing by requests, by tokens, with classes, none,
#: vllm-router.
TARGETS = ("requests", "tokens", "classes", "none", "router")
INTERACTIVE_RATE = 2.0
#: Prompt characters (~4 per token) and answer tokens of each tenant's requests.
CHAT_PROMPT, CHAT_TOKENS = 6000, 16
BATCH_PROMPT, BATCH_TOKENS = 800, 256
WEIGHTS = {"chat": 4, "batch": 1}
#: The tenants' classes in the ``classes`` target (one class, ``normal``, in the others).
CLASSES = {"chat": "high", "batch": "low"}
#: ``admission.reserve`` in the ``classes`` target: places of each engine batch leaves free
#: while chat is active (``--reserve``; 0: the target's row is priorities alone). A chat holds
#: its place through its ~280 ms stream, so at 2 a second two or three are on one engine at
#: once a few times a minute; with 2, a third found that engine full and went to the other,
#: behind its unanswered prompt (rule 14 sees only engines with room).
RESERVE = 3
FLOOD = 10.0
TIMEOUT = 60.0
QUEUE_TIMEOUT = 10
MAX_QUEUE = 400


def set_run(seconds: float, bound: int, reserve: int) -> None:
    """A partial run's own length of load, bound and reserve (exploration; a whole run keeps
    the module's)."""
    global DURATION, BOUND, RESERVE
    DURATION, BOUND, RESERVE = seconds, bound, reserve


def words(n_chars: int, rng: random.Random) -> str:
    """A prompt no other request shares (the engines' prefix caches find nothing)."""
    return " ".join(f"w{rng.randrange(1 << 30):x}" for _ in range(n_chars // 10))


def trace(rate_chat: float, rate_batch: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    for tenant, rate in (("chat", rate_chat), ("batch", rate_batch)):
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= DURATION:
                break
            chat = tenant == "chat"
            body = {"model": MODEL, "max_tokens": CHAT_TOKENS if chat else BATCH_TOKENS,
                    "stream": chat, "messages": [{
                        "role": "user",
                        "content": words(CHAT_PROMPT if chat else BATCH_PROMPT, rng)}]}
            items.append({"t": t, "tenant": tenant, "headers": {"X-Tenant": tenant},
                          "body": body})
    return sorted(items, key=lambda item: item["t"])


def roster(urls: list[str], admission: dict[str, Any] | None, classes: bool = False) -> str:
    lines = []
    if admission is not None:
        lines += ["settings:", f"  admission: {json.dumps(admission)}", "tenants:"]
        lines += [f"  {name}: {{weight: {w}"
                  + (f", priority: {CLASSES[name]}}}" if classes else "}")
                  for name, w in WEIGHTS.items()]
    lines.append("instances:")
    bound = f", max_concurrency: {BOUND}" if admission is not None else ""
    lines += [f'  - {{role: prefill_decode, url: "{u}"{bound}}}' for u in urls]
    return "\n".join(lines) + "\n"


def start_epd(fleet: Fleet, workdir: Path, urls: list[str],
              admission: dict[str, Any] | None, classes: bool = False) -> str:
    path = workdir / f"roster-{time.monotonic_ns()}.yaml"
    path.write_text(roster(urls, admission, classes))
    port = free_port()
    proc = fleet.spawn(f"epd-{port}", [str(BIN / "gunicorn"), "-c", str(GUNICORN_CONF),
                                       "wsgi:app"], env={
        "EPD_WORKERS": "1", "EPD_BIND": f"127.0.0.1:{port}", "EPD_ROSTER": str(path)})
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/ready", proc)
    return url


def start_router(fleet: Fleet, router: str, urls: list[str]) -> str:
    port, metrics = free_port(), free_port()
    proc = fleet.spawn(f"router-{port}", [
        router, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
        "--policy", "round_robin", "--worker-urls", *urls,
        "--max-concurrent-requests", str(SEATS * INSTANCES), "--queue-size", str(MAX_QUEUE),
        "--queue-timeout-secs", str(QUEUE_TIMEOUT)])
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health", proc)
    return url


#: Seconds between starting the clients and the trace's zero: each has imported and waits.
LEAD_IN = 2.0


def replay(url: str, items: list[dict[str, Any]], workdir: Path) -> list[dict[str, Any]]:
    """The answers to ``items``, in their order: one client process per tenant, all on one
    timeline. Their answers and what they printed on stderr are kept in ``workdir`` beside
    the servers' logs."""
    tenants = sorted({item["tenant"] for item in items})
    start = time.monotonic() + LEAD_IN
    procs = {}
    for tenant in tenants:
        mine = [item for item in items if item["tenant"] == tenant]
        spec = {"urls": [url], "trace": mine, "timeout": TIMEOUT, "deadline": DURATION + 1,
                "start": start}
        name = workdir / f"replay-{tenant}-{time.monotonic_ns()}"
        name.with_suffix(".spec").write_text(json.dumps(spec))
        with name.with_suffix(".spec").open("rb") as spec_file:
            procs[tenant] = name, subprocess.Popen(
                [sys.executable, str(REPLAY)], stdin=spec_file, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    answers: dict[str, list[dict[str, Any]]] = {}
    failed = []
    for tenant, (name, proc) in procs.items():
        out, err = proc.communicate(timeout=LEAD_IN + DURATION + TIMEOUT + 60)
        name.with_suffix(".log").write_bytes(err)
        name.with_suffix(".json").write_bytes(out)
        if proc.returncode != 0:
            failed.append(f"{tenant}: {err.decode(errors='replace')[-2000:]}")
        else:
            answers[tenant] = json.loads(out)["requests"]
    if failed:
        raise RuntimeError("replay failed: " + "; ".join(failed))
    each = {tenant: iter(rows) for tenant, rows in answers.items()}
    return [next(each[item["tenant"]]) for item in items]


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summarize(name: str, items: list[dict[str, Any]], done: list[dict[str, Any]],
              share: float | None) -> dict[str, Any]:
    """One target's row; ``items`` the trace ``done`` answers, in the same order (batch is
    counted as served while the flood lasted: completed within ``DURATION``)."""
    chat = [r for r in done if r["tenant"] == "chat"]
    batch = [r for r in done if r["tenant"] == "batch"]
    during = sum(1 for item, r in zip(items, done, strict=False)
                 if r["tenant"] == "batch" and r["ok"] and item["t"] + r["total"] <= DURATION)
    ttfts = [r["ttft"] for r in chat if r["ok"]]

    def lost(rs: list[dict[str, Any]]) -> int:
        return sum(1 for r in rs if not r["ok"] and not (
            r.get("status") in (429, 503) and r.get("retry_after")))

    def refused(rs: list[dict[str, Any]]) -> int:
        return sum(1 for r in rs if not r["ok"] and r.get("status") in (429, 503)
                   and r.get("retry_after"))
    return {"target": name, "chat_sent": len(chat), "chat_ok": len(ttfts),
            "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "batch_sent": len(batch), "batch_ok": sum(r["ok"] for r in batch),
            "batch_per_s": during / DURATION, "share_per_s": share,
            "refused": refused(chat) + refused(batch), "lost": lost(chat) + lost(batch),
            "ttft_top": [round(t * 1000) for t in sorted(ttfts)[-5:]],
            "errors": sorted({r.get("error", "")[:100] for r in done if not r["ok"]})[:3]}


#: Requests each engine keeps in its record (/sim/requests): a whole target's streams.
RECORDS = 4000


def keep_records(urls: list[str], workdir: Path, label: str) -> None:
    """The engines' records of the streams just served (the chat's), their first token's
    planned time and lateness among them, kept in ``workdir`` (``--logs``): what tells the
    engines' queue from the simulators' own delays on a busy machine."""
    for url in urls:
        with urllib.request.urlopen(url + "/sim/requests", timeout=30) as answer:
            records = json.loads(answer.read())
        kept = [{k: r.get(k) for k in ("time", "status", "first_token_ms",
                                        "first_token_late_ms")}
                | {"request_id": r["headers"].get("x-request-id")}
                for r in records if (r.get("body") or {}).get("stream")]
        port = url.rsplit(":", 1)[1]
        (workdir / f"records-{label}-{port}.json").write_text(json.dumps(kept))


def reset(urls: list[str]) -> None:
    for url in urls:
        subprocess.run(["curl", "-s", "-X", "POST", "-H", "Content-Type: application/json",
                        "-d", "{}", url + "/sim/reset"], check=True, capture_output=True)


def measure(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], float]:
    fleet = Fleet(workdir)
    rows: list[dict[str, Any]] = []
    try:
        urls = [fleet.sim("prefill_decode", "--max-num-seqs", str(SEATS),
                          "--scheduling-policy", "priority",
                          "--record-limit", str(RECORDS))[0]
                for _ in range(INSTANCES)]
        for url in urls:
            configure(url, FIGURES)
        admitted = {"tenant_header": "X-Tenant", "queue_timeout": QUEUE_TIMEOUT,
                    "max_queue": MAX_QUEUE}
        # The fleet's batch throughput: batch alone, flooding past its seats.
        epd = start_epd(fleet, workdir, urls, admitted)
        calibration = trace(0.0, SEATS * INSTANCES, args.seed)
        capacity = summarize("", calibration, replay(epd, calibration, workdir),
                             None)["batch_per_s"]
        share = capacity * WEIGHTS["batch"] / sum(WEIGHTS.values())
        flood = FLOOD * share
        print(f"batch alone: {capacity:.1f}/s; share {share:.1f}/s, flooding at {flood:.1f}/s",
              file=sys.stderr)
        reset(urls)
        alone = trace(INTERACTIVE_RATE, 0.0, args.seed + 1)
        rows.append(summarize("chat alone, epd-flask with admission", alone,
                              replay(epd, alone, workdir), None))
        if args.logs is not None:
            keep_records(urls, workdir, "alone")
        load = trace(INTERACTIVE_RATE, flood, args.seed + 1)
        for key, name, admission in [
                ("requests", "epd-flask, admission (one class, share_by requests)",
                 {**admitted}),
                ("tokens", "epd-flask, admission (one class, share_by tokens)",
                 {**admitted, "share_by": "tokens"}),
                ("classes", "epd-flask, admission (chat high, batch low, forward_priority"
                 + (f", reserve {RESERVE}" if RESERVE else "") + ")",
                 {**admitted, "forward_priority": True, "reserve": RESERVE}),
                ("none", "epd-flask, no admission", None)]:
            if key not in args.targets:
                continue
            reset(urls)
            target = start_epd(fleet, workdir, urls, admission, classes=key == "classes")
            rows.append(summarize(name, load, replay(target, load, workdir), share))
            if args.logs is not None:
                keep_records(urls, workdir, key)
            print(rows[-1], file=sys.stderr)
        if args.router and "router" in args.targets:
            reset(urls)
            router = start_router(fleet, args.router, urls)
            rows.append(summarize("vllm-router, --max-concurrent-requests", load,
                                  replay(router, load, workdir), share))
            print(rows[-1], file=sys.stderr)
        return rows, capacity
    finally:
        fleet.stop()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def render(rows: list[dict[str, Any]], capacity: float, meta: dict[str, Any]) -> str:
    alone = rows[0]["ttft_p99"]
    command = report.recorded_command("python tests/bench/tenants.py", sys.argv[1:])
    lines = [
        report.stamp(meta["started"], meta, command),
        f"{INSTANCES} simulated prefill_decode engines (cost model: "
        f"{FIGURES['prefill_tokens_per_s']:.0f} prompt tokens/s, "
        f"{FIGURES['token_delay'] * 1000:.0f} ms per token + "
        f"{FIGURES['token_delay_per_context_token'] * 1e6:.1f} us per token of context the "
        "other running requests hold; "
        f"`--max-num-seqs {SEATS} --scheduling-policy priority` each: a request without "
        "`priority` gets 0, so only the row that forwards one is not first come, first "
        f"served); epd-flask 1 worker, `max_concurrency: {BOUND}`, "
        f"`queue_timeout: {QUEUE_TIMEOUT}`, `max_queue: {MAX_QUEUE}`, tenants chat "
        f"(weight {WEIGHTS['chat']}) and batch (weight {WEIGHTS['batch']}), one class "
        f"except where the row says chat {CLASSES['chat']} and batch {CLASSES['batch']} "
        "(then `forward_priority: true`"
        + (f" and `reserve: {RESERVE}`: batch leaves {RESERVE} places of each engine free while "
           "chat is active" if RESERVE else "") + "). "
        f"{DURATION:.0f} s of open-loop load: chat streams ~{CHAT_PROMPT // 4} prompt tokens, "
        f"{CHAT_TOKENS} answer tokens, Poisson {INTERACTIVE_RATE:g}/s; batch non-streamed, "
        f"~{BATCH_PROMPT // 4} prompt tokens, {BATCH_TOKENS} answer tokens, at "
        f"{FLOOD:g}x its share. Batch alone completes {capacity:.1f}/s (the fleet's "
        f"throughput): its share is {capacity * WEIGHTS['batch'] / sum(WEIGHTS.values()):.1f}/s."
        " vllm-router: round_robin, `--max-concurrent-requests "
        f"{SEATS * INSTANCES} --queue-size {MAX_QUEUE} --queue-timeout-secs {QUEUE_TIMEOUT}`.",
        "",
        "| target | chat TTFT p50 ms | chat TTFT p99 ms | p99 vs alone | chat done | "
        "batch done/s during the flood (share) | refused with Retry-After | lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["ttft_p99"] is None or not alone else f"{r['ttft_p99'] / alone:.2f}"
        share = "" if r["share_per_s"] is None else f" ({r['share_per_s']:.1f})"
        batch = "-" if not r["batch_sent"] else f"{r['batch_per_s']:.1f}{share}"
        lines.append(f"| {r['target']} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} | {ratio} "
                     f"| {r['chat_ok']}/{r['chat_sent']} | {batch} | {r['refused']} | "
                     f"{r['lost']} |")
    errors = [(r["target"], r["errors"]) for r in rows if r["errors"] and r["lost"]]
    if errors:
        lines += ["", "Lost requests' errors: " + "; ".join(f"{t}: {e}" for t, e in errors)]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="", help="vllm-router executable (bench venv)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--duration", type=float, default=DURATION,
                   help="seconds of load per target")
    p.add_argument("--bound", type=int, default=BOUND,
                   help="the proxy's max_concurrency per engine")
    p.add_argument("--reserve", type=int, default=RESERVE,
                   help="admission.reserve in the classes target")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="which of the loaded targets run (chat alone always does)")
    p.add_argument("--logs", type=Path, default=None,
                   help="keep the processes' logs (the proxies' request lines, the client's "
                   "answers and stderr) in this new directory instead of a temporary one")
    p.add_argument("--report", type=Path, default=None,
                   help="the page whose tenants block the run replaces (default: "
                   "docs/benchmarks.md for a whole run; none when --duration, --targets, "
                   "--bound or --reserve make it a partial one)")
    args = p.parse_args(argv)
    args.targets = set(args.targets.split(","))
    partial = (args.duration != DURATION or args.targets != set(TARGETS)
               or args.bound != BOUND or args.reserve != RESERVE)
    if args.report is None and not partial:
        args.report = report.PAGE
    set_run(args.duration, args.bound, args.reserve)
    if args.router and not Path(args.router).exists():
        print(f"{args.router} not found; running without vllm-router", file=sys.stderr)
        args.router = ""
    meta = {"started": report.now(), **report.machine()}
    if args.logs is not None:
        args.logs.mkdir(parents=True)
        rows, capacity = measure(args, args.logs)
    else:
        with tempfile.TemporaryDirectory(prefix="epd-bench-tenants-") as tmp:
            rows, capacity = measure(args, Path(tmp))
    text = render(rows, capacity, meta)
    print(text)
    if args.report:
        report.write_section(args.report, LABEL, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
