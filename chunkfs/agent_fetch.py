"""A mount's peer hook through its local agent: ``--agent ADDR``.

The agent that started a mount knows, from gossip, which peers hold which chunks;
the mount asks it (``FetchFromPeers``) before the object store for every run it
fetches, and gets the bytes or nothing. Nothing, an error or a short answer all mean
the same to the reader: the store. The bytes are verified by the reader, as every
source's are; this module only moves them.

Each request says whether the mount's cache has room for the range without evicting a
chunk the mesh may hold only here (``room``, the cache's ``has_room``): of the nodes
that miss a cold run together, the agent lets one with room fetch it from the store.

An agent gives the mounts it starts its Unix socket (``unix:PATH``, plaintext, for its
own user only): under mutual TLS a block from a peer then crosses one TLS hop, agent to
agent. Given HOST:PORT, the mount speaks to its agent as any client does (TLS when the
mesh has it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.channels import agent_channel
from hypermesh.tls import TlsFiles

log = logging.getLogger(__name__)

AGENT_TIMEOUT_S = 20.0
"""The most one fetch waits for the agent. The agent bounds its own work (a second per
peer asked; a cold run's wait for the node fetching it); this only guards a stuck agent."""


class AgentPeerFetch:
    """``peer_fetch(chunk_id, offset, length) -> bytes | None`` asking the agent at
    ``address``: ``unix:PATH`` (plaintext, ``tls`` unused) or HOST:PORT (mutual TLS with
    ``tls``, which an agent that has no socket lends its mounts in ``HYPERMESH_TLS_*``).
    Thread-safe (the reader calls it from its fetch threads)."""

    def __init__(
        self, address: str, timeout_s: float = AGENT_TIMEOUT_S, tls: TlsFiles | None = None
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._channel = agent_channel(address, tls, aio=False)
        self._stub = agent_pb2_grpc.AgentStub(self._channel)
        self.room: Callable[[str, int], bool] | None = None
        """``room(chunk_id, length)``: whether the cache takes ``length`` more bytes of
        the chunk without evicting a chunk only this node may hold (None: always)."""

    def __call__(self, chunk_id: str, offset: int, length: int) -> bytes | None:
        full = self.room is not None and not self.room(chunk_id, length)
        request = agent_pb2.ReadChunkRequest(
            chunk=chunk_id, offset=offset, length=length, cache_full=full
        )
        try:
            pieces = [p.data for p in self._stub.FetchFromPeers(request, timeout=self.timeout_s)]
        except grpc.RpcError as exc:
            log.debug("agent fetch of chunk %s: %s", chunk_id, exc)
            return None
        data = b"".join(pieces)
        return data if len(data) == length else None

    def close(self) -> None:
        self._channel.close()
