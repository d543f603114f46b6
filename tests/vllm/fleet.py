"""Real processes for the vLLM tier: `vllm serve` servers (CPU build, tiny models) in the
topologies the proxy supports, and epd-flask under gunicorn in front of them.

Every process starts in its own session (its pid is its process group) and leaves a pid file
in ``$EPD_VLLM_HOME/run``, so `reap.py` (the Makefile's exit trap) can end whatever a killed run
left behind. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import requests
import yaml

from tests.helpers import eventually
from tests.rosters import roster
from tests.vllm import reap
from tests.vllm.reap import group_alive, group_members

ROOT = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("EPD_VLLM_HOME", Path.home() / ".cache" / "epd-flask" / "vllm"))
VENV = HOME / "venv"
MODELS = HOME / "models"
RUN_DIR = HOME / "run"
LOG_DIR = HOME / "logs"
MODEL_NAME = "tiny-llama"
#: Observed 19-49 s with two servers sharing the two cores; the cap only bounds a broken start.
VLLM_START_SECONDS = float(os.environ.get("EPD_VLLM_START_SECONDS", "300"))
GUNICORN_START_SECONDS = 30.0
STOP_GRACE_SECONDS = 30.0
#: After SIGKILL the kernel still frees a worker's gigabytes; this only bounds a stuck exit.
KILL_WAIT_SECONDS = 30.0
REAP_SECONDS = 5.0
POLL_SECONDS = 0.5
#: vLLM's CPU default block is 128 tokens; 32 lets short prompts fill whole KV blocks.
COMMON_ARGS = ("--max-model-len", "512", "--enforce-eager", "--block-size", "32")
#: Real vLLM runs below the shell and the test client so the 2-core machine stays usable.
NICE = 10


#: Where three servers share the two cores (Mooncake and NIXL routing), the decode's core is
#: its own.
#: While a request waits for remote KV the decode's engine steps without pause and its worker
#: spins on sched_yield between steps (vLLM's shared-memory queue busy-polls for 1 s after
#: each read), so a prefill pinned to the same core gets next to no CPU: the decode waited for
#: KV that prefill could not compute or send until the client gave up (its prefill leg took
#: 123.7 s, and finished 0.3 s after its worker was moved to the other core by hand).
DECODE_CORE = 1
PREFILL_CORE = 0


def vllm_env(core: int) -> dict[str, str]:
    """The environment every server needs here (facts from shared/realvllm/README.md)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Every socket on loopback, not the VM's interface address.
        "VLLM_HOST_IP": "127.0.0.1",
        "UCX_NET_DEVICES": "lo",
        # Read by our patch of NIXL: its progress thread otherwise busy-polls a whole core.
        "NIXL_PTHR_DELAY_US": "1000",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }


