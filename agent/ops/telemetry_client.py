"""Reading other agents' telemetry over gRPC (``GetTelemetry``), each with a bounded wait.

Shared by ``hypermesh top`` and ``hypermesh nodes --json`` (the CLI) and by the web
dashboard's ``/api/nodes`` (an agent asking its peers). A node that does not answer
within the timeout, or answers with an error, gives ``None``: one silent node never
holds up the others, which are asked at the same time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.channels import agent_channel
from hypermesh.tls import TlsFiles

RPC_TIMEOUT_S = 3.0  # the CLI's wait per node; the dashboard waits less (it polls)

ChannelFor = Callable[[str], grpc.aio.Channel]  # address -> an open, reusable channel


def message_json(msg: Message) -> dict[str, Any]:
    """A protobuf message as a dict keyed by its field names: every field present
    (scalars at their defaults too), a sub-message unset is None."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.message_type is not None and f.is_repeated:
            out[f.name] = [message_json(v) for v in value]
        elif f.message_type is not None:
            out[f.name] = message_json(value) if msg.HasField(f.name) else None
        elif f.is_repeated:
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


async def _ask(channel: grpc.aio.Channel, history: int, timeout: float) -> dict[str, Any] | None:
    try:
        reply = await agent_pb2_grpc.AgentStub(channel).GetTelemetry(
            agent_pb2.GetTelemetryRequest(history=history), timeout=timeout
        )
    except grpc.aio.AioRpcError:
        return None
    return message_json(reply)


async def fetch_one(
    address: str, history: int = 0, timeout: float = RPC_TIMEOUT_S,
    channel_for: ChannelFor | None = None, tls: TlsFiles | None = None,
) -> dict[str, Any] | None:
    """One node's ``GetTelemetry`` as a dict, or None when it does not answer in
    ``timeout`` seconds. ``channel_for`` lends a long-lived channel (the agent's
    gossip channels); without it a channel is opened and closed for this call, with
    ``tls`` (None: plaintext)."""
    if channel_for is not None:
        return await _ask(channel_for(address), history, timeout)
    async with agent_channel(address, tls) as channel:
        return await _ask(channel, history, timeout)


async def fetch_telemetry(
    addresses: dict[str, str], history: int = 0, timeout: float = RPC_TIMEOUT_S,
    channel_for: ChannelFor | None = None, tls: TlsFiles | None = None,
) -> dict[str, dict[str, Any] | None]:
    """``GetTelemetry`` of every node (name -> address) at once; None where a node
    does not answer within ``timeout``."""
    names = sorted(addresses)
    replies = await asyncio.gather(
        *(fetch_one(addresses[n], history, timeout, channel_for, tls) for n in names)
    )
    return dict(zip(names, replies, strict=True))
