"""Which URLs may be registered as instances: a registered URL is a request the proxy will
make (with the clients' prompts), so registration is an SSRF surface.

Pure apart from name resolution (injectable); imports nothing of ours. The admin API calls
``check_instance_url`` before it accepts a registration.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]

#: Refused unless an allowed network explicitly contains them: cloud metadata services live
#: on link-local addresses (169.254.169.254), and nothing serves vLLM on these.
ALWAYS_REFUSED = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16", "fe80::/10", "0.0.0.0/8", "::/128", "224.0.0.0/4", "ff00::/8",
))


class URLPolicyError(ValueError):
    """The URL may not be registered; the message says why, for the admin client."""


@dataclass(frozen=True)
class URLPolicy:
    schemes: tuple[str, ...] = ("http", "https")
    networks: tuple[Network, ...] = ()

    @classmethod
    def build(cls, schemes: Iterable[str], networks: Iterable[str]) -> URLPolicy:
        try:
            nets = tuple(ipaddress.ip_network(n, strict=False) for n in networks)
        except ValueError as exc:
            raise ValueError(f"EPD_INSTANCE_NETWORKS: {exc}") from None
        wanted = tuple(s.lower() for s in schemes)
        bad = [s for s in wanted if s not in ("http", "https")]
        if bad:
            raise ValueError(f"EPD_INSTANCE_SCHEMES: only http and https exist, got {bad[0]!r}")
        return cls(wanted, nets)


def resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def check_instance_url(url: str, policy: URLPolicy, resolver: Resolver = resolve) -> None:
    """Raise ``URLPolicyError`` unless ``url`` may be registered under ``policy``.

    With allowed networks configured, every address the host resolves to must lie inside
    one of them (a name that also resolves elsewhere is refused). Names are resolved at
    registration time only; pin instances by address where DNS itself is not trusted.
    """
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise URLPolicyError(f"{url!r} is not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in policy.schemes:
        raise URLPolicyError(
            f"scheme {scheme or '(none)'!r} is not allowed for instances; allowed: "
            f"{', '.join(policy.schemes)}")
    if not parts.hostname:
        raise URLPolicyError(f"{url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise URLPolicyError("instance URLs must not carry credentials")
    if parts.query or parts.fragment:
        raise URLPolicyError("instance URLs must not carry a query or fragment")
    host = parts.hostname
    port = port or (443 if scheme == "https" else 80)
    addresses = _addresses(host, port, resolver)
    for addr in addresses:
        _check_address(host, addr, policy.networks)


def _addresses(host: str, port: int, resolver: Resolver) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        found = resolver(host, port)
    except OSError as exc:
        raise URLPolicyError(f"host {host!r} does not resolve: {exc}") from None
    if not found:
        raise URLPolicyError(f"host {host!r} does not resolve to any address")
    return [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]


def _check_address(host: str, addr: Address, networks: tuple[Network, ...]) -> None:
    mapped = getattr(addr, "ipv4_mapped", None)
    if mapped is not None:
        addr = mapped
    inside = any(addr.version == n.version and addr in n for n in networks)
    if inside:
        return
    if networks:
        raise URLPolicyError(
            f"host {host!r} ({addr}) is outside the networks instances may be registered "
            f"from: {', '.join(str(n) for n in networks)}")
    if any(addr.version == n.version and addr in n for n in ALWAYS_REFUSED):
        raise URLPolicyError(
            f"host {host!r} ({addr}) is a link-local, multicast or unspecified address; "
            "instances cannot be registered there")
