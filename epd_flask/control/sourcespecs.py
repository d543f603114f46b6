"""Which membership sources this build has and the shape of each one's roster entry: the one
line that adds a source (docs/behaviour.md#discovery).

The roster's ``discovery:`` mapping names sources by the keys of ``SOURCES``. The gunicorn
master validates rosters and must not import the workers' side (dnspython, the etcd client,
gevent), so a source is declared here as data: where its implementation lives (``module:Class``,
imported only by workers, as ``connectorspecs.py`` does for connectors) and the pydantic model
of its entry, which the master checks. pydantic only; imports nothing of ours.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The fields an instance found by a source may not be given by its ``instance:`` template:
#: the source itself says where the instance is and what it does.
OWN_FIELDS = ("role", "url")
#: Where ``{host}`` in an ``instance:`` template stands for the address found.
HOST = "{host}"
_HOSTNAME = re.compile(r"^(?=.{1,253}\.?$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*\.?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EtcdOptions(_Strict):
    """``discovery.etcd``: instances live under ``<prefix>instances/<id>``."""

    endpoints: tuple[str, ...] = Field(min_length=1)
    prefix: str

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for url in value:
            url = url.strip().rstrip("/")
            parts = urlsplit(url)
            try:
                parts.port  # noqa: B018 - raises ValueError for a port that is not a number
            except ValueError:
                raise ValueError(f"has an invalid port, got {url!r}") from None
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path:
                raise ValueError("each endpoint must be http://host:port or https://host:port "
                                 f"(etcd's client URL), got {url!r}")
            out.append(url)
        return tuple(out)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/") or len(value) < 2:
            raise ValueError("must start and end with '/' (e.g. /epd-flask/prod/), got "
                             f"{value!r}")
        if any(ord(c) < 0x21 or ord(c) == 0x7f for c in value):
            raise ValueError("must not contain spaces or control characters")
        return value


class DnsName(_Strict):
    """One ``discovery.dns`` entry: a name whose answer is the instances of one role."""

    name: str
    role: Literal["encode", "prefill", "decode", "prefill_decode"]
    port: int | None = Field(default=None, ge=1, le=65535)
    interval: float = Field(default=5.0, gt=0, le=3600)
    nameserver: str | None = None
    scheme: Literal["http", "https"] = "http"
    instance: dict[str, Any] = Field(default_factory=dict)

    @property
    def srv(self) -> bool:
        """An SRV name (``_service._proto.name``): host and port come from each record."""
        return self.name.startswith("_")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        value = value.strip()
        if not _HOSTNAME.match(value):
            raise ValueError(f"must be a DNS name, got {value!r}")
        return value

    @field_validator("nameserver")
    @classmethod
    def _nameserver(cls, value: str | None) -> str | None:
        if value is None:
            return None
        nameserver_address(value)
        return value

    @field_validator("instance")
    @classmethod
    def _template(cls, value: dict[str, Any]) -> dict[str, Any]:
        own = sorted(set(value) & set(OWN_FIELDS))
        if own:
            raise ValueError(f"must not set {', '.join(own)}: the entry's role and the "
                             "addresses found give them")
        return value

    @model_validator(mode="after")
    def _port(self) -> DnsName:
        if self.srv and self.port is not None:
            raise ValueError(f"{self.name} is an SRV name: its records give each instance's "
                             "port; remove port")
        if not self.srv and self.port is None:
            raise ValueError(f"{self.name} has A/AAAA records, which carry no port: give port "
                             "(or name an SRV record, _service._proto.name)")
        return self


def nameserver_address(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; the port defaults to 53) -> (address, port). A nameserver
    is an IP address: resolving its name would need a nameserver."""
    text = value.strip()
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"must be host:port, got {value!r}")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, tail = text.partition(":")
        if not tail.isdigit():
            raise ValueError(f"must be host:port, got {value!r}")
        port = int(tail)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"must be an IP address with an optional port, got {value!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1-65535, got {value!r}")
    return host, port


def render(template: Any, host: str) -> Any:
    """An ``instance:`` template with ``{host}`` replaced in every string (lists too). An IPv6
    address is bracketed: every field that names a host says ``host:port``."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    if isinstance(template, str):
        return template.replace(HOST, host)
    if isinstance(template, list | tuple):
        return [render(v, host) for v in template]
    if isinstance(template, dict):
        return {k: render(v, host) for k, v in template.items()}
    return template


@dataclass(frozen=True)
class SourceSpec:
    implementation: str  # "package.module:Class"
    options: Any  # the pydantic type of its ``discovery:`` entry


_HERE = "epd_flask.fleet.sources"

SOURCES: dict[str, SourceSpec] = {
    "etcd": SourceSpec(f"{_HERE}.etcdsource:EtcdSource", EtcdOptions),
    "dns": SourceSpec(f"{_HERE}.dnssource:DnsSource", tuple[DnsName, ...]),
}
