"""Which URLs may be registered as instances: a registered URL is a request the proxy will
make (with the clients' prompts), so registration is an SSRF surface. The addresses an
instance is given for its KV and EC transfers (``kv_zmq_addr``, ``ec_zmq_addrs``) are
connections the instances make on the proxy's word, and are held to the same rules.

Pure apart from name resolution and the is-this-address-mine test (both injectable); imports
nothing of ours. The admin API calls ``check_addresses`` before it accepts a registration,
and the membership sources before they offer a record (docs/behaviour.md#discovery).
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
IsLocal = Callable[[Address], bool]
Listener = tuple[str, int]

#: Refused unless an allowed network explicitly contains them: cloud metadata services live
#: on link-local addresses (169.254.169.254), and nothing serves vLLM on these.
ALWAYS_REFUSED = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16", "fe80::/10", "0.0.0.0/8", "::/128", "224.0.0.0/4", "ff00::/8",
))
#: IPv6 prefixes whose last 32 bits spell an IPv4 address another hop may connect to:
#: IPv4-compatible (deprecated, ::a.b.c.d) and NAT64 (RFC 6052's well-known prefix, RFC 8215's
#: local-use one at its common /96 length).
IPV4_EMBEDDED = tuple(ipaddress.ip_network(n) for n in (
    "::/96", "64:ff9b::/96", "64:ff9b:1::/48",
))
#: Schemes a transfer address may be written with (ZeroMQ's TCP endpoints); none means TCP.
TRANSFER_SCHEMES = ("tcp",)


class URLPolicyError(ValueError):
    """The URL may not be registered; the message says why, for the admin client."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        #: The record's field that holds the refused address, when one is known.
        self.field = field


@dataclass(frozen=True)
class URLPolicy:
    schemes: tuple[str, ...] = ("http", "https")
    networks: tuple[Network, ...] = ()
    #: The proxy's own listening addresses (host, port): an instance there is a request loop.
    own: tuple[Listener, ...] = ()

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


def is_local(addr: Address) -> bool:
    """Is ``addr`` one of this host's own addresses? (Binding to it succeeds only then.)"""
    if addr.is_loopback:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((str(addr), 0))
        except OSError:
            return False
    return True


def check_instance_url(url: str, policy: URLPolicy, resolver: Resolver = resolve,
                       local: IsLocal = is_local) -> None:
    """Raise ``URLPolicyError`` unless ``url`` may be registered under ``policy``.

    With allowed networks configured, every address the host resolves to must lie inside
    one of them (a name that also resolves elsewhere is refused). Names are resolved at
    registration time only; pin instances by address where DNS itself is not trusted.
    Loopback stays allowed (single-host deployments and ``make run`` serve vLLM there),
    except at the proxy's own listening port.
    """
    _check_characters(url)
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
    for addr in _addresses(host, port, resolver):
        _check_address(host, addr, policy.networks)
        _check_not_ours(host, addr, port, policy.own, local)


def check_addresses(addresses: Iterable[tuple[str, str, bool]], policy: URLPolicy,
                    resolver: Resolver = resolve, local: IsLocal = is_local) -> None:
    """Raise ``URLPolicyError`` (naming the field) unless every (field, value, is a URL) of a
    record (``Instance.addresses``) may be used under ``policy``."""
    for field, value, is_url in addresses:
        check = check_instance_url if is_url else check_instance_address
        try:
            check(value, policy, resolver, local)
        except URLPolicyError as exc:
            raise URLPolicyError(f"{field}: {exc}", field) from None


def check_instance_address(value: str, policy: URLPolicy, resolver: Resolver = resolve,
                           local: IsLocal = is_local) -> None:
    """Raise ``URLPolicyError`` unless a transfer address (``host:port``, or
    ``tcp://host:port``) may be handed to instances under ``policy``."""
    _check_characters(value)
    text = value.strip()
    if "://" not in text:
        text = "tcp://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise URLPolicyError(f"{value!r} is not a valid host:port address: {exc}") from None
    if parts.scheme.lower() not in TRANSFER_SCHEMES:
        raise URLPolicyError(f"scheme {parts.scheme!r} is not allowed for a transfer address; "
                             "write host:port or tcp://host:port")
    if not parts.hostname or port is None or parts.path or parts.query or parts.fragment \
            or parts.username is not None or parts.password is not None:
        raise URLPolicyError(f"{value!r} is not a host:port address")
    for addr in _addresses(parts.hostname, port, resolver):
        _check_address(parts.hostname, addr, policy.networks)
        _check_not_ours(parts.hostname, addr, port, policy.own, local)


def _check_characters(value: str) -> None:
    """Control characters and spaces would end up in request lines and headers (probe
    URLs, the P2P NCCL request id), where a CR LF starts a header of its own."""
    bad = next((c for c in value.strip() if ord(c) < 0x21 or 0x7f <= ord(c) < 0xa0), None)
    if bad is not None:
        raise URLPolicyError(f"control character or space (U+{ord(bad):04X}) in {value!r}")


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
    addr = _unmapped(addr)
    inside = any(addr.version == n.version and addr in n for n in networks)
    if inside:
        return
    if networks:
        raise URLPolicyError(
            f"host {host!r} ({addr}) is outside the networks instances may be registered "
            f"from: {', '.join(str(n) for n in networks)}")
    for spelled in (addr, *_embedded_ipv4(addr)):
        if any(spelled.version == n.version and spelled in n for n in ALWAYS_REFUSED):
            shown = str(addr) if spelled == addr else f"{addr}, which embeds {spelled}"
            raise URLPolicyError(
                f"host {host!r} ({shown}) is a link-local, multicast or unspecified address; "
                "instances cannot be registered there")


def _check_not_ours(host: str, addr: Address, port: int, own: tuple[Listener, ...],
                    local: IsLocal) -> None:
    spellings = (_unmapped(addr), *_embedded_ipv4(addr))
    for listen_host, listen_port in own:
        if port != listen_port:
            continue
        try:
            listening = _unmapped(ipaddress.ip_address(listen_host.split("%", 1)[0]))
        except ValueError:
            continue
        if any(a == listening or (listening.is_unspecified and local(a)) for a in spellings):
            raise URLPolicyError(
                f"host {host!r} ({addr}) port {port} is this proxy itself (listening on "
                f"{listen_host}:{listen_port}); registering it would send requests in a loop")


def _unmapped(addr: Address) -> Address:
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped if mapped is not None else addr


def _embedded_ipv4(addr: Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address spells (IPv4-compatible, NAT64, 6to4, Teredo)."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return []
    found = []
    if any(addr in n for n in IPV4_EMBEDDED) and not (addr.is_loopback or addr.is_unspecified):
        found.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    if addr.sixtofour is not None:
        found.append(addr.sixtofour)
    if addr.teredo is not None:
        found.extend(addr.teredo)
    return found
