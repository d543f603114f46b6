"""Process-level settings from the environment (the roster holds the fleet-level ones).

Environment variables are how gunicorn deployments, systemd units and containers configure a
process; everything here has a default that works with ``make run``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from epd_flask.roster import roster_path

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_POOL_MAXSIZE = 1024


@dataclass(frozen=True)
class ProxyConfig:
    roster_path: str = "etc/roster.yaml"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    pool_maxsize: int = DEFAULT_POOL_MAXSIZE
    admin_api_key: str | None = None
    # Sent as "Authorization: Bearer <key>" to prefill and decode instead of the client's own
    # header. An environment variable, not a roster key: the roster is rewritten by the admin
    # API and shown to operators, a secret should be neither.
    backend_api_key: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProxyConfig:
        env = os.environ if environ is None else environ
        return cls(
            roster_path=roster_path(dict(env)),
            max_body_bytes=_int(env, "EPD_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
            pool_maxsize=_int(env, "EPD_POOL_MAXSIZE", DEFAULT_POOL_MAXSIZE),
            admin_api_key=env.get("ADMIN_API_KEY") or None,
            backend_api_key=env.get("EPD_BACKEND_API_KEY") or None,
        )


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
