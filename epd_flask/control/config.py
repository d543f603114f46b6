"""Process-level settings from the environment (the roster holds the fleet-level ones).

Environment variables are how gunicorn deployments, systemd units and containers configure a
process. ``ProxyConfig`` is the worker's typed view of them, generated from the declarations
in ``settings.py``: one attribute per variable the app reads (``EnvVar.attribute``), with its
declared type and default, plus the checks that span several variables. Light on purpose (no
``ssl``): the files named here are opened by the worker that uses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field, make_dataclass
from types import MappingProxyType
from typing import Any

from epd_flask.control import settings
from epd_flask.control.roster import TENANT_NAME


class _Checks:
    """What a generated ``ProxyConfig`` does beyond holding values: the checks that span
    several variables, and the serving keys of ``EPD_API_KEYS_FILE`` joined to
    ``api_keys`` (in the constructor, so a config built from keyword arguments gets them
    too), with the tenant each key of the file names (``key_tenants``)."""

    admin_api_key: str | None
    api_keys: tuple[str, ...]
    #: The tenant a serving key belongs to, for the keys the file names one for
    #: (docs/behaviour.md#admission).
    key_tenants: Mapping[str, str]
    api_keys_file: str | None
    admin_prefix: str
    upstream_client_cert: str | None
    upstream_client_key: str | None
    otel_bsp_max_export_batch_size: int
    otel_bsp_max_queue_size: int

    def __post_init__(self) -> None:
        tenants: dict[str, str] = {}
        if self.api_keys_file:
            entries = _file_keys(self.api_keys_file)
            object.__setattr__(self, "api_keys", tuple(dict.fromkeys(
                (*self.api_keys, *(key for key, _ in entries)))))
            tenants = {key: tenant for key, tenant in entries if tenant}
        object.__setattr__(self, "key_tenants", MappingProxyType(tenants))
        object.__setattr__(self, "admin_prefix", self.admin_prefix.strip())
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
        if self.otel_bsp_max_export_batch_size > self.otel_bsp_max_queue_size:
            raise ValueError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE must not exceed "
                             "OTEL_BSP_MAX_QUEUE_SIZE")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Any:
        """Every variable the app reads, as declared; a bad one raises ValueError naming it."""
        return cls(**{v.attribute: v.read(environ) for v in APP_VARS})


def _file_keys(path: str) -> list[tuple[str, str | None]]:
    """Serving keys mounted from a secret: one per line, ``#`` comments; a line may name the
    key's tenant after it (``<key> <tenant>``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ValueError(f"EPD_API_KEYS_FILE {path} cannot be read: "
                         f"{exc.strerror or exc}") from None
    entries: list[tuple[str, str | None]] = []
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2 or (len(words) == 2 and not TENANT_NAME.fullmatch(words[1])):
            # Never quote the line: it holds a key.
            raise ValueError(f"EPD_API_KEYS_FILE {path} line {number}: expected '<key>' or "
                             "'<key> <tenant>' (a tenant name is 1 to 64 letters, digits and "
                             "'_.:-')")
        entries.append((words[0], words[1] if len(words) == 2 else None))
    return entries


def _annotation(var: settings.EnvVar) -> Any:
    kind: Any = tuple[str, ...] if var.type is tuple else var.type
    return kind | None if var.default_value({}) is None else kind


#: The environment variables each worker's app reads, in declaration order.
APP_VARS = tuple(v for v in settings.ENV.values() if settings.APP in v.read_by)

ProxyConfig = make_dataclass(
    "ProxyConfig",
    [(v.attribute, _annotation(v), field(default=v.default_value({}))) for v in APP_VARS],
    bases=(_Checks,), frozen=True,
)
ProxyConfig.__module__ = __name__
ProxyConfig.__doc__ = ("The environment as each worker's app reads it, one attribute per "
                       "declared variable (settings.py).")
