"""The chaos suite's machinery: a real fleet (simulators and gunicorn as processes), a steady
mixed load, faults injected one phase at a time, and the bookkeeping that says what happened
to every request.

Every request carries its own ``X-Request-Id``; the proxy gives each of its attempts an
upstream id of its own and logs both (``request_id=... upstream_id=...``), so the simulators'
records (``/sim/requests``, with the status each completion was answered with), read against
the gateway's log, show how many times a decode ran it. A request ends one of three ways for
its client:

- succeeded: a complete answer (a stream ending with ``[DONE]``, or a JSON completion);
- failed: an OpenAI-shaped error, as the status line or as the stream's last event;
- lost: anything else (a cut stream, a reset connection, a malformed answer, no answer).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import requests
import yaml
from gevent.event import Event

from epd_flask.core.errors import instance_label
from tests.bodies import chat, completion, image, multimodal
from tests.e2e.conftest import Process
from tests.helpers import eventually, free_port
from tests.rosters import instance

CLIENT_TIMEOUT = 30.0
HEALTH_WAIT = 15.0
TEXT = "tell me a story about the sea"


@dataclass
class Outcome:
    rid: str
    kind: str
    sent: float
    ended: float = 0.0
    result: str = "lost"  # succeeded | failed | lost
    status: int | None = None
    code: str | None = None
    message: str = ""
    saw_bytes: bool = False
    completion_ids: set[str] = field(default_factory=set)


@dataclass
class Phase:
    name: str
    instance: str  # URL of the faulted instance
    started: float
    ended: float = 0.0
    in_flight_at_fault: int | None = None
    injected: int | None = None  # faults the instance reports it applied (hangs, 500s)
    retries_before: dict[str, int] = field(default_factory=dict)
    retries_after: dict[str, int] = field(default_factory=dict)


class Fleet:
    """Two of each role on fixed ports, so a killed instance restarts where it was."""

    def __init__(self, log_dir: Path, token_delay_ms: int = 15) -> None:
        self.log_dir = log_dir
        self.args: dict[str, list[str]] = {}
        self.sims: dict[str, Process] = {}
        self.role_of: dict[str, str] = {}
        # What killed instances had recorded, read just before each kill.
        self.killed_records: dict[str, list[dict[str, Any]]] = {}
        common = ["--record-limit", "100000", "--keepalive-timeout", "5"]
        # Encoders and prefills take a little time too, so a kill finds work in flight.
        encode = ["--ec-metadata", "empty", "--ttft-ms", "20"]
        prefill = ["--ttft-ms", "40"]
        plan = [("encode", encode), ("encode", encode), ("prefill", prefill), ("prefill", prefill),
                ("decode", ["--token-delay-ms", str(token_delay_ms), "--output-tokens", "40"]),
                ("decode", ["--token-delay-ms", str(token_delay_ms), "--output-tokens", "40"])]
        for role, extra in plan:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            self.args[url] = ["--role", role, "--port", str(port), *common, *extra]
            self.role_of[url] = role
            self.start(url)
        self.gateway: Process | None = None

    def urls(self, role: str) -> list[str]:
        return [u for u, r in self.role_of.items() if r == role]

    def start(self, url: str) -> Process:
        port = url.rsplit(":", 1)[1]
        p = Process([sys.executable, "-m", "epd_flask.sim.cli", *self.args[url]], url,
                    log=self.log_dir / f"sim-{self.role_of[url]}-{port}-{time.time():.0f}.log")
        p.wait_up()
        self.sims[url] = p
        return p

    def kill(self, url: str) -> None:
        """SIGKILL: the instance vanishes mid-work, as a crashed vLLM does. Its records are
        read first (a request arriving in between is refused, never run)."""
        self.killed_records.setdefault(url, []).extend(self.records(url))
        p = self.sims[url]
        os.killpg(p.proc.pid, signal.SIGKILL)
        p.proc.wait(5)

    def start_gateway(self, settings: dict[str, Any], env: dict[str, str]) -> Process:
        port = free_port()
        roster = {"settings": settings,
                  "instances": [instance(r, u) for u, r in self.role_of.items()]}
        roster_file = self.log_dir / "roster.yaml"
        roster_file.write_text(yaml.safe_dump(roster))
        self.gateway = Process(
            [sys.executable, "-m", "gunicorn", "wsgi:app"], f"http://127.0.0.1:{port}",
            log=self.log_dir / "gunicorn.log",
            env={"EPD_ROSTER": str(roster_file), "PORT": str(port), "EPD_WORKERS": "1",
                 "EPD_DEBUG_ENDPOINTS": "1", **env})
        self.gateway.wait_up()
        return self.gateway

    def all_live(self) -> bool:
        assert self.gateway is not None
        doc = requests.get(self.gateway.url + "/health", timeout=5).json()
        return all(not v["evicted"] for v in doc["instances"].values())

    def wait_all_live(self) -> None:
        eventually(self.all_live, HEALTH_WAIT, interval=0.1, what="the fleet back")

    def records(self, url: str) -> list[dict[str, Any]]:
        return requests.get(url + "/sim/requests", timeout=10).json()

    def stop(self) -> None:
        procs = ([self.gateway] if self.gateway else []) + list(self.sims.values())
        for p in procs:
            p.terminate()
        for p in procs:
            p.stop()


def worker_stats(gateway: Process) -> dict[str, Any]:
    return requests.get(gateway.url + "/debug/worker", timeout=10).json()


def retry_counters(gateway: Process) -> dict[str, int]:
    counters = requests.get(gateway.url + "/health", timeout=5).json().get("counters", {})
    return {k: v for k, v in counters.items() if k.startswith("retried_")}


# -- the load -------------------------------------------------------------------------------

KINDS = ("chat_stream", "chat", "mm_stream", "completion_stream", "mm", "completion")


def request_for(kind: str, n: int) -> tuple[str, dict[str, Any]]:
    max_tokens = 10 + n % 30
    fields = {"temperature": 0, "max_tokens": max_tokens, "stream": kind.endswith("stream")}
    if kind.startswith("completion"):
        return "/v1/completions", completion(TEXT, **fields)
    if kind.startswith("mm"):
        return "/v1/chat/completions", multimodal(image(size=900), **fields)
    return "/v1/chat/completions", chat(TEXT, **fields)


def _is_error_doc(doc: Any) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("error"), dict)
            and isinstance(doc["error"].get("message"), str))


def send_one(session: requests.Session, base: str, kind: str, n: int) -> Outcome:
    path, body = request_for(kind, n)
    out = Outcome(rid=f"chaos-{n}-{os.urandom(3).hex()}", kind=kind, sent=time.monotonic())
    try:
        with session.post(base + path, json=body, stream=True, timeout=CLIENT_TIMEOUT,
                          headers={"X-Request-Id": out.rid}) as resp:
            out.status = resp.status_code
            raw = b""
            for piece in resp.iter_content(None):
                raw += piece
                out.saw_bytes = True
        _classify(out, resp, raw, streamed=bool(body["stream"]))
    except (requests.RequestException, OSError) as exc:
        out.result, out.message = "lost", f"{type(exc).__name__}: {exc}"[:300]
    out.ended = time.monotonic()
    return out


def _classify(out: Outcome, resp: requests.Response, raw: bytes, streamed: bool) -> None:
    if resp.status_code != 200:
        try:
            doc = json.loads(raw)
        except ValueError:
            out.message = f"non-JSON {resp.status_code}: {raw[:200]!r}"
            return
        if _is_error_doc(doc):
            out.result, out.code = "failed", str(doc["error"].get("code"))
            out.message = doc["error"]["message"]
        return
    if not streamed:
        try:
            doc = json.loads(raw)
        except ValueError:
            out.message = f"truncated JSON: {raw[-200:]!r}"
            return
        if isinstance(doc, dict) and doc.get("choices"):
            out.result = "succeeded"
            out.completion_ids.add(str(doc.get("id")))
        return
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    if not raw.endswith(b"\n\n") or not events:
        out.message = f"stream cut without an error event: {raw[-200:]!r}"
        return
    docs = []
    for e in events[:-1]:
        try:
            docs.append(json.loads(e))
        except ValueError:
            out.message = f"malformed event {e[:100]!r}"
            return
    if any(_is_error_doc(d) for d in docs):
        out.message = "an error event that was not the stream's last"
        return
    out.completion_ids.update(str(d.get("id")) for d in docs if isinstance(d, dict))
    if events[-1] == b"[DONE]":
        out.result = "succeeded"
        return
    try:
        last = json.loads(events[-1])
    except ValueError:
        out.message = f"stream ended on {events[-1][:100]!r}"
        return
    if _is_error_doc(last):
        out.result, out.code = "failed", str(last["error"].get("code"))
        out.message = last["error"]["message"]
    else:
        out.message = "stream ended without [DONE] or an error event"


class Load:
    """``clients`` greenlets sending the mixed kinds back to back until stopped."""

    def __init__(self, base: str, clients: int) -> None:
        self.base = base
        self.outcomes: list[Outcome] = []
        self._stop = Event()
        self._n = 0
        self._greenlets = [gevent.spawn(self._client) for _ in range(clients)]

    def _client(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                self._n += 1
                n = self._n
                self.outcomes.append(send_one(session, self.base, KINDS[n % len(KINDS)], n))

    def completed_since(self, t: float) -> int:
        return sum(1 for o in self.outcomes if o.sent >= t and o.result == "succeeded")

    def stop(self) -> None:
        self._stop.set()
        gevent.joinall(self._greenlets, timeout=CLIENT_TIMEOUT + 5)


# -- the verdict ----------------------------------------------------------------------------

_LOGGED_IDS = re.compile(r"request_id=(\S+) upstream_id=(\S+)")
_ATTEMPT = re.compile(r"-retry\d+$")


def client_ids(log: str) -> dict[str, str]:
    """Upstream id to client id, from the gateway's request log lines."""
    return {m[2]: m[1] for m in _LOGGED_IDS.finditer(log)}


