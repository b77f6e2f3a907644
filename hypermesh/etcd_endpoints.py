"""Where etcd is: the endpoint lists hypermesh is given, and their host names resolved.

An endpoint list is ``http(s)://HOST:PORT`` entries, comma-separated (``--etcd``);
``Etcd`` (``hypermesh/state/etcd.py``) dials them as IPv4 addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlparse

from hypermesh.errors import EtcdUnavailable, UsageError
from hypermesh.etcd_security import endpoints_scheme


def parse_endpoints(urls: str) -> list[str]:
    """``http://h1:2379,h2:2379`` -> ``["h1:2379", "h2:2379"]``; names a bad entry.
    ``https://`` endpoints are TLS (``hypermesh/etcd_security.py``); one list never
    mixes the two schemes."""
    endpoints_scheme(urls)
    endpoints = []
    for raw in urls.split(","):
        raw = raw.strip()
        if not raw:
            continue
        parsed = urlparse(raw if "://" in raw else f"http://{raw}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
            raise UsageError(f"bad etcd endpoint {raw!r}: expected http(s)://HOST:PORT")
        endpoints.append(f"{parsed.hostname}:{parsed.port}")
    if not endpoints:
        raise UsageError("no etcd endpoint given")
    return endpoints


async def resolve(endpoint: str) -> str:
    """``HOST:PORT`` with HOST as an IPv4 address (the first its name resolves to)."""
    host, _, port = endpoint.rpartition(":")
    try:
        ipaddress.IPv4Address(host)
        return endpoint
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM
        )
    except OSError as exc:
        raise EtcdUnavailable(
            f"cannot reach etcd at {endpoint}: cannot resolve host name {host!r} "
            f"({exc.strerror or exc})"
        ) from None
    return f"{found[0][4][0]}:{port}"