class Process:
    """One started process group with its log and pid file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str,
                 cwd: Path = ROOT) -> None:
        self.name = name
        self.url = url
        self.log = LOG_DIR / f"{name}.log"
        self.pid_file = RUN_DIR / f"{name}.pid"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self.healthy_after: float | None = None
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.pid_file.write_text(str(self.proc.pid))

    def poll_healthy(self, path: str = "/health") -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            ok = requests.get(self.url + path, timeout=2).status_code == 200
        except requests.RequestException:
            return False
        if ok and self.healthy_after is None:
            self.healthy_after = time.monotonic() - self.started_at
        return ok

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, grace: float | None = None) -> str | None:
        """End the whole group and reap its leader, never raising: a server that outlived its
        grace once left its topology half-stopped and still marked running, so every test of
        the next module errored at setup. Gives what was out of the ordinary, if anything;
        the pid file stays while the group lives on, for the reaper."""
        note = end_group(self.proc, STOP_GRACE_SECONDS if grace is None else grace)
        if not group_alive(self.proc.pid):
            try:
                self.proc.wait(REAP_SECONDS)  # it has ended: only its exit status is left
            except subprocess.TimeoutExpired:
                note = f"{note or 'ended'}; no exit status within {REAP_SECONDS:.0f} s"
            self.pid_file.unlink(missing_ok=True)
        return None if note is None else f"{self.name}: {note}"


def end_group(proc: subprocess.Popen[bytes], grace: float) -> str | None:
    """SIGTERM the group ``proc`` leads (vLLM's API server, EngineCore, workers); SIGKILL it
    if anything outlives ``grace``; then wait, bounded, until it is empty. Gives what
    happened when SIGTERM alone did not end it."""
    pgid = proc.pid

    def gone() -> bool:
        proc.poll()  # reaps the leader: until then it is a member of its group
        return not group_alive(pgid)
    if gone():
        return None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if eventually(gone, grace, interval=POLL_SECONDS):
        return None
    left = members(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if eventually(gone, KILL_WAIT_SECONDS, interval=POLL_SECONDS):
        return f"outlived SIGTERM by {grace:.0f} s ({left}): killed"
    return f"still running {KILL_WAIT_SECONDS:.0f} s after SIGKILL: {members(pgid)}"


def members(pgid: int) -> str:
    return ", ".join(f"{pid} {state} {cmd}" for pid, state, cmd in group_members(pgid)) \
        or "none"


def wait_healthy(procs: list[Process], seconds: float, path: str = "/health") -> None:
    pending = list(procs)

    def healthy() -> bool:
        pending[:] = [p for p in pending if not p.poll_healthy(path)]
        return not pending
    eventually(healthy, seconds, interval=POLL_SECONDS,
               what=lambda: "healthy: " + ", ".join(p.name for p in pending) + "\n"
               + "\n".join(p.tail(1500) for p in pending))


@dataclass
class VllmServer:
    """A started `vllm serve`, with what the tests need to know about it."""

    process: Process
    role: str
    side_channel_port: int | None = None
    bootstrap_port: int | None = None
    #: Where it publishes KV-cache events (``--kv-events-config``), if it does.
    kv_events_port: int | None = None
    #: Where a Mooncake EC consumer takes pushed embeddings (``ec_port``), if it does.
    ec_control_port: int | None = None

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def bootstrap_url(self) -> str | None:
        return None if self.bootstrap_port is None else f"http://127.0.0.1:{self.bootstrap_port}"

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels except the ones kept in the key."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        return parse_metrics(text)

    def log_text(self) -> str:
        return self.process.log_text()


def parse_metrics(text: str) -> dict[str, float]:
    """``name{source="x"}`` keeps only a ``source`` label; other labels (model, engine) are
    summed away, which is enough for one-model, one-engine servers."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match is None:
            continue
        name, labels, value = match.groups()
        source = re.search(r'source="([^"]*)"', labels or "")
        key = f'{name}{{source="{source.group(1)}"}}' if source else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


#: Ports handed to vLLM servers come from below Linux's ephemeral range (32768-60999). A port
#: the kernel gave for bind(0) goes back to that pool at once, and with four servers booting
#: (each opening its own ZMQ and gloo sockets) another socket took one before its server bound
#: it ("Address already in use" on a NIXL side channel).
_PORTS = iter(random.Random().sample(range(20000, 32000), 4000))


def vllm_port() -> int:
    """A free loopback port no earlier call of this process handed out."""
    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port left below the ephemeral range")


def start_vllm(name: str, role: str, core: int, model: str = "tiny-llama",
               args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               served_name: str = MODEL_NAME, nice: int = NICE, **ports: int) -> VllmServer:
    port = vllm_port()
    argv = ["nice", "-n", str(nice), str(VENV / "bin" / "vllm"), "serve", str(MODELS / model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
            *COMMON_ARGS, *args]
    process = Process(name, argv, {**vllm_env(core), **(env or {})}, f"http://127.0.0.1:{port}")
    return VllmServer(process, role, **ports)


def kv_config(connector: str, role: str, extra: dict[str, Any] | None = None) -> str:
    doc: dict[str, Any] = {"kv_connector": connector, "kv_role": role,
                           "kv_buffer_device": "cpu"}
    if extra:
        doc["kv_connector_extra_config"] = extra
    return json.dumps(doc)


def ec_config(role: str, store: Path) -> str:
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": role,
                       "ec_buffer_device": "cpu",
                       "ec_connector_extra_config": {"shared_storage_path": str(store)}})


