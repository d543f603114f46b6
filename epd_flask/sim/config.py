"""What one simulated vLLM server is (role, model, fleet secret) and how it behaves
(latency, sizes).

Only the knobs listed in ``LIVE_KNOBS`` may change while the server runs; the rest define the
server's identity and would make its earlier answers lie (a new engine id, a new port).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from . import kvevents
from .batch import POLICIES as SCHEDULING_POLICIES
from .kvcache import DEFAULT_BLOCK_SIZE

ROLES = ("encode", "prefill", "decode", "prefill_decode")
EC_METADATA_MODES = ("grid", "empty")
#: NIXL (prefill answers handles), Mooncake (the router makes them), Example (shared files:
#: no handles at all, KV found by prompt).
KV_CONNECTORS = ("nixl", "mooncake", "example")
VLLM_VERSION = "0.32.0"
DEFAULT_MODEL = "tiny-llama"
DEFAULT_SECRET = "epd-sim"
DEFAULT_SIDE_CHANNEL_PORT = 5600
#: uvicorn's keep-alive, as vLLM sets it (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, default 5 s).
DEFAULT_KEEPALIVE_TIMEOUT = 5.0

#: Knobs that ``SimState.configure`` and ``POST /sim/config`` may change on a running server.
LIVE_KNOBS = frozenset(
    {"ttft", "token_delay", "output_tokens", "max_model_len", "ec_metadata", "model",
     "record_health", "kv_timeout", "prefill_tokens_per_s", "token_delay_per_stream",
     "token_delay_per_context_token", "kv_cache_blocks", "block_size", "kv_events_config",
     "kv_params_extra", "kv_params_omit", "max_num_seqs", "scheduling_policy"}
)
#: The prefix cache's default size in blocks: thousands of distinct prompts.
DEFAULT_KV_CACHE_BLOCKS = 65536


@dataclass
class SimConfig:
    """Everything that shapes one simulated server; ``SimServer`` copies it before starting."""

    role: str = "prefill_decode"
    host: str = "127.0.0.1"
    port: int = 0
    model: str = DEFAULT_MODEL
    max_model_len: int = 512
    ttft: float = 0.0
    token_delay: float = 0.0
    output_tokens: int = 16
    secret: str = DEFAULT_SECRET
    # None: a fresh uuid4 every time a SimServer is built, as a restarted vLLM gets one.
    engine_id: str | None = None
    dp_size: int = 1
    # None: no Mooncake bootstrap server; 0: one on an ephemeral port.
    bootstrap_port: int | None = None
    # None: "mooncake" when there is a bootstrap port, else "nixl".
    kv_connector: str | None = None
    # vLLM's --enable-prompt-tokens-details: off by default, and then usage always has
    # "prompt_tokens_details": null, prefix-cache hits or not.
    prompt_tokens_details: bool = False
    record_limit: int = 200
    # "grid": plausible image_grid_thw metadata; "empty": {} like real LLaVA.
    ec_metadata: str = "grid"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # Probes would otherwise flood the bounded request record and push out completions.
    record_health: bool = False
    # A Mooncake decode waits this long for its KV before failing the request with a 500.
    kv_timeout: float = 30.0
    # Close a connection idle this long after its last response, as vLLM does; 0: never.
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    # Serve https with this certificate chain and key (PEM files); with tls_client_ca, also
    # require a client certificate signed by that CA (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # vLLM serves /start_profile and /stop_profile only when started with a profiler
    # configured; without one both are 404.
    profiler: bool = False
    # The cost model (costmodel.py), off at 0: prefill throughput in uncached prompt tokens
    # per second, shared by the server's concurrent prefills.
    prefill_tokens_per_s: float = 0.0
    # With the cost model: added to token_delay for each other stream running.
    token_delay_per_stream: float = 0.0
    # With the cost model: added to token_delay for each token of context (prompt and answer)
    # the other running streams hold, whose KV every decode step reads.
    token_delay_per_context_token: float = 0.0
    # The prefix cache's capacity in blocks, least recently used evicted first.
    kv_cache_blocks: int = DEFAULT_KV_CACHE_BLOCKS
    # Tokens per prefix-cache block (vLLM's --block-size); KV events carry blocks this long.
    block_size: int = DEFAULT_BLOCK_SIZE
    # vLLM's --kv-events-config (JSON text or object); None, or events disabled: no events.
    # Kept completed with vLLM's defaults (kvevents.parse_config).
    kv_events_config: dict[str, Any] | None = None
    # A NIXL prefill's handles as another vLLM release might answer them: keys added (set to
    # these values) and keys left out.
    kv_params_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    kv_params_omit: list[str] = dataclasses.field(default_factory=list)
    # vLLM's --max-num-seqs (0: no bound) and --scheduling-policy: how many requests run at
    # once, and in which order the others wait (batch.py).
    max_num_seqs: int = 0
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.record_limit < 0:
            raise ValueError(f"record_limit must be >= 0, got {self.record_limit}")
        if self.keepalive_timeout < 0:
            raise ValueError(f"keepalive_timeout must be >= 0, got {self.keepalive_timeout}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        if self.kv_connector is None:
            self.kv_connector = "mooncake" if self.bootstrap_port is not None else "nixl"
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}")
        for name in LIVE_KNOBS:
            setattr(self, name, coerce_knob(name, getattr(self, name)))

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    def with_engine_id(self) -> SimConfig:
        """A copy whose engine id is fixed, so a restart (new SimServer) gets a new one."""
        return dataclasses.replace(self, engine_id=self.engine_id or str(uuid.uuid4()))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _non_negative_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _int_at_least(name: str, value: Any, floor: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < floor:
        raise ValueError(f"{name} must be >= {floor}, got {value!r}")
    return value


def coerce_knob(name: str, value: Any) -> Any:
    """Check one live knob's value; raises ValueError with a message fit for an HTTP 400."""
    if name in ("ttft", "token_delay", "kv_timeout", "prefill_tokens_per_s",
                "token_delay_per_stream", "token_delay_per_context_token"):
        return _non_negative_float(name, value)
    if name == "output_tokens":
        return _int_at_least(name, value, 0)
    if name in ("kv_cache_blocks", "block_size"):
        return _int_at_least(name, value, 1)
    if name == "kv_events_config":
        return kvevents.parse_config(value)
    if name == "max_model_len":
        return _int_at_least(name, value, 1)
    if name == "max_num_seqs":
        return _int_at_least(name, value, 0)
    if name == "scheduling_policy":
        if value not in SCHEDULING_POLICIES:
            raise ValueError("scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        return value
    if name == "ec_metadata":
        if value not in EC_METADATA_MODES:
            raise ValueError(f"ec_metadata must be one of {', '.join(EC_METADATA_MODES)}")
        return value
    if name == "model":
        if not isinstance(value, str) or not value:
            raise ValueError("model must be a non-empty string")
        return value
    if name == "kv_params_extra":
        if not isinstance(value, dict):
            raise ValueError("kv_params_extra must be a JSON object")
        return dict(value)
    if name == "kv_params_omit":
        if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
            raise ValueError("kv_params_omit must be a list of key names")
        return list(value)
    if name == "record_health":
        if not isinstance(value, bool):
            raise ValueError("record_health must be a boolean")
        return value
    raise ValueError(f"unknown or not live-changeable knob {name!r}")