def decode_runs(records: list[dict[str, Any]], client_of: dict[str, str]) -> Counter[str]:
    """Per client request id, how many decode runs produced an answer (status 200); every
    attempt of one request counts for it."""
    runs: Counter[str] = Counter()
    for r in records:
        rid = (r.get("headers") or {}).get("x-request-id")
        if rid and r.get("path", "").startswith("/v1/") and r.get("status") == 200:
            base = _ATTEMPT.sub("", rid)
            runs[client_of.get(base, base)] += 1
    return runs


@dataclass
class Row:
    name: str
    instance: str
    sent: int
    succeeded: int
    failed: int
    lost: int
    duplicates: int
    in_flight_at_fault: int | None
    injected: int | None
    retries: int
    failures_elsewhere: list[str]


def names(p: Phase, o: Outcome) -> bool:
    """Whether a failure's message names the phase's instance (by its label: client-facing
    errors carry no internal address)."""
    return instance_label(p.instance) in o.message


def phase_of(o: Outcome, phases: list[Phase]) -> Phase | None:
    """The phase a request belongs to: for a failure, the fault that was in effect while it
    ran and that its error names (a stream sent just before a kill dies of it); otherwise the
    phase it was sent in."""
    if o.result == "failed":
        for p in phases:
            if names(p, o) and o.sent < p.ended and o.ended >= p.started:
                return p
    for p in phases:
        if p.started <= o.sent < p.ended:
            return p
    return None