def traced(traces: str | None, service: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The arguments and environment of a server that sends its spans to the OTLP/HTTP
    ``traces`` URL (none: no tracing), as ``service``; vLLM's exporter speaks gRPC unless
    told otherwise, and batches for 5 s unless told otherwise."""
    if traces is None:
        return (), {}
    return ("--otlp-traces-endpoint", traces), {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "200"}


def _nixl(traces: str | None = None) -> list[VllmServer]:
    servers = []
    for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
        side = vllm_port()
        args, env = traced(traces, f"vllm-{name}")
        servers.append(start_vllm(
            f"nixl-{name}", name, core, args=("--kv-transfer-config", kv_config(
                "NixlConnector", role), *args),
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), **env}, side_channel_port=side))
    return servers


def _mooncake() -> list[VllmServer]:
    servers = []
    extra = {"mooncake_protocol": "tcp"}
    for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
        boot = vllm_port()
        servers.append(start_vllm(
            f"mooncake-{name}", name, core, args=("--kv-transfer-config", kv_config(
                "MooncakeConnector", role, extra)),
            env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)}, bootstrap_port=boot))
    return servers


def _example() -> list[VllmServer]:
    store = HOME / "kvstore"
    store.mkdir(parents=True, exist_ok=True)
    extra = {"shared_storage_path": str(store)}
    return [
        start_vllm(f"example-{name}", name, core, args=("--kv-transfer-config", kv_config(
            "ExampleConnector", role, extra)))
        for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1))
    ]


def _encoder() -> list[VllmServer]:
    store = HOME / "ecstore"
    store.mkdir(parents=True, exist_ok=True)
    mm = ("--limit-mm-per-prompt", '{"image":1}')
    return [
        start_vllm("ec-encode", "encode", 0, model="tiny-llava",
                   args=(*mm, "--mm-encoder-only", "--ec-transfer-config",
                         ec_config("ec_producer", store))),
        # DEBUG: the EC connector logs a consumer's load of a stored embedding only there.
        start_vllm("ec-lm", "prefill_decode", 1, model="tiny-llava",
                   args=(*mm, "--ec-transfer-config", ec_config("ec_consumer", store)),
                   env={"VLLM_LOGGING_LEVEL": "DEBUG"}),
    ]


#: The registered memory each Mooncake EC side holds for embeddings (vLLM's default is 1 GB).
EC_BUFFER_BYTES = 64 * 1024 * 1024
#: How long a consumer waits for a push it was promised before failing the request (vLLM: 60).
EC_PUSH_WAIT_SECONDS = 8
#: A vLLM server with work in flight spins: its EngineCore and worker poll each other between
#: steps (~100 clock ticks a second each). While the Mooncake E+P+D cases run, the prefill is
#: kept computing and the decode waits for the KV, so both spin, and the encoder (its encoding,
#: then its push) is what all of them wait for. At the same niceness it starved: with the
#: encoder sharing the busy prefill's core, its three processes got 0-2 ticks a second through
#: a 10.2 s encode; ahead of the others, encodes took 36-118 ms after the first (1.7 s).
ENCODER_NICE = 5


def ec_mooncake_config(role: str, port: int | None = None) -> str:
    """ECMooncakeConnector over TCP with host buffers; a consumer listens for pushes on
    ``port`` (its replica 0's control address, ``tcp://127.0.0.1:<port>``) and gives up on
    a push after ``EC_PUSH_WAIT_SECONDS``."""
    doc: dict[str, Any] = {"ec_connector": "ECMooncakeConnector", "ec_role": role,
                           "ec_buffer_device": "cpu", "ec_buffer_size": EC_BUFFER_BYTES,
                           "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}
    if port is not None:
        doc |= {"ec_ip": "127.0.0.1", "ec_port": port}
        doc["ec_connector_extra_config"]["push_wait_timeout_s"] = EC_PUSH_WAIT_SECONDS
    return json.dumps(doc)


def _ec_mooncake() -> list[VllmServer]:
    """E+P+D with pushed embeddings: a tiny LLaVA encoder-only server pushes each image's
    embedding to the prefill (ECMooncakeConnector consumer), which hands the KV to the decode
    (MooncakeConnector). Three servers on two cores; the encoder runs ahead of the others
    (``ENCODER_NICE``)."""
    mm = ("--limit-mm-per-prompt", '{"image":1}')
    kv_extra = {"mooncake_protocol": "tcp"}
    control, boot = vllm_port(), vllm_port()
    return [
        start_vllm("ec-mooncake-encode", "encode", 0, model="tiny-llava",
                   args=(*mm, "--mm-encoder-only", "--ec-transfer-config",
                         ec_mooncake_config("ec_producer")), nice=ENCODER_NICE),
        start_vllm("ec-mooncake-prefill", "prefill", 1, model="tiny-llava",
                   args=(*mm, "--ec-transfer-config", ec_mooncake_config("ec_consumer", control),
                         "--kv-transfer-config", kv_config("MooncakeConnector", "kv_producer",
                                                           kv_extra)),
                   env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)}, bootstrap_port=boot,
                   ec_control_port=control),
        start_vllm("ec-mooncake-decode", "decode", 0, model="tiny-llava",
                   args=(*mm, "--kv-transfer-config", kv_config("MooncakeConnector",
                                                                "kv_consumer", kv_extra))),
    ]


#: The second model of the multi-model topology, and the LoRA adapter of the first.
SECOND_MODEL = "tiny-llama-b"
LORA_NAME = "tiny-lora"
#: Runtime LoRA loading on the first pair: vLLM serves /v1/load_lora_adapter only with it.
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1")


def _models() -> list[VllmServer]:
    """Two NIXL P/D pairs serving different models: tiny-llama (LoRA enabled, adapters loaded
    at run time) and tiny-llama-b. Four servers: ~6 GB of RAM; each core runs one of each."""
    servers = []
    for pair, model, extra in (("a", "tiny-llama", LORA_ARGS), ("b", SECOND_MODEL, ())):
        for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
            side = vllm_port()
            servers.append(start_vllm(
                f"models-{pair}-{name}", name, core, model=model, served_name=model,
                args=("--kv-transfer-config", kv_config("NixlConnector", role), *extra),
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True" if extra else "False"},
                side_channel_port=side))
    return servers


#: Prefix caching on (and reported per request), KV-cache events on a ZMQ PUB socket.
def kv_events_args(port: int) -> tuple[str, ...]:
    return ("--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{port}", "topic": "kv"}))


def _nixl_with_events(prefix: str,
                      members: tuple[tuple[str, str, str, int, bool], ...]) -> list[VllmServer]:
    """NIXL servers, each ``(name, role, kv_role, core, publishes KV-cache events)``."""
    servers = []
    for name, role, kv_role, core, publishes in members:
        side = vllm_port()
        events = vllm_port() if publishes else None
        servers.append(start_vllm(
            f"{prefix}-{name}", role, core,
            args=("--kv-transfer-config", kv_config("NixlConnector", kv_role),
                  *(kv_events_args(events) if events else ())),
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}, side_channel_port=side,
            **({"kv_events_port": events} if events else {})))
    return servers


def _kv() -> list[VllmServer]:
    """Two NIXL prefills that publish KV-cache events, and one decode: kv_aware routing's
    fleet. Three servers on two cores (~4.5 GB): the prefills share one, the decode has the
    other (``DECODE_CORE``; a prefill beside it sent no KV while it waited for it)."""
    return _nixl_with_events("kv", (("prefill-a", "prefill", "kv_producer", PREFILL_CORE, True),
                                    ("prefill-b", "prefill", "kv_producer", PREFILL_CORE, True),
                                    ("decode", "decode", "kv_consumer", DECODE_CORE, False)))


def _kv_decode() -> list[VllmServer]:
    """One NIXL prefill and one decode with prefix caching that publishes KV-cache events:
    the decode keeps the KV a prefill sent it (selective disaggregation on what it holds)."""
    return _nixl_with_events("kv-decode", (("prefill", "prefill", "kv_producer", 0, False),
                                           ("decode", "decode", "kv_consumer", 1, True)))


def _mooncake_pair() -> list[VllmServer]:
    """Two Mooncake prefills with prefix caching (each reporting its cached tokens) and one
    decode: routing among Mooncake's (prefill, rank) pairs. Three servers on two cores: the
    prefills share one, which neither waits on the other for, and the decode has the other
    (``DECODE_CORE``)."""
    servers = []
    extra = {"mooncake_protocol": "tcp"}
    for name, role, kv_role, core in (("prefill-a", "prefill", "kv_producer", PREFILL_CORE),
                                      ("prefill-b", "prefill", "kv_producer", PREFILL_CORE),
                                      ("decode", "decode", "kv_consumer", DECODE_CORE)):
        boot = vllm_port()
        caching = ("--enable-prefix-caching", "--enable-prompt-tokens-details") \
            if role == "prefill" else ()
        servers.append(start_vllm(
            f"mooncake-pair-{name}", role, core,
            args=("--kv-transfer-config", kv_config("MooncakeConnector", kv_role, extra),
                  *caching),
            env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)}, bootstrap_port=boot))
    return servers


def _priority() -> list[VllmServer]:
    """One combined server that runs one request at a time and takes waiting ones lowest
    ``priority`` first (docs/behaviour.md#admission, forward_priority)."""
    return [start_vllm("priority-pd", "prefill_decode", 0, args=(
        "--scheduling-policy", "priority", "--max-num-seqs", "1"))]


TOPOLOGIES: dict[str, Callable[[], list[VllmServer]]] = {
    "nixl": _nixl,
    # The same pair, for a test that stops one of them: never shared with another module.
    "nixl-registered": _nixl,
    "mooncake": _mooncake,
    "mooncake-pair": _mooncake_pair,
    "example": _example,
    "encoder": _encoder,
    "ec-mooncake": _ec_mooncake,
    "models": _models,
    "kv": _kv,
    "kv-decode": _kv_decode,
    "priority": _priority,
}
#: The topologies that can run with vLLM's tracing on (``Fleet.up(name, traces=URL)``).
TRACED_TOPOLOGIES: dict[str, Callable[[str], list[VllmServer]]] = {"nixl": _nixl}


@dataclass
class Topology:
    name: str
    servers: list[VllmServer]
    started_in: float
    proxies: list[Process] = field(default_factory=list)

    def by_role(self, role: str) -> VllmServer:
        return next(s for s in self.servers if s.role == role)

    def stop(self) -> list[str]:
        """Every process is stopped, whatever the others did; gives their notes."""
        notes = (p.stop() for p in [*self.proxies, *(s.process for s in self.servers)])
        return [note for note in notes if note is not None]


class Fleet:
    """At most one topology alive at a time: each pair of servers takes ~3 GB of RAM."""

    def __init__(self) -> None:
        self.current: Topology | None = None
        self.timings: dict[str, float] = {}
        #: What stopping a topology found out of the ordinary (the tier's summary lists it).
        self.stop_notes: list[str] = []

    def up(self, name: str, traces: str | None = None) -> Topology:
        """Topology ``name``, started unless it runs already; with ``traces``, its servers
        send their spans to that OTLP/HTTP URL."""
        key = name if traces is None else f"{name}-traced"
        if self.current is not None and self.current.name == key:
            return self.current
        self.down()
        t0 = time.monotonic()
        servers = TOPOLOGIES[name]() if traces is None else TRACED_TOPOLOGIES[name](traces)
        try:
            wait_healthy([s.process for s in servers], VLLM_START_SECONDS)
        except BaseException:
            for s in servers:
                s.process.stop()
            raise
        self.current = Topology(key, servers, time.monotonic() - t0)
        self.timings[key] = self.current.started_in
        return self.current

    def down(self) -> None:
        """Stops the current topology; whatever way that goes, none is current afterwards and
        every group the tier recorded is ended (the reaper), so the next starts clean."""
        if self.current is None:
            return
        try:
            self.stop_notes += self.current.stop()
        finally:
            self.current = None
            self.stop_notes += [f"reaped {line}" for line in reap.reap(RUN_DIR)]

    def proxy(self, roster: dict[str, Any], workers: int = 1,
              env: dict[str, str] | None = None) -> Process:
        """epd-flask under gunicorn (gevent workers, the project's config) over ``roster``,
        with ``env`` added to its environment."""
        assert self.current is not None
        port = vllm_port()
        name = f"gunicorn-{self.current.name}-{len(self.current.proxies)}"
        roster_file = LOG_DIR / f"{name}.roster.yaml"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        roster_file.write_text(yaml.safe_dump(roster))
        proc = Process(name, [sys.executable, "-m", "gunicorn", "-c", "etc/gunicorn.conf.py",
                              "wsgi:app"],
                       {"EPD_ROSTER": str(roster_file), "PORT": str(port),
                        "EPD_WORKERS": str(workers), "EPD_LOG_LEVEL": "info", **(env or {})},
                       f"http://127.0.0.1:{port}")
        self.current.proxies.append(proc)
        try:
            wait_healthy([proc], GUNICORN_START_SECONDS, "/ready")
        except BaseException:
            proc.stop()
            self.current.proxies.remove(proc)
            raise
        return proc

    def proxied_pd(self, topology: str, connector: str) -> SimpleNamespace:
        """A prefill/decode topology with epd-flask in front, no retries (a test must see a
        failure as it happened): ``.prefill``, ``.decode`` and ``.proxy``."""
        top = self.up(topology)
        prefill, decode = top.by_role("prefill"), top.by_role("decode")
        proxy = self.proxy(roster([prefill], [decode], connector=connector, decode_retries=0))
        return SimpleNamespace(prefill=prefill, decode=decode, proxy=proxy)
