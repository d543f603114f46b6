"""Process-level settings from the environment (the roster holds the fleet-level ones).

Environment variables are how gunicorn deployments, systemd units and containers configure a
process; each is declared (type, default, check) in ``settings.py``, and this is the worker's
typed view of them, with the checks that span several variables. Light on purpose (no
``ssl``): the files named here are opened by the worker that uses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from epd_flask.control import settings
from epd_flask.control.settings import default, read


@dataclass(frozen=True)
class ProxyConfig:
    roster_path: str = default("EPD_ROSTER")
    max_body_bytes: int = default("EPD_MAX_BODY_BYTES")
    pool_maxsize: int = default("EPD_POOL_MAXSIZE")
    max_in_flight: int = settings.ENV["EPD_MAX_IN_FLIGHT"].default_value({})
    # A stopping worker closes a kept-alive client connection once it has been idle this long.
    drain_idle_grace: float = default("EPD_DRAIN_IDLE_GRACE")
    admin_api_key: str | None = None
    # Sent as "Authorization: Bearer <key>" to prefill and decode instead of the client's own
    # header. An environment variable, not a roster key: the roster is rewritten by the admin
    # API and shown to operators, a secret should be neither.
    backend_api_key: str | None = None
    # Upstream connections and TLS (docs/behaviour.md#transport).
    upstream_idle_timeout: float = default("EPD_UPSTREAM_IDLE_TIMEOUT")
    upstream_keepalive: bool = default("EPD_UPSTREAM_KEEPALIVE")
    upstream_ca_bundle: str | None = None
    upstream_client_cert: str | None = None
    upstream_client_key: str | None = None
    # Edge.
    api_keys: tuple[str, ...] = ()
    max_json_depth: int = default("EPD_MAX_JSON_DEPTH")
    admin_prefix: str = ""
    # What upstream answers may cost a worker.
    max_event_bytes: int = default("EPD_MAX_EVENT_BYTES")
    max_upstream_body_bytes: int = default("EPD_MAX_UPSTREAM_BODY_BYTES")
    # How long a client may take to send its request body.
    body_timeout: float = default("EPD_BODY_TIMEOUT")
    # Which URLs may be registered as instances (SSRF guard for the admin API).
    instance_schemes: tuple[str, ...] = default("EPD_INSTANCE_SCHEMES")
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
    log_format: str = default("EPD_LOG_FORMAT")
    log_upstream: bool = default("EPD_LOG_UPSTREAM")
    state_dir: str | None = None
    # GET /debug/worker: this worker's greenlets, connections and memory (leak checks, chaos).
    debug_endpoints: bool = default("EPD_DEBUG_ENDPOINTS")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProxyConfig:
        return cls(
            roster_path=read("EPD_ROSTER", environ),
            max_body_bytes=read("EPD_MAX_BODY_BYTES", environ),
            pool_maxsize=read("EPD_POOL_MAXSIZE", environ),
            max_in_flight=read("EPD_MAX_IN_FLIGHT", environ),
            drain_idle_grace=read("EPD_DRAIN_IDLE_GRACE", environ),
            admin_api_key=read("ADMIN_API_KEY", environ),
            backend_api_key=read("EPD_BACKEND_API_KEY", environ),
            upstream_idle_timeout=read("EPD_UPSTREAM_IDLE_TIMEOUT", environ),
            upstream_keepalive=read("EPD_UPSTREAM_KEEPALIVE", environ),
            upstream_ca_bundle=read("EPD_UPSTREAM_CA_BUNDLE", environ),
            upstream_client_cert=read("EPD_UPSTREAM_CLIENT_CERT", environ),
            upstream_client_key=read("EPD_UPSTREAM_CLIENT_KEY", environ),
            api_keys=_api_keys(environ),
            max_json_depth=read("EPD_MAX_JSON_DEPTH", environ),
            max_event_bytes=read("EPD_MAX_EVENT_BYTES", environ),
            max_upstream_body_bytes=read("EPD_MAX_UPSTREAM_BODY_BYTES", environ),
            body_timeout=read("EPD_BODY_TIMEOUT", environ),
            admin_prefix=read("EPD_ADMIN_PREFIX", environ).strip(),
            instance_schemes=read("EPD_INSTANCE_SCHEMES", environ),
            instance_networks=read("EPD_INSTANCE_NETWORKS", environ),
            log_format=read("EPD_LOG_FORMAT", environ),
            log_upstream=read("EPD_LOG_UPSTREAM", environ),
            state_dir=read("EPD_STATE_DIR", environ),
            debug_endpoints=read("EPD_DEBUG_ENDPOINTS", environ),
        )


def _api_keys(environ: Mapping[str, str] | None) -> tuple[str, ...]:
    """Serving keys from EPD_API_KEYS (comma-separated) and/or EPD_API_KEYS_FILE (one per
    line, ``#`` comments), the latter for keys mounted from a secret."""
    keys = list(read("EPD_API_KEYS", environ))
    path = read("EPD_API_KEYS_FILE", environ)
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise ValueError(f"EPD_API_KEYS_FILE {path} cannot be read: "
                             f"{exc.strerror or exc}") from None
        keys += [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    return tuple(dict.fromkeys(keys))
