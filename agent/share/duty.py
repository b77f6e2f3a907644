"""Peer chunk sharing, the agent's I/O: advertise, serve, fetch for the node's mounts.

The decisions live in :class:`~hypermesh.agent.share.peers.ChunkPeers` (pure); this
module feeds it and carries out what it says:

* **Advertise.** Every ``scan_period_s`` gossip scans this node's chunk caches
  (``Mounts.holdings``) and hands the chunk ids to :meth:`ChunkShare.scanned`; the
  summary's version, digest and last delta go into the gossip meta. Peers' metas
  arrive through :meth:`ChunkShare.observe`; a replica that a delta cannot bring up to
  date is fetched whole with the ``ChunkSet`` RPC.
* **Serve.** ``ReadChunk`` answers from the caches' records (:meth:`read_local`).
* **Fetch.** A mount of this node asks ``FetchFromPeers`` (:meth:`fetch`): the agent
  asks the holders in rendezvous order, each with a ``peer_timeout_s`` deadline, and
  passes the first one's pieces on as they arrive (a peer that fails half-way ends the
  mount's call with an error, and the mount reads the range from the store); no
  holder known means a cold run, and only one node fetches a cold run from the store
  (:meth:`_race`): the others wait for it (bounded) and read it from that node. A
  mount whose cache is full of chunks it may hold alone says so, and this node then
  races a moment late (``race_delay``), so that a node with room wins and keeps it.
* **Keep.** After each scan, the chunks this node holds that another alive node holds
  too go into a file beside each cache (``holdings.write_elsewhere``); the mounts
  evict those first (:meth:`publish_elsewhere`).

Bytes from a peer are never trusted here: the mount verifies every block and fetches
the wrong ones from the store. Owned by the agent's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias

import grpc

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.share.config import ShareConfig, transfer_deadline
from hypermesh.agent.share.peers import ChunkPeers, race_delay
from hypermesh.chunkfs.format import valid_chunk_id
from hypermesh.chunkfs.holdings import ELSEWHERE_FILE, read_range, write_elsewhere
from hypermesh.errors import EtcdPermissionDenied, HypermeshError

if TYPE_CHECKING:
    from hypermesh.agent.gossip.swim import Swim
    from hypermesh.agent.tasks.mounts import Mounts
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace

log = logging.getLogger(__name__)

PIECE = 1 << 20  # bytes per streamed message
MAX_RANGE = 256 << 20  # the most one ReadChunk may ask for
LEASE_REUSE_S = 1.0  # a fetch lease names keys for at most this long after its grant
WON_MAX = 4096  # segments won remembered before expired ones are dropped
SERVE_PAUSE_ENV = "HYPERMESH_TEST_SERVE_PAUSE_S"
"""Tests only: seconds ``ReadChunk`` pauses after each piece it streams, so that a test
can kill the serving agent half-way through a transfer."""
SERVE_PIECE_ENV = "HYPERMESH_TEST_SERVE_PIECE_BYTES"
"""Tests only: bytes per streamed piece, if not :data:`PIECE`; smaller pieces make every
range a transfer of several pieces, whatever blocks the reading mount asks for at once."""


ReadCall: TypeAlias = "grpc.aio.UnaryStreamCall[agent_pb2.ReadChunkRequest, agent_pb2.ChunkBytes]"


class PeerLost(Exception):
    """A peer failed in the middle of a transfer that was being passed on."""


class PeerChannels(Protocol):
    """What the chunk share uses of gossip: who is alive where, and a channel to each."""

    @property
    def swim(self) -> Swim | None: ...

    def data_channel(self, address: str) -> grpc.aio.Channel: ...


class ShareHost(Protocol):
    """What :class:`ChunkShare` uses of its agent (it changes none of it)."""

    cfg: AgentConfig
    ks: Keyspace
    etcd: Etcd
    mounts: Mounts

    @property
    def gossip(self) -> PeerChannels: ...


class ChunkShare:
    """This node's part in peer chunk sharing; see the module docstring. Owned by the
    agent's event loop: gossip feeds it, the gRPC servicer and the mounts' fetches read it."""

    def __init__(self, agent: ShareHost, cfg: ShareConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        self.peers = ChunkPeers(agent.cfg.name, cfg.max_delta_bytes)
        self.counters: dict[str, int] = dict.fromkeys(
            ("served", "served_bytes", "peer_fetches", "peer_bytes", "peer_misses",
             "cold_won", "cold_waited", "cold_from_winner", "cold_deferred", "peer_lost",
             "snapshots"), 0)
        self._snapshots: dict[str, asyncio.Task[None]] = {}
        self._snapshot_at: dict[str, float] = {}
        self._lease = (0, -math.inf)  # (fetch lease id, monotonic time of its grant)
        self._lease_lock = asyncio.Lock()
        self._ticked_at = -math.inf
        self._won: dict[tuple[str, int], float] = {}  # (chunk, segment) -> held until
        self._race_refused = False  # etcd refused the fetching keys to our user (said once)
        self._elsewhere: frozenset[str] | None = None  # what publish_elsewhere last wrote
        self.serve_pause_s = float(os.environ.get(SERVE_PAUSE_ENV) or 0)
        self.serve_piece = int(os.environ.get(SERVE_PIECE_ENV) or PIECE)

    # ------------------------------------------------------------ advertising
    def scanned(self, held: Iterable[str]) -> None:
        """A scan of this node's caches found these chunks (at least one block each)."""
        delta = self.peers.update_own(held)
        if delta is not None:
            log.debug("chunk summary v%d: +%d -%d", delta.version, len(delta.added),
                      len(delta.removed))

    async def publish_elsewhere(
        self, held: Iterable[str], roots: Callable[[], list[Path]]
    ) -> None:
        """Tell this node's mounts (a file beside each cache ``roots()`` lists) which of the
        chunks ``held`` another alive node holds too, when that changed since the last
        call (or a cache has no such file yet). As fresh as the view: a peer's change
        shows here a scan and a gossip round after it, and in the mount's cache up to
        ``HAVE_FLUSH_INTERVAL`` later."""
        ids = self.peers.held_elsewhere(held)
        changed = ids != self._elsewhere

        def write() -> None:
            for root in roots():
                if changed or not (root.parent / ELSEWHERE_FILE).exists():
                    write_elsewhere(root, ids)

        await asyncio.to_thread(write)
        self._elsewhere = ids

    def member_state(self, member: str, state: str) -> None:
        """A member's gossip state changed. One that (re)appears is looked at at once:
        its meta may not change again for a while."""
        self.peers.member_state(member, state)
        if state not in ("alive", "suspect"):
            task = self._snapshots.pop(member, None)
            if task is not None:
                task.cancel()
            return
        swim = self.agent.gossip.swim
        view = swim.member(member) if swim is not None else None
        if view is not None and member != self.agent.cfg.name:
            self.observe(member, view.meta)

    def observe(self, member: str, meta: dict[str, object]) -> None:
        """A peer's new gossip meta (a change, or a push-pull that brought it)."""
        if self.peers.observe(member, meta):
            self._want_snapshot(member)

    def tick(self) -> None:
        """Retry snapshots of replicas still different from what their owner gossips
        (looked at once per ``snapshot_retry_s``)."""
        now = time.monotonic()
        if now - self._ticked_at < self.cfg.snapshot_retry_s:
            return
        self._ticked_at = now
        for member in self.peers.stale():
            self._want_snapshot(member)

    def _want_snapshot(self, member: str) -> None:
        now = time.monotonic()
        if member in self._snapshots or now - self._snapshot_at.get(member, -math.inf) < (
            self.cfg.snapshot_retry_s
        ):
            return
        address = self._address(member)
        if address is None:
            return
        self._snapshot_at[member] = now
        task = asyncio.create_task(self._fetch_snapshot(member, address))
        self._snapshots[member] = task
        task.add_done_callback(lambda t: self._snapshot_done(member, t))

    def _snapshot_done(self, member: str, task: asyncio.Task[None]) -> None:
        if self._snapshots.get(member) is task:  # not a newer fetch started since
            del self._snapshots[member]

    async def _fetch_snapshot(self, member: str, address: str) -> None:
        try:
            reply = await self._stub(address).ChunkSet(
                agent_pb2.ChunkSetRequest(), timeout=max(2.0, self.cfg.peer_timeout_s)
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("chunk set of %s: %s", member, exc.code())
            return
        if reply.node != member:
            return  # another agent answers at that address now
        try:
            self.peers.load_snapshot(member, {"v": reply.version, "c": list(reply.chunks)})
            self.counters["snapshots"] += 1
        except ValueError as exc:
            log.warning("bad chunk set from %s: %s", member, exc)

    def chunk_set(self) -> agent_pb2.ChunkSetReply:
        snap = self.peers.snapshot()
        return agent_pb2.ChunkSetReply(node=self.agent.cfg.name, version=snap["v"],
                                       chunks=snap["c"])

    # ------------------------------------------------------------ serving
    async def read_local(self, chunk: str, offset: int, length: int) -> bytes | None:
        """The range from this node's caches, if one's record covers it (unverified)."""
        if not valid_chunk_id(chunk):  # a peer's request: it must not name another file
            raise ValueError(f"not a chunk id: {chunk[:80]!r}")
        if not 0 < length <= MAX_RANGE or offset < 0:
            raise ValueError(f"a range needs offset >= 0 and 0 < length <= {MAX_RANGE}, "
                             f"got {offset}+{length}")

        def read() -> bytes | None:
            for root in self.agent.mounts.cache_roots():
                data = read_range(root, chunk, offset, length)
                if data is not None:
                    return data
            return None

        data = await asyncio.to_thread(read)
        if data is not None:
            self.counters["served"] += 1
            self.counters["served_bytes"] += len(data)
        return data

    # ------------------------------------------------------------ fetching
    async def fetch(
        self, chunk: str, offset: int, length: int, cache_full: bool = False
    ) -> AsyncIterator[bytes]:
        """The range from a peer, as the peer's pieces in order (forwarded as they
        arrive); no pieces at all means: read it from the store. Raises
        :class:`PeerLost` when a peer fails after its first piece was passed on (the
        caller must end its answer with an error, never a short one). ``cache_full``:
        the asking mount has no room for the range (see :func:`race_delay`)."""
        holders = self.peers.peer_holders(chunk)
        for member in holders[: self.cfg.peer_tries]:
            opened = await self._open(member, chunk, offset, length, self.cfg.peer_timeout_s)
            if opened is not None:
                async for piece in self._forward(member, length, *opened):
                    yield piece
                self.counters["peer_fetches"] += 1
                return
        if holders:
            # Holders of the chunk, but none has this range (yet: a holder may be
            # fetching the chunk's other blocks right now): race for the segment like
            # a cold miss, so that only one node reads it from the store.
            self.counters["peer_misses"] += 1
        winner = None
        if self.cfg.dedup_wait_s > 0:
            winner = await self._race(chunk, offset, cache_full)
        if winner is None or winner == self.agent.cfg.name:
            self.counters["cold_won"] += 1
            return
        # Cold, and another node fetches it from the store: wait (bounded) until it
        # has it — or until another node that holds it shows up (one that read it from
        # the winner, when the winner has let it go since).
        self.counters["cold_waited"] += 1
        deadline = time.monotonic() + self.cfg.dedup_wait_s
        while (left := deadline - time.monotonic()) > 0:
            timeout = min(self.cfg.peer_timeout_s, left)
            others = [m for m in self.peers.peer_holders(chunk) if m != winner]
            for member in [winner, *others[: self.cfg.peer_tries - 1]]:
                opened = await self._open(member, chunk, offset, length, timeout)
                if opened is not None:
                    async for piece in self._forward(member, length, *opened):
                        yield piece
                    self.counters["cold_from_winner" if member == winner else "peer_fetches"] += 1
                    return
            if self._address(winner) is None:
                return  # the winner is gone
            await asyncio.sleep(min(self.cfg.dedup_poll_s, max(0.0, left)))

    async def _race(self, chunk: str, offset: int, cache_full: bool) -> str | None:
        """Who fetches the cold segment of ``chunk`` at ``offset`` from the store: this
        node's name when it won, the winner's, or None when etcd does not answer (then
        everyone reads it). Nodes race per segment (``dedup_segment_bytes``), not per
        run: readers split a chunk into runs at different places, and a winner reading
        on sequentially covers the others' runs of its segment. A node without room in
        its cache races ``full_defer_s`` late."""
        a = self.agent
        segment = self.cfg.dedup_segment_bytes
        start = offset // segment * segment
        won_here = self._won.get((chunk, start), -math.inf) > time.monotonic()
        if won_here:
            return a.cfg.name  # this node won it a moment ago: its key still stands
        delay = race_delay(cache_full, won_here, self.cfg.full_defer_s)
        if delay > 0:
            self.counters["cold_deferred"] += 1
            await asyncio.sleep(delay)
        now = time.monotonic()
        key = a.ks.fetching(chunk, start, segment)
        me = a.cfg.name.encode()
        try:
            lease = await self._fetch_lease()
            won = await a.etcd.txn([a.etcd.absent(key)], [a.etcd.op_put(key, me, lease)])
            if won.succeeded:
                self._remember_won((chunk, start), now)
                return a.cfg.name
            found = await a.etcd.get(key)
        except EtcdPermissionDenied as exc:  # a role without /hypermesh-fetching/<ns>/
            if not self._race_refused:
                self._race_refused = True
                log.warning("cold reads are not deduplicated: %s (docs/operations.md)", exc)
            return None
        except HypermeshError as exc:
            log.debug("racing for %s: %s", key, exc)
            return None
        return found[0].decode() if found is not None else None

    def _remember_won(self, segment: tuple[str, int], now: float) -> None:
        """Segments this node won, until a little before their key can expire (the
        lease was granted up to ``LEASE_REUSE_S`` before the key was written)."""
        if len(self._won) > WON_MAX:
            self._won = {k: t for k, t in self._won.items() if t > now}
        self._won[segment] = now + self.cfg.dedup_wait_s - LEASE_REUSE_S

    async def _fetch_lease(self) -> int:
        """A lease of ``dedup_wait_s`` for fetching keys, granted at most a second ago
        (one grant serves every cold run of that second)."""
        async with self._lease_lock:
            lease, granted = self._lease
            now = time.monotonic()
            if now - granted > LEASE_REUSE_S:
                lease = await self.agent.etcd.grant(max(2, math.ceil(self.cfg.dedup_wait_s)))
                self._lease = (lease, now)
            return lease

    async def _open(
        self, member: str, chunk: str, offset: int, length: int, timeout: float
    ) -> tuple[ReadCall, bytes] | None:
        """A ``ReadChunk`` call to ``member`` that has sent its first piece within
        ``timeout``, or None: not held there, gone, or too slow to start. Each later
        piece must follow within ``peer_timeout_s`` (see :meth:`_forward`), and the
        whole transfer within :func:`transfer_deadline`."""
        address = self._address(member)
        if address is None:
            return None
        request = agent_pb2.ReadChunkRequest(chunk=chunk, offset=offset, length=length)
        call: ReadCall = self._stub(address).ReadChunk(
            request, timeout=transfer_deadline(timeout, length)
        )
        try:
            async with asyncio.timeout(timeout):
                first = await call.read()
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            call.cancel()
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
            log.debug("ReadChunk %s@%d+%d from %s: %s", chunk, offset, length, member, code)
            return None
        if not isinstance(first, agent_pb2.ChunkBytes) or not first.data:
            call.cancel()
            return None
        return call, first.data

    async def _forward(
        self, member: str, length: int, call: ReadCall, first: bytes
    ) -> AsyncIterator[bytes]:
        """``first`` and the rest of an opened call's pieces; :class:`PeerLost` if it
        fails, stalls for ``peer_timeout_s`` between two pieces, or sends other than
        ``length`` bytes in all. Once ``length`` bytes are in, the stream's end is not
        waited for: a holder slow to close it (busy, or the tests' pause after each
        piece) must not cost the reader bytes it already has."""
        sent = 0
        try:
            piece = first
            while True:
                sent += len(piece)
                if sent > length:
                    raise PeerLost(f"{member} sent more than the {length} bytes asked for")
                self.counters["peer_bytes"] += len(piece)
                yield piece
                if sent == length:
                    break
                async with asyncio.timeout(self.cfg.peer_timeout_s):
                    message = await call.read()
                if not isinstance(message, agent_pb2.ChunkBytes):  # the end of the stream
                    break
                piece = message.data
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            self.counters["peer_lost"] += 1
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else "stalled"
            raise PeerLost(f"{member} failed after {sent} bytes: {code}") from exc
        finally:
            call.cancel()
        if sent != length:
            raise PeerLost(f"{member} sent {sent} of {length} bytes")

    # ------------------------------------------------------------ plumbing
    def _address(self, member: str) -> str | None:
        """Where ``member`` listens, while gossip has it alive (or suspect)."""
        swim = self.agent.gossip.swim
        view = swim.member(member) if swim is not None else None
        if view is None or view.state not in ("alive", "suspect"):
            return None
        return view.address

    def _stub(self, address: str) -> agent_pb2_grpc.AgentStub:
        return agent_pb2_grpc.AgentStub(self.agent.gossip.data_channel(address))

    def close(self) -> None:
        for task in self._snapshots.values():
            task.cancel()
        self._snapshots.clear()


async def stream_pieces(
    data: bytes, pause_s: float = 0.0, piece: int = PIECE
) -> AsyncIterator[agent_pb2.ChunkBytes]:
    """``data`` as ``ChunkBytes`` messages of at most ``piece`` bytes, ``pause_s``
    apart (both as here but in tests: see :data:`SERVE_PAUSE_ENV`)."""
    view = memoryview(data)
    for start in range(0, len(view), piece):
        yield agent_pb2.ChunkBytes(data=bytes(view[start : start + piece]))
        await asyncio.sleep(pause_s)
