"""Channels to an agent: plaintext, or mutual TLS with the member's own certificate.

Every connection to an agent (agent to agent, CLI to agent, mount to its agent)
opens here, so that whether it is TLS is decided in one place: with ``tls`` (a
:class:`~hypermesh.tls.TlsFiles`) the channel shows the member's certificate, trusts
only the mesh CA and checks the server's certificate for
:data:`~hypermesh.tls.AGENT_NAME` (any agent of the mesh, whatever address it is
reached at); without, it is plaintext, as a mesh without TLS options is. An address
``unix:PATH`` (an agent's socket for its own mounts, ``agent/server.py``) is always
plaintext: file permissions guard it, not certificates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import grpc

from hypermesh.tls import AGENT_NAME, TlsFiles, channel_options

Options = Sequence[tuple[str, Any]]

UNIX_PREFIX = "unix:"


def is_unix(address: str) -> bool:
    """Whether ``address`` is a Unix socket's (``unix:PATH``) rather than HOST:PORT."""
    return address.startswith(UNIX_PREFIX)


@overload
def agent_channel(
    address: str, tls: TlsFiles | None, options: Options = (), *, aio: Literal[True] = True
) -> grpc.aio.Channel: ...


@overload
def agent_channel(
    address: str, tls: TlsFiles | None, options: Options = (), *, aio: Literal[False]
) -> grpc.Channel: ...


def agent_channel(
    address: str, tls: TlsFiles | None, options: Options = (), *, aio: bool = True
) -> grpc.aio.Channel | grpc.Channel:
    """A channel to the agent at ``address`` (``grpc.aio`` unless ``aio`` is False);
    plaintext whatever ``tls`` is when ``address`` is ``unix:PATH``."""
    if tls is None or is_unix(address):
        if aio:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.insecure_channel(address, options=options)
    credentials = tls.channel_credentials()
    secure = (*options, *channel_options(AGENT_NAME))
    if aio:
        return grpc.aio.secure_channel(address, credentials, options=secure)
    return grpc.secure_channel(address, credentials, options=secure)