def summarize(outcomes: list[Outcome], phases: list[Phase],
              duplicates: set[str]) -> list[Row]:
    rows = []
    for p in [*phases, None]:
        mine = [o for o in outcomes if phase_of(o, phases) is p]
        failed = [o for o in mine if o.result == "failed"]
        elsewhere = [f"{o.rid} {o.code}: {o.message}" for o in failed
                     if p is None or not names(p, o)]
        retries = 0
        if p is not None:
            retries = sum(p.retries_after.values()) - sum(p.retries_before.values())
        rows.append(Row(
            name=p.name if p else "no fault (warm-up, recoveries)",
            instance=p.instance if p else "",
            sent=len(mine), succeeded=sum(o.result == "succeeded" for o in mine),
            failed=len(failed), lost=sum(o.result == "lost" for o in mine),
            duplicates=sum(o.rid in duplicates for o in mine),
            in_flight_at_fault=p.in_flight_at_fault if p else None,
            injected=p.injected if p else None, retries=retries,
            failures_elsewhere=elsewhere))
    return rows


def table(rows: list[Row], names: Callable[[str], str]) -> str:
    head = ("| phase | instance | sent | succeeded | failed (clean error) | lost | duplicates "
            "| in flight on it at the fault | faults it applied | retries by the proxy |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(f"| {r.name} | {names(r.instance)} | {r.sent} | {r.succeeded} | {r.failed} "
                     f"| {r.lost} | {r.duplicates} | "
                     f"{'' if r.in_flight_at_fault is None else r.in_flight_at_fault} | "
                     f"{'' if r.injected is None else r.injected} | {r.retries} |")
    total = [sum(getattr(r, k) for r in rows)
             for k in ("sent", "succeeded", "failed", "lost", "duplicates")]
    lines.append(f"| **total** | | {total[0]} | {total[1]} | {total[2]} | {total[3]} | "
                 f"{total[4]} | | | {sum(r.retries for r in rows)} |")
    return head + "\n".join(lines) + "\n"
