"""Who is calling: the agent's authorization of gRPC calls under mutual TLS.

With TLS every caller shows a certificate from the mesh CA (the server requires it),
so any call is from a member. Gossip and chunk traffic (``Gossip``, ``GossipStream``,
``ReadChunk``, ``LocateChunks``) must come from an agent: a certificate that names
:data:`~hypermesh.tls.AGENT_NAME`; the caller's node name is the certificate's own
name (its first DNS name), which gossip holds the sender of each message to. Without
TLS nothing is known of the caller and every call is let through, as before.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import grpc

from hypermesh.tls import AGENT_NAME, certificate_name

_SAN = "x509_subject_alternative_name"
_PEM = "x509_pem_cert"


@lru_cache(maxsize=1024)
def _name_of(pem: bytes) -> str:
    """A certificate's mesh name, parsed once per certificate (gossip calls are many)."""
    return certificate_name(pem)


def agent_peer(context: Any) -> str | None:
    """The node name of the agent behind a call's connection, or None when its
    certificate is not an agent's (or the connection has none)."""
    auth = context.auth_context()
    names = auth.get(_SAN) or []
    if AGENT_NAME.encode() not in names:
        return None
    pems = auth.get(_PEM) or []
    name = _name_of(pems[0]) if pems else ""
    return name if name and name != AGENT_NAME else None


async def require_agent(context: Any, tls: bool) -> str | None:
    """The calling agent's node name under TLS (None without TLS: unauthenticated);
    aborts the call with PERMISSION_DENIED when the caller is not an agent."""
    if not tls:
        return None
    peer = agent_peer(context)
    if peer is None:
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"only agents (certificates naming {AGENT_NAME}) may make this call",
        )
    return peer
