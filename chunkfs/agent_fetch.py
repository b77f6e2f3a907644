"""A mount's peer hook through its local agent: ``--agent ADDR``.

The agent that started a mount knows, from gossip, which peers hold which chunks;
the mount asks it (``FetchFromPeers``) before the object store for every run it
fetches, and gets the bytes or nothing. Nothing, an error or a short answer all mean
the same to the reader: the store. The bytes are verified by the reader, as every
source's are; this module only moves them.
"""

from __future__ import annotations

import logging

import grpc

from hypermesh._proto import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

AGENT_TIMEOUT_S = 20.0
"""The most one fetch waits for the agent. The agent bounds its own work (a second per
peer asked; a cold run's wait for the node fetching it); this only guards a stuck agent."""


class AgentPeerFetch:
    """``peer_fetch(chunk_id, offset, length) -> bytes | None`` asking the agent at
    ``address``. Thread-safe (the reader calls it from its fetch threads)."""

    def __init__(self, address: str, timeout_s: float = AGENT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = agent_pb2_grpc.AgentStub(self._channel)

    def __call__(self, chunk_id: str, offset: int, length: int) -> bytes | None:
        request = agent_pb2.ReadChunkRequest(chunk=chunk_id, offset=offset, length=length)
        try:
            pieces = [p.data for p in self._stub.FetchFromPeers(request, timeout=self.timeout_s)]
        except grpc.RpcError as exc:
            log.debug("agent fetch of chunk %s: %s", chunk_id, exc)
            return None
        data = b"".join(pieces)
        return data if len(data) == length else None

    def close(self) -> None:
        self._channel.close()
