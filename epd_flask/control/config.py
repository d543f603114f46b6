"""Process-level settings from the environment (the roster holds the fleet-level ones).

Environment variables are how gunicorn deployments, systemd units and containers configure a
process; everything here has a default that works with ``make run``. Light on purpose (no
``ssl``): the files named here are opened by the worker that uses them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from epd_flask.control.roster import roster_path
from epd_flask.control.statedir import STATE_DIR_ENV

#: The request log line's formats (``EPD_LOG_FORMAT``).
LOG_FORMATS = ("logfmt", "json")
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_POOL_MAXSIZE = 1024
#: Below vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) with a second to spare.
DEFAULT_UPSTREAM_IDLE_TIMEOUT = 4.0
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_INSTANCE_SCHEMES = ("http", "https")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
DEFAULT_WORKER_CONNECTIONS = 1000
#: The default in-flight cap leaves this share of gunicorn's worker_connections free, so a
#: worker at its cap still accepts connections to refuse quickly and to answer probes.
IN_FLIGHT_SHARE = 0.9

#: Seconds a kept-alive client connection must have been idle before a stopping worker closes
#: it. Closing one the client is just reusing loses that request ("closed without response"),
#: so connections that were busy a moment ago are left to gunicorn, which answers what arrives
#: on them with ``Connection: close``.
DEFAULT_DRAIN_IDLE_GRACE = 2.0

@dataclass(frozen=True)
class ProxyConfig:
    roster_path: str = "etc/roster.yaml"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    pool_maxsize: int = DEFAULT_POOL_MAXSIZE
    max_in_flight: int = int(DEFAULT_WORKER_CONNECTIONS * IN_FLIGHT_SHARE)
    # A stopping worker closes a kept-alive client connection once it has been idle this long.
    drain_idle_grace: float = DEFAULT_DRAIN_IDLE_GRACE
    admin_api_key: str | None = None
    # Sent as "Authorization: Bearer <key>" to prefill and decode instead of the client's own
    # header. An environment variable, not a roster key: the roster is rewritten by the admin
    # API and shown to operators, a secret should be neither.
    backend_api_key: str | None = None
    # Upstream connections (T7) and TLS (T5).
    upstream_idle_timeout: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT
    upstream_keepalive: bool = True
    upstream_ca_bundle: str | None = None
    upstream_client_cert: str | None = None
    upstream_client_key: str | None = None
    # Edge.
    api_keys: tuple[str, ...] = ()
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    admin_prefix: str = ""
    # Which URLs may be registered as instances (SSRF guard for the admin API).
    instance_schemes: tuple[str, ...] = DEFAULT_INSTANCE_SCHEMES
    instance_networks: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.admin_api_key and self.admin_api_key in self.api_keys:
            raise ValueError("ADMIN_API_KEY must not also be a serving key in EPD_API_KEYS; "
                             "give the admin API a key of its own")
        if any(not k for k in self.api_keys):
            raise ValueError("EPD_API_KEYS must not contain empty keys")
        if self.admin_prefix and (not self.admin_prefix.startswith("/")
                                  or self.admin_prefix.endswith("/")):
            raise ValueError(f"EPD_ADMIN_PREFIX must start with '/' and not end with one, "
                             f"got {self.admin_prefix!r}")
        if self.admin_prefix.startswith("/v1"):
            raise ValueError("EPD_ADMIN_PREFIX must not be under /v1, which nginx publishes")
        if self.upstream_client_key and not self.upstream_client_cert:
            raise ValueError("EPD_UPSTREAM_CLIENT_KEY needs EPD_UPSTREAM_CLIENT_CERT")
    log_format: str = "logfmt"
    log_upstream: bool = False
    state_dir: str | None = None
    # GET /debug/worker: this worker's greenlets, connections and memory (leak checks, chaos).
    debug_endpoints: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProxyConfig:
        env = os.environ if environ is None else environ
        return cls(
            roster_path=roster_path(dict(env)),
            max_body_bytes=_int(env, "EPD_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
            pool_maxsize=_int(env, "EPD_POOL_MAXSIZE", DEFAULT_POOL_MAXSIZE),
            max_in_flight=_int(env, "EPD_MAX_IN_FLIGHT", max(1, int(_int(
                env, "EPD_WORKER_CONNECTIONS", DEFAULT_WORKER_CONNECTIONS) * IN_FLIGHT_SHARE))),
            drain_idle_grace=_float(env, "EPD_DRAIN_IDLE_GRACE", DEFAULT_DRAIN_IDLE_GRACE),
            admin_api_key=env.get("ADMIN_API_KEY") or None,
            backend_api_key=env.get("EPD_BACKEND_API_KEY") or None,
            upstream_idle_timeout=_float(env, "EPD_UPSTREAM_IDLE_TIMEOUT",
                                         DEFAULT_UPSTREAM_IDLE_TIMEOUT),
            upstream_keepalive=_bool(env, "EPD_UPSTREAM_KEEPALIVE", True),
            upstream_ca_bundle=env.get("EPD_UPSTREAM_CA_BUNDLE") or None,
            upstream_client_cert=env.get("EPD_UPSTREAM_CLIENT_CERT") or None,
            upstream_client_key=env.get("EPD_UPSTREAM_CLIENT_KEY") or None,
            api_keys=_api_keys(env),
            max_json_depth=_int(env, "EPD_MAX_JSON_DEPTH", DEFAULT_MAX_JSON_DEPTH),
            admin_prefix=(env.get("EPD_ADMIN_PREFIX") or "").strip(),
            instance_schemes=_list(env, "EPD_INSTANCE_SCHEMES") or DEFAULT_INSTANCE_SCHEMES,
            instance_networks=_list(env, "EPD_INSTANCE_NETWORKS"),
            log_format=_choice(env, "EPD_LOG_FORMAT", LOG_FORMATS, "logfmt"),
            log_upstream=_bool(env, "EPD_LOG_UPSTREAM", False),
            state_dir=env.get(STATE_DIR_ENV) or None,
            debug_endpoints=_bool(env, "EPD_DEBUG_ENDPOINTS", False),
        )


def _api_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    """Serving keys from EPD_API_KEYS (comma-separated) and/or EPD_API_KEYS_FILE (one per
    line, ``#`` comments), the latter for keys mounted from a secret."""
    keys = list(_list(env, "EPD_API_KEYS"))
    path = env.get("EPD_API_KEYS_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise ValueError(f"EPD_API_KEYS_FILE {path} cannot be read: "
                             f"{exc.strerror or exc}") from None
        keys += [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    return tuple(dict.fromkeys(keys))


def _list(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in (env.get(name) or "").split(",") if s.strip())


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be one of on/off, true/false, 1/0; got {raw!r}")


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
