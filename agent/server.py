"""The agent's gRPC service: node status, attempt logs, drain, gossip, telemetry and chunks.

Errors become gRPC status codes here and nowhere else. Under mutual TLS any mesh
member may call; gossip and chunk reads only agents (``agent/peer_auth.py``), and a
gossip message only in its caller's certificate's name.

:class:`LocalSocket` serves the agent's own mounts on a Unix socket in its work
directory: ``FetchFromPeers`` only, in plaintext, guarded by file permissions rather
than certificates, so that a block a mount reads from a peer crosses one TLS hop
(agent to agent), not two.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.gossip.link import serve_stream
from hypermesh.agent.ops.telemetry import cpu_percent
from hypermesh.agent.peer_auth import require_agent
from hypermesh.agent.share.duty import PeerLost, stream_pieces
from hypermesh.channels import UNIX_PREFIX
from hypermesh.chunkfs.format import valid_chunk_id
from hypermesh.config import SMALL_MESSAGE_GRPC_OPTIONS
from hypermesh.state.keyspace import TaskRef

if TYPE_CHECKING:
    from hypermesh.agent.gossip.duty import Gossip
    from hypermesh.agent.ops.telemetry import Telemetry
    from hypermesh.agent.share.duty import ChunkShare
    from hypermesh.agent.tasks.attempts import Attempts
    from hypermesh.agent.tasks.running import Running
    from hypermesh.config import AgentConfig
    from hypermesh.state.records import NodeRecord
    from hypermesh.state.view import MeshView

CHUNK = 64 * 1024
FOLLOW_POLL_S = 0.2
LOCAL_SOCKET = Path("run") / "agent.sock"
"""The agent's Unix socket for its own mounts, under its work directory; its folder
is the agent's user's alone (0700), the socket too (0600)."""
UNIX_PATH_MAX = 107
"""Longest path of a Unix socket in bytes (``sun_path`` holds 108, the last a NUL)."""


class ServedAgent(Protocol):
    """What the gRPC service uses of its agent. ``Drain`` replaces ``cfg`` (with the
    grace it was given) and asks for a drain; the rest only reads."""

    cfg: AgentConfig
    state: str
    lease: int
    started_at: float
    metrics_address: str
    running: dict[TaskRef, Running]
    attempts: Attempts
    gossip: Gossip
    share: ChunkShare
    telemetry: Telemetry

    @property
    def is_leader(self) -> bool: ...

    def record(self) -> NodeRecord: ...

    async def read_view(self) -> MeshView: ...

    def request_drain(self, grace: float | None = None, why: str = ...) -> None: ...


class AgentServicer(agent_pb2_grpc.AgentServicer):
    """The handlers of one agent's gRPC API, on the agent's event loop."""

    def __init__(self, agent: ServedAgent) -> None:
        self.agent = agent

    @property
    def _tls(self) -> bool:
        """Whether calls arrive over mutual TLS (and ``agent/peer_auth.py`` applies)."""
        return self.agent.cfg.tls is not None

    async def GetNode(
        self, request: agent_pb2.GetNodeRequest, context: object
    ) -> agent_pb2.NodeStatus:
        a = self.agent
        rec = a.record()
        return agent_pb2.NodeStatus(
            name=rec.name,
            address=rec.address,
            pool=rec.pool,
            spot=rec.spot,
            slots=rec.slots,
            running=len(a.running),
            gpus=rec.gpus,
            gpu_type=rec.gpu_type,
            cpus=rec.cpus,
            memory_bytes=rec.memory,
            leader=a.is_leader,
            state=a.state,
            running_tasks=sorted(str(r) for r in a.running),
            labels=rec.labels,
            cpu_percent=cpu_percent(),
            lease_id=a.lease,
            started_at=a.started_at,
        )

    async def ReadLogs(
        self, request: agent_pb2.ReadLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.LogChunk]:
        a = self.agent
        try:
            ref = TaskRef.parse(request.task_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A silent attempt that succeeded has no log file (agent/tasks/runner.py).
        attempts = (await a.read_view()).attempts.get(ref, {})
        ran_here = {n for n, at in attempts.items() if at.node == a.cfg.name}
        attempt = request.attempt
        if attempt <= 0:
            ran = set(_attempts_logged(a.attempts.attempt_log(ref, 1))) | ran_here
            if not ran:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"node {a.cfg.name} has no log of task {ref}"
                )
            attempt = max(ran)
        path = a.attempts.attempt_log(ref, attempt)
        if not path.exists() and not self._running(ref, attempt):
            if attempt in ran_here:
                return  # it ran here and wrote nothing
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"node {a.cfg.name} has no log of task {ref} attempt {attempt}",
            )
        offset = max(0, request.offset)
        while True:
            still_running = self._running(ref, attempt)
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    while data := f.read(CHUNK):
                        offset += len(data)
                        yield agent_pb2.LogChunk(data=data, attempt=attempt)
            if not request.follow or not still_running:
                return
            await asyncio.sleep(FOLLOW_POLL_S)

    def _running(self, ref: TaskRef, attempt: int) -> bool:
        r = self.agent.running.get(ref)
        return r is not None and r.plan.attempt == attempt

    async def Drain(self, request: agent_pb2.DrainRequest, context: object) -> agent_pb2.DrainReply:
        a = self.agent
        count = len(a.running)
        if request.grace_seconds > 0:
            a.cfg = a.cfg.replace(kill_grace=request.grace_seconds)
        a.request_drain()
        return agent_pb2.DrainReply(released=count)

    async def Gossip(self, request: agent_pb2.GossipPacket, context: object) -> agent_pb2.GossipAck:
        peer = await require_agent(context, self._tls)
        gossip = self.agent.gossip
        replies: list[bytes] = []
        if gossip is not None:
            try:
                replies = gossip.receive(request.payload, peer)
            except (ValueError, KeyError, TypeError) as exc:
                await context.abort(  # type: ignore[attr-defined]
                    grpc.StatusCode.INVALID_ARGUMENT, f"bad gossip message: {exc}"
                )
        return agent_pb2.GossipAck(replies=replies)

    async def GossipStream(
        self, request_iterator: AsyncIterator[agent_pb2.GossipPacket], context: object
    ) -> AsyncIterator[agent_pb2.GossipAck]:
        peer = await require_agent(context, self._tls)
        async for ack in serve_stream(request_iterator, self.agent.gossip.receive, peer):
            yield ack

    async def GetMembers(
        self, request: agent_pb2.GetMembersRequest, context: object
    ) -> agent_pb2.Members:
        gossip = self.agent.gossip
        return gossip.members() if gossip is not None else agent_pb2.Members()

    async def GetTelemetry(
        self, request: agent_pb2.GetTelemetryRequest, context: object
    ) -> agent_pb2.Telemetry:
        a = self.agent
        return a.telemetry.message(
            a.cfg.name, max(0, request.history), a.metrics_address, a.gossip.caches
        )

    async def ReadChunk(
        self, request: agent_pb2.ReadChunkRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.ChunkBytes]:
        await require_agent(context, self._tls)
        try:
            data = await self.agent.share.read_local(request.chunk, request.offset, request.length)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if data is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"node {self.agent.cfg.name} does not hold chunk {request.chunk} "
                f"bytes {request.offset}+{request.length}",
            )
            return
        share = self.agent.share
        async for piece in stream_pieces(data, share.serve_pause_s, share.serve_piece):
            yield piece

    async def ChunkSet(
        self, request: agent_pb2.ChunkSetRequest, context: object
    ) -> agent_pb2.ChunkSetReply:
        return self.agent.share.chunk_set()

    async def FetchFromPeers(
        self, request: agent_pb2.ReadChunkRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.ChunkBytes]:
        if not valid_chunk_id(request.chunk) or request.offset < 0 or request.length <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"need a chunk id and a range, got {request.chunk[:80]!r}")
        try:
            async for piece in self.agent.share.fetch(
                request.chunk, request.offset, request.length, request.cache_full
            ):
                yield agent_pb2.ChunkBytes(data=piece)
        except PeerLost as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def LocateChunks(
        self, request: agent_pb2.LocateChunksRequest, context: object
    ) -> agent_pb2.LocateChunksReply:
        await require_agent(context, self._tls)
        peers = self.agent.share.peers
        return agent_pb2.LocateChunksReply(
            chunks=[
                agent_pb2.ChunkHolders(chunk=c, nodes=sorted(peers.holders(c)))
                for c in request.chunks
            ],
            counters=self.agent.share.counters,
        )


def local_socket_path(work_dir: Path) -> Path | None:
    """Where the agent running in ``work_dir`` serves its own mounts, or None when that
    path is too long for a Unix socket (its mounts then reach it at its TCP address)."""
    path = work_dir / LOCAL_SOCKET
    return path if len(os.fsencode(path)) <= UNIX_PATH_MAX else None


def local_address(work_dir: Path) -> str | None:
    """``unix:PATH`` of the socket of the agent running in ``work_dir`` while there is one,
    for programs that start mounts as an agent does (benchmarks, tests)."""
    path = local_socket_path(work_dir)
    return f"{UNIX_PREFIX}{path}" if path is not None and path.is_socket() else None


class LocalSocket:
    """The agent's Unix socket for the mounts it starts: a gRPC server of its own that
    serves ``FetchFromPeers`` (the main server's handler) and nothing else; any other
    RPC answers UNIMPLEMENTED. It is plaintext: the folder (0700) and the socket (0600)
    let only the agent's user connect. Only the agent's event loop starts and stops it;
    :meth:`stop` removes the socket file."""

    def __init__(self, path: Path, servicer: AgentServicer) -> None:
        self.path = path
        self.address = f"{UNIX_PREFIX}{path}"
        # It receives only requests; the chunk bytes it sends are flow-controlled by
        # the mount's side of the connection, which keeps gRPC's BDP probe.
        self._server = grpc.aio.server(options=SMALL_MESSAGE_GRPC_OPTIONS)
        self._server.add_generic_rpc_handlers((_local_handlers(servicer),))
        self._bound = False  # whether the socket file is this server's

    async def start(self) -> None:
        """Serve on the socket, replacing one a crashed agent left (raises OSError)."""
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{folder} is not a folder of this user: not serving a socket in it")
        folder.chmod(0o700)  # an earlier one may have been made with other modes
        self.path.unlink(missing_ok=True)
        try:
            self._server.add_insecure_port(self.address)
        except RuntimeError as exc:  # gRPC's "failed to bind"
            raise OSError(f"cannot listen on {self.address}: {exc}") from exc
        self._bound = True
        await self._server.start()
        self.path.chmod(0o600)

    async def stop(self, grace: float | None) -> None:
        await self._server.stop(grace)
        if self._bound:
            self.path.unlink(missing_ok=True)


def _local_handlers(servicer: AgentServicer) -> grpc.GenericRpcHandler:
    """The local socket's one RPC, served by ``servicer``'s handler."""
    service = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name
    return grpc.method_handlers_generic_handler(service, {
        "FetchFromPeers": grpc.unary_stream_rpc_method_handler(
            servicer.FetchFromPeers,
            request_deserializer=agent_pb2.ReadChunkRequest.FromString,
            response_serializer=agent_pb2.ChunkBytes.SerializeToString,
        ),
    })


def _attempts_logged(first: Path) -> list[int]:
    """The attempts of a task whose logs are beside ``first`` (its attempt 1's log)."""
    prefix = first.name.removesuffix("1.log")  # EXPERIMENT.INDEX.
    try:
        with os.scandir(first.parent) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix)]
    except FileNotFoundError:
        return []
    middles = (name[len(prefix):].removesuffix(".log") for name in names if name.endswith(".log"))
    return [int(m) for m in middles if m.isdigit()]
