"""Where an agent listens and where it is reached: ``--listen`` and ``--advertise``.

An agent binds its gRPC server on ``--listen`` and is reached at the address it
registers in etcd and gossips: ``--advertise`` when given, else the bound address.
The two differ behind NAT (a cloud machine reached at its public address), in a
container (reached at the host's port) and when the agent listens on every
interface (``0.0.0.0`` or ``[::]``), which names no address a peer could use: such an
agent must be told its advertised address.

An advertised address is ``HOST:PORT`` with a port in 1-65535 and HOST an IPv4
address, a bracketed IPv6 address or a DNS name (resolved by each peer when it
connects, so a name that moves to a new address is followed on the next connection).
Under mutual TLS no address needs to be in the agent's certificate: peers check the
server's certificate for the fixed name ``agent.hypermesh`` (``hypermesh/channels.py``),
whatever address they dialled.

Pure: no I/O; ``AgentConfig`` validates with :func:`check_advertise` and
:func:`check_listen_reachable`, the agent derives its addresses with the others.
"""

from __future__ import annotations

import ipaddress
import re

from hypermesh.errors import UsageError

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
"""Hosts that mean "every interface" when bound, and no address when dialled."""

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
DNS_NAME_RE = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*\.?")
"""A DNS name: labels of 1-63 letters, digits and inner hyphens, 253 characters at most."""


def split_host_port(address: str) -> tuple[str, str]:
    """(HOST, PORT) of ``HOST:PORT``, the brackets of an IPv6 host kept; ('', '') when
    there is no colon."""
    host, sep, port = address.rpartition(":")
    return (host, port) if sep else ("", "")


def is_wildcard(host: str) -> bool:
    """Whether ``host`` (as bound) means every interface."""
    return host in WILDCARD_HOSTS


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host):
        return False  # digits and dots only: a malformed IPv4 address, not a name
    return DNS_NAME_RE.fullmatch(host) is not None


def check_advertise(option: str, address: str) -> str:
    """``address`` if peers could dial it: ``HOST:PORT``, HOST an IPv4 address, a
    bracketed IPv6 address or a DNS name and not a wildcard, PORT in 1-65535; a
    ``UsageError`` naming ``option`` otherwise."""
    host, port = split_host_port(address)
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{option} {address!r}: expected HOST:PORT with a port in 1-65535")
    if is_wildcard(host):
        raise UsageError(f"{option} {address!r}: {host or 'an empty host'} is no address a "
                         "peer can reach; give this machine's address or name")
    if not _host_ok(host):
        raise UsageError(f"{option} {address!r}: HOST must be an IPv4 address, an IPv6 "
                         "address in brackets or a DNS name")
    return address


def check_listen_reachable(listen: str, advertise: str | None) -> None:
    """An agent listening on every interface must say where it is reached: a
    ``UsageError`` naming ``--advertise`` when ``listen``'s host is a wildcard and no
    ``advertise`` is given."""
    if advertise is None and is_wildcard(split_host_port(listen)[0]):
        raise UsageError(
            f"--listen {listen} listens on every interface, which is no address peers can "
            "reach: give --advertise HOST:PORT (env HYPERMESH_ADVERTISE), the address or "
            "name they reach this agent at"
        )


def advertised(bound: str, advertise: str | None) -> str:
    """The address an agent registers and gossips: ``advertise``, else ``bound``."""
    return advertise if advertise is not None else bound


def public(bound: str, advertise: str | None) -> str:
    """What to register for another listener of the agent (its dashboard, metrics) bound
    at ``bound``: on a wildcard host, the advertised host with the bound port (the best
    guess of where browsers and scrapers reach it); otherwise ``bound`` itself."""
    host, port = split_host_port(bound)
    if advertise is None or not is_wildcard(host):
        return bound
    return f"{split_host_port(advertise)[0]}:{port}"


def local(bound: str) -> str:
    """``bound`` as a program on this machine dials it: a wildcard host becomes the
    loopback address of its family."""
    host, port = split_host_port(bound)
    if not is_wildcard(host):
        return bound
    return f"[::1]:{port}" if host in ("::", "[::]") else f"127.0.0.1:{port}"
