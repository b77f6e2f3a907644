"""Where etcd is: the endpoint lists hypermesh is given, their host names resolved, and
the first answer of a request sent to several of them.

An endpoint list is ``http(s)://HOST:PORT`` entries, comma-separated (``--etcd``);
``Etcd`` (``hypermesh/state/etcd.py``) dials them as IPv4 addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import grpc

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


async def first_answer(streams: Sequence[Any], request: Any, wait: float) -> tuple[Any, Any]:
    """Write ``request`` on every stream (a lease keep-alive hedged over several
    endpoints, ``Etcd.keep_lease``); the first of them to answer within
    ``wait`` s, with its answer. The others are cancelled. If none answers: the last
    error, else EOF (every stream ended), else ``TimeoutError``."""

    async def renew(stream: Any) -> tuple[Any, Any]:
        try:  # errors returned, not raised: a loser's is then never left unretrieved
            await stream.write(request)
            return stream, await stream.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            return stream, exc

    tries = [asyncio.ensure_future(renew(stream)) for stream in streams]
    winner, failed = None, None
    try:
        async with asyncio.timeout(wait):
            for next_answer in asyncio.as_completed(tries):
                stream, answer = await next_answer
                if isinstance(answer, BaseException):
                    failed = answer
                elif answer is not grpc.aio.EOF:
                    winner = stream
                    return stream, answer
    finally:
        for attempt, stream in zip(tries, streams, strict=True):
            attempt.cancel()
            if stream is not winner:
                stream.cancel()
    if failed is not None:
        raise failed
    return streams[0], grpc.aio.EOF
