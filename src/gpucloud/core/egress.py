"""Where the server may send requests a user asked for (serverless webhooks).

A webhook URL is the user's, but the POST leaves from the server's host: without a rule
it reaches what only that host can reach (the cloud metadata service at 169.254.169.254,
the server's own API, PostgreSQL's host, agents' metrics ports). The rule is a list of
denied networks with an explicit allow list that overrides it. The host name is resolved
once, every address it resolves to is checked, and the request is then sent to a checked
address (with the original Host header and TLS server name), so a DNS answer that changes
between the check and the connection (DNS rebinding) cannot move it elsewhere.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]

#: Denied unless allowed: loopback (this host's own services), link-local (the cloud
#: metadata services live there), "this network", multicast and broadcast, the AWS IPv6
#: metadata address and Alibaba's. Private ranges (10/8, 172.16/12, 192.168/16, fc00::/7)
#: are allowed by default, since self-hosted receivers usually live there; a multi-tenant
#: install adds them (docs/serverless.md).
DEFAULT_DENIED = ("127.0.0.0/8", "::1/128", "169.254.0.0/16", "fe80::/10", "0.0.0.0/8",
                  "::/128", "224.0.0.0/4", "ff00::/8", "255.255.255.255/32",
                  "fd00:ec2::254/128", "100.100.100.200/32")


class EgressRefused(ValueError):
    """The destination is not one the server may reach for a user."""


def parse_networks(text: str | Iterable[str], name: str) -> tuple[IPNetwork, ...]:
    """``10.0.0.0/8,::1`` (a comma-separated string or a list) as networks; ``name`` is
    the setting named in the error."""
    items = text.split(",") if isinstance(text, str) else list(text)
    networks: list[IPNetwork] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not an IP network (e.g. 10.0.0.0/8)"
                             ) from None
    return tuple(networks)


def _system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class Target:
    """A checked destination: connect to one of ``addresses`` (in the resolver's order);
    send ``host`` as the TLS server name and the URL's own host as Host."""

    url: str
    host: str
    addresses: tuple[str, ...]

    def pinned_url(self, address: str) -> str:
        """The URL with its host replaced by ``address``, one of the checked ones."""
        parts = urlsplit(self.url)
        literal = f"[{address}]" if ":" in address else address
        netloc = literal if parts.port is None else f"{literal}:{parts.port}"
        return parts._replace(netloc=netloc).geturl()


@dataclass(frozen=True)
class EgressPolicy:
    denied: tuple[IPNetwork, ...]
    allowed: tuple[IPNetwork, ...] = ()

    @classmethod
    def default(cls) -> EgressPolicy:
        return cls(parse_networks(DEFAULT_DENIED, "denied"))

    def permits(self, address: IPAddress) -> bool:
        """Allowed networks win over denied ones; anything else not denied is allowed."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        if any(address in network for network in self.allowed):
            return True
        return not any(address in network for network in self.denied)

    def check_literal(self, url: str) -> None:
        """Refuse a URL whose host is a denied IP literal (names are checked when sent,
        since their addresses can change)."""
        host = urlsplit(url).hostname or ""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return
        if not self.permits(address):
            raise EgressRefused(f"address {address} is not one the server may send to")

    def resolve(self, url: str, resolver: Resolver = _system_resolver) -> Target:
        """Resolve the URL's host and check every address; the first one is the target."""
        parts = urlsplit(url)
        host = parts.hostname
        if not host or parts.scheme not in ("http", "https"):
            raise EgressRefused("not an http:// or https:// URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in resolver(host, port)]
        except OSError as error:
            raise EgressRefused(f"{host} does not resolve: {error}") from None
        if not addresses:
            raise EgressRefused(f"{host} does not resolve")
        refused = [a for a in addresses if not self.permits(a)]
        if refused:
            raise EgressRefused(f"{host} resolves to {refused[0]}, which the server may not "
                                "send to")
        unique = tuple(dict.fromkeys(str(a) for a in addresses))
        return Target(url=url, host=host, addresses=unique)
