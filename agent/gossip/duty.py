"""Gossip between agents: the I/O around the pure SWIM state machine (``swim.py``).

This module carries the protocol's messages over the agent's gRPC API (one
``GossipStream`` per peer, ``link.py``), tells the protocol when a peer
refused a connection, feeds it
the node's load as metadata, and turns its verdicts into action: when a member
is declared dead, the leader (or every agent, when the leader is the one that
died or none is known) revokes that node's etcd lease, so its tasks are claimed
again at once, but only on a death its own probes witnessed (a death it only
heard of is probed first: no forged message can get a lease revoked), and only
the lease of the life that died (each agent gossips its lease in its meta: a
verdict on an earlier life must not cost a restarted one its lease). A node
wrongly declared dead loses its lease, kills its tasks, rejoins, and its late
results are fenced off, so a wrong verdict costs work, never correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from hypermesh._proto import agent_pb2
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.link import PeerLink
from hypermesh.agent.gossip.suspicion import health_scaled, probe_deadline
from hypermesh.agent.gossip.swim import MemberView, Message, Outgoing, Swim
from hypermesh.agent.gossip.trust import MALFORMED
from hypermesh.channels import agent_channel
from hypermesh.chunkfs.holdings import SOURCES, merge
from hypermesh.config import SMALL_MESSAGE_GRPC_OPTIONS
from hypermesh.keepalive import AGENT_CLIENT_OPTIONS

if TYPE_CHECKING:
    from hypermesh.agent.ops.telemetry import Machine
    from hypermesh.agent.share.duty import ChunkShare
    from hypermesh.agent.tasks.mounts import CacheScan, Mounts
    from hypermesh.agent.tasks.running import Running
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import TaskRef
    from hypermesh.state.records import NodeRecord
    from hypermesh.state.view import MeshView

log = logging.getLogger(__name__)

# Reconnect quickly to a peer that comes back; grpc's default backoff grows to 2 min.
# Keep-alive pings keep a NAT's mapping of an idle connection and notice a dead one
# (hypermesh/keepalive.py).
DATA_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *AGENT_CLIENT_OPTIONS,
]
CHANNEL_OPTIONS = [*DATA_CHANNEL_OPTIONS, *SMALL_MESSAGE_GRPC_OPTIONS]
META_MIN_INTERVAL_S = 0.5  # meta changes are gossiped at most this often
# A busy node's task counts change with every start and end. Counts alone are quiet
# news (``GossipConfig.quiet_meta``: they ride only on messages sent anyway) and are
# republished less often still: nothing schedules by them, ``hypermesh nodes`` shows them.
LOAD_MIN_INTERVAL_S = 2.0
IDLE_TICK_S = 0.5  # longest sleep between ticks when the protocol has nothing due
BACKUP_REVOKE_PERIODS = 2  # protocol periods a non-leader waits for the leader to revoke
LEASE_KEY = "lease"  # the meta entry naming the lease a member holds (hex)
# Seconds a replaced channel to a peer lets its calls in flight finish before it cancels
# them: closing it at once cancels them, and a CancelledError out of a call ends its
# caller as if the caller were cancelled (the dashboard's /api/nodes then dropped the
# browser's connection without an answer). Above the calls' deadlines (telemetry: 1 s).
CLOSE_GRACE_S = 3.0
# A member back from the dead whose link we replaced this recently, and whose channel is
# still connected, keeps it (see Gossip._link_suspect).
RESET_MIN_INTERVAL_S = 5.0
# How often at most we push-pull a member gossip holds dead whose etcd record is a later
# life, and how many members of the mesh do so each time, about (Gossip._reach_new_lives).
REACH_INTERVAL_S = 1.0
REACH_FANOUT = 3


def _encode(out: Outgoing) -> bytes:
    return out.message.encode()


def parse_lease(value: object) -> int | None:
    """The lease a meta entry names (hex, as :meth:`Gossip.meta` writes it), or None:
    absent or malformed (meta is what a member says of itself, unchecked)."""
    if not isinstance(value, str):
        return None
    try:
        return int(value, 16)
    except ValueError:
        return None


def new_life(died: MemberView | None, node: NodeRecord) -> str | None:
    """Why ``node``, etcd's record of a member gossip declared dead, is a later life's
    than the one that died, or None when it may be that life's own.

    ``died`` is the member's row as gossip holds it, with the address and meta that
    life last announced. A later life registered at another address (a restart
    elsewhere), or at the same address with another lease (a restart in place within
    the lease TTL, or a rejoin after losing the lease), has not been judged: the
    verdict is on the old life, whose lease, no longer in the record, ends with its
    TTL if it has not ended already. A row whose meta names no lease (an agent from
    before leases were gossiped, or a member whose meta never reached us) is taken
    for the record's life."""
    if died is None:
        return None
    if died.address != node.address:
        return f"died at {died.address} but is registered at {node.address}"
    held = parse_lease(died.meta.get(LEASE_KEY))
    if held is not None and held != node.lease:
        return f"died holding lease {held:x} but is registered with lease {node.lease:x}"
    return None


class GossipHost(Protocol):
    """What :class:`Gossip` uses of its agent: its identity, lease and load for the
    meta, its lease's health before acting on a verdict, the chunk share it feeds, and
    etcd to revoke a dead node's lease. It changes none of the agent's state."""

    cfg: AgentConfig
    address: str
    state: str
    machine: Machine
    view: MeshView
    etcd: Etcd
    running: dict[TaskRef, Running]
    share: ChunkShare
    mounts: Mounts

    lease: int
    gave_up: int | None

    @property
    def lease_is_lost(self) -> bool: ...

    def lease_fresh(self) -> bool: ...

    def rejoined_since(self, when: float) -> bool: ...

    def decide(self, message: str) -> None: ...


class Gossip:
    """One agent's membership in the gossip mesh. Owned by the agent's event loop;
    only this class and the gRPC servicer's calls into :meth:`receive` change it."""

    def __init__(self, agent: GossipHost, cfg: GossipConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        self.swim: Swim | None = None
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.data_channels: dict[str, grpc.aio.Channel] = {}
        self.links: dict[str, PeerLink] = {}
        self._link_member: dict[str, str] = {}  # address -> the member last sent to there
        self.revoked: set[tuple[str, int]] = set()
        self._meta: dict[str, Any] = {}
        self._meta_at = 0.0
        self._wake = asyncio.Event()
        self._sleep_until = 0.0  # when the protocol loop wakes by itself next
        self._sends: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()  # replaced links and channels
        self._cached_bytes = 0
        self._reads: dict[str, int] = {}  # blocks this node's mounts read, by source
        self.caches: list[CacheScan] = []  # each chunk cache as of the last scan
        self._holdings_at = -math.inf
        self._holdings: asyncio.Task[None] | None = None
        self._checks: dict[str, list[asyncio.Future[None]]] = {}  # deaths under our probe
        self._reset_at: dict[str, float] = {}  # member -> when we last replaced its link
        # member -> when (monotonic) we first heard it suspected, while it stays suspect
        self._suspected_at: dict[str, float] = {}
        self._reached: dict[str, float] = {}  # dead member -> when we last looked at it
        self._told: set[str] = set()  # of those, the ones we pushed-pulled (and logged)
        self._rng = random.Random()

    # ------------------------------------------------------------------ running
    async def run(self) -> None:
        a = self.agent
        now = time.monotonic()
        self.swim = Swim(a.cfg.name, a.address, self.cfg, random.Random(), now, meta=self.meta())
        self._meta_at = now
        try:
            while True:
                now = time.monotonic()
                self.swim.clock_offset = time.time() - now  # follows steps of the wall clock
                if not self._has_peers():
                    seeds = self._seeds()
                    if seeds:
                        self._send(self.swim.join(seeds, now))
                self.swim.confirm_all = a.view.leader() == a.cfg.name  # it revokes (_witness)
                self._send(self.swim.tick(now))
                self._reach_new_lives(now)
                self._publish_load(now)
                refused = self.swim.refusals.report(now)
                if refused:
                    log.warning("%s", refused)
                await self._act_on_events()
                if self._checks:
                    self._settle_checks()
                self._sync_chunks()
                delay = min(IDLE_TICK_S, max(0.01, self.swim.next_deadline() - time.monotonic()))
                self._sleep_until = time.monotonic() + delay
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
        finally:
            for task in [*self._sends, *self._closing,
                         *([self._holdings] if self._holdings else [])]:
                task.cancel()
            self.agent.share.close()
            for link in self.links.values():
                await link.close()
            channels = [*self.channels.values(), *self.data_channels.values()]
            closing = [channel.close() for channel in channels]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*closing), 2.0)

    async def leave(self) -> None:
        """Tell peers this node leaves on purpose (drain), best effort."""
        if self.swim is not None:
            self._send(self.swim.leave(time.monotonic()))
            if self._sends:
                await asyncio.wait(list(self._sends), timeout=1.0)

    def _seeds(self) -> list[tuple[str, str]]:
        """Peers to join through: the other nodes registered in etcd."""
        me = self.agent.cfg.name
        return [(n.name, n.address) for n in self.agent.view.nodes.values() if n.name != me]

    def _reach_new_lives(self, now: float) -> None:
        """Push-pull each member gossip holds dead whose node record in etcd is a later
        life (:func:`new_life`: it rejoined, after a partition healed or after it was
        stopped and went on): it may not know yet that we hold it dead, nor we that it
        lives again, and a reconnect round finds it only within about
        ``reconnect_interval`` (10 s) mesh-wide (8-10 s after the heal, in loaded
        partition runs). Every ``REACH_INTERVAL_S`` while the record is a later life and
        the member dead to us, each member that sees the record tries with a chance of
        ``REACH_FANOUT / (N - 1)``: about that many tries a second mesh-wide, whatever N,
        not one from every member (a thousand push-pulls a second at a node rejoined in
        a 1,000-node mesh); a member logs its first try. Etcd decides that it lives;
        gossip only hears it sooner."""
        assert self.swim is not None
        dead = self.swim.dead_members()
        gone = set(self._reached).difference(dead)
        for member in gone:
            del self._reached[member]
            self._told.discard(member)
        nodes = self.agent.view.nodes
        for member in dead:
            node = nodes.get(member)
            if node is None or now - self._reached.get(member, -math.inf) < REACH_INTERVAL_S:
                continue
            why = new_life(self.swim.member(member), node)
            if why is None:
                continue
            self._reached[member] = now
            if self._rng.random() * max(1, self.swim.live_count() - 1) >= REACH_FANOUT:
                continue
            if member not in self._told:
                self._told.add(member)
                self.agent.decide(f"gossip: {member} {why}: reaching it")
            self._send(self.swim.reconnect(member, node.address, now))

    def _has_peers(self) -> bool:
        assert self.swim is not None
        return self.swim.live_count() > 1  # someone besides this node

    # ------------------------------------------------------------------ messages
    def receive(self, payload: bytes, peer: str | None = None) -> list[bytes]:
        """A message from a peer (called by the gRPC servicer). Returns the encoded
        messages for the sender, which go back in the call's response.

        ``peer``: the node name the connection is authenticated as (its certificate's),
        None while connections are plaintext; a message another member sends in its
        name is refused (see :meth:`Swim.receive`). A malformed message raises
        ValueError (counted, like its malformed rows, which are left out)."""
        if self.swim is None:
            return []
        message = self._decode(payload)
        outgoing = self.swim.receive(message, time.monotonic(), peer)
        replies = [o for o in outgoing if o.to == message.sender]
        self._send([o for o in outgoing if o.to != message.sender])
        self._wake_if_due()
        return [_encode(o) for o in replies]

    def _wake_if_due(self) -> None:
        """Wake the protocol loop only when a message made something due before the
        loop's own wake-up (a new timer, a state change to act on): an idle mesh's
        pings and acks then cost no extra loop turn."""
        assert self.swim is not None
        if (
            self.swim.has_events
            or self._checks
            or self.swim.next_deadline() < self._sleep_until
        ):
            self._wake.set()

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to a peer for small messages: gossip, telemetry requests."""
        channel = self.channels.get(address)
        if channel is None:
            channel = agent_channel(address, self.agent.cfg.tls, CHANNEL_OPTIONS)
            self.channels[address] = channel
        return channel

    def data_channel(self, address: str) -> grpc.aio.Channel:
        """The channel to a peer for bulk transfers (chunk streams): gRPC's flow
        control may grow its windows, which the gossip channel does not let it."""
        channel = self.data_channels.get(address)
        if channel is None:
            channel = agent_channel(address, self.agent.cfg.tls, DATA_CHANNEL_OPTIONS)
            self.data_channels[address] = channel
        return channel

    def _send(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            link = self.links.get(out.address)
            if link is None:
                link = PeerLink(
                    self.channel(out.address),
                    self.cfg.probe_timeout,
                    self._on_reply,
                    self._on_failed,
                    functools.partial(self._on_broken, out.address),
                )
                self.links[out.address] = link
            self._link_member[out.address] = out.to
            link.send(out, _encode(out))

    def _decode(self, payload: bytes) -> Message:
        """The message in ``payload``; its malformed rows left out and counted, its
        update rows that carry nothing new left out unread (:meth:`Swim.stale_row`), and
        a malformed message counted and raised as ValueError."""
        assert self.swim is not None
        bad_rows: list[str] = []
        try:
            message = Message.from_json(json.loads(payload), bad_rows, self.swim.stale_row)
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            self.swim.refusals.add(MALFORMED, str(exc)[:200])
            raise ValueError(str(exc)[:200]) from None
        for error in bad_rows:
            self.swim.refusals.add(MALFORMED, f"a row from {message.sender}: {error}")
        return message

    def _on_reply(self, payload: bytes) -> None:
        if self.swim is None:
            return
        try:
            message = self._decode(payload)
        except ValueError:
            return  # counted; the peer's other replies still count
        self._send(self.swim.receive(message, time.monotonic()))
        self._wake_if_due()

    def _link_suspect(self, member: str, new: str, back: bool) -> bool:
        """Whether our connection to ``member`` is to be replaced on this change: on a
        suspicion only when our own probe of it failed (a suspicion we merely heard of
        says nothing about our link); when it is back from the dead, unless we replaced
        the link within the last ``RESET_MIN_INTERVAL_S`` and its channel is still
        connected. Without these, an overloaded mesh whose members suspect each other by
        the thousand (32 agents on 2 cores: 7,182 suspicions and 4,721 returns in 90 s)
        opened a new connection to a member from every peer at each of them, and the
        connection set-ups made the next probes late: more suspicions."""
        assert self.swim is not None
        if new == "suspect":
            return self.swim.witnessed(member) is not None
        if not back:
            return False
        view = self.swim.member(member)
        if view is None:
            return False
        last = self._reset_at.get(member)
        if last is None or time.monotonic() - last >= RESET_MIN_INTERVAL_S:
            return True
        channel = self.channels.get(view.address)
        return channel is not None and (
            channel.get_state() != grpc.ChannelConnectivity.READY)

    def _reset_link(self, member: str) -> None:
        """Our next message to ``member`` goes over a new connection: a probe of it
        failed, or it is back from the dead. After a failed probe the old connection may
        be dead without our knowing (a cut link, a NAT that dropped it): TCP retransmits
        into it for seconds after the link heals, and a member that is back would be
        suspected again, and declared dead, meanwhile. After a death the old channel
        holds the refusals of the process that died: gRPC fails new calls with them,
        as refused, until its reconnect backoff ends (up to a second), and a member
        back at the same address (a restarted agent) would be declared dead again at
        once, its new lease revoked."""
        view = self.swim.member(member) if self.swim is not None else None
        if view is None:
            return
        self._reset_at[member] = time.monotonic()
        link = self.links.pop(view.address, None)
        channel = self.channels.pop(view.address, None)

        async def close() -> None:
            if link is not None:
                await link.close()
            if channel is not None:  # calls in flight on it (a dashboard's telemetry
                await channel.close(CLOSE_GRACE_S)  # request) end on their own deadlines

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _on_broken(self, address: str) -> None:
        member = self._link_member.get(address)
        if self.swim is None or member is None:
            return
        self._send(self.swim.connection_lost(member, address, time.monotonic()))
        self._wake_if_due()

    def _on_failed(self, tag: object, was_refused: bool) -> None:
        assert isinstance(tag, Outgoing)
        if self.swim is None:
            return
        self._send(self.swim.send_failed(tag.to, time.monotonic(), was_refused))
        self._wake_if_due()

    # ------------------------------------------------------------------ metadata
    def meta(self) -> dict[str, Any]:
        """What this node gossips about itself: load and free capacity, and the lease
        it holds (which life of the node this is, see :func:`new_life`)."""
        a = self.agent
        running = len(a.running)
        gpus_used = sum(r.gpus for r in a.running.values())
        meta = {
            "running": running,
            "slots": a.cfg.slots,
            "free_slots": max(0, a.cfg.slots - running),
            "gpus": a.machine.gpus,
            "free_gpus": max(0.0, a.machine.gpus - gpus_used),
            "state": a.state,
            "cached_bytes": self._cached_bytes,
            "reads": self._reads,
            "chunks": a.share.peers.meta(),
            # Lifeguard local health: peers skip waiting for a sick leader to act
            "health": self.swim.local_health if self.swim is not None else 0,
        }
        if a.lease:  # granted before gossip starts; new only when the node rejoins
            meta[LEASE_KEY] = f"{a.lease:x}"
        if a.gave_up is not None:  # cut off from etcd: peers that reach it revoke this
            meta["gave_up"] = f"{a.gave_up:x}"
        return meta

    def _refresh_holdings(self, now: float) -> None:
        """Every ``scan_period_s`` (``ShareConfig``), look at what this node's chunk
        caches hold (in a thread: it reads a small record per cached chunk): the bytes
        cached and the chunk summary gossip advertises, and each cache on its own
        (``caches``: bytes and reads by source per data set, for ``GetTelemetry``).
        Nothing to do, and no thread, on a node that never mounted a data set."""
        period = self.agent.share.cfg.scan_period_s
        if now - self._holdings_at < period or self._holdings is not None:
            return
        self._holdings_at = now
        mounts = self.agent.mounts
        if not mounts.has_caches():
            return

        async def scan() -> None:
            try:
                caches = await asyncio.to_thread(mounts.scan_caches)
                held = merge(c.held for c in caches)
                self._cached_bytes = sum(h.present_bytes for h in held.values())
                self._reads = {s: sum(c.reads.get(s, 0) for c in caches) for s in SOURCES}
                self.caches = caches
                self.agent.share.scanned(held)
                await self.agent.share.publish_elsewhere(held, mounts.cache_roots)
            except Exception:  # a bad cache directory must not stop gossip
                log.exception("counting the chunk caches failed")
            finally:
                self._holdings = None

        self._holdings = asyncio.create_task(scan())

    def _publish_load(self, now: float) -> None:
        assert self.swim is not None
        self._refresh_holdings(now)
        meta = self.meta()
        if meta == self._meta:
            return
        changed = {k for k in meta.keys() | self._meta.keys() if meta.get(k) != self._meta.get(k)}
        wait = LOAD_MIN_INTERVAL_S if changed <= self.cfg.quiet_meta else META_MIN_INTERVAL_S
        if now - self._meta_at >= wait:
            self.swim.set_meta(meta, now)
            self._meta, self._meta_at = meta, now

    # ------------------------------------------------------------------ verdicts
    async def _act_on_events(self) -> None:
        assert self.swim is not None
        a = self.agent
        for member, old, new in self.swim.drain_events():
            a.share.member_state(member, new)
            now = time.monotonic()
            if new == "suspect":
                self._suspected_at.setdefault(member, now)
            suspected_at = (now if new == "suspect"
                            else self._suspected_at.pop(member, now))  # a death's, or none
            back = new == "alive" and old in ("dead", "left")
            if member != a.cfg.name and self._link_suspect(member, new, back):
                self._reset_link(member)
            if old:  # a first sighting ("" -> alive) is not a decision
                health = self.swim.local_health
                sick = f" [local health {health}]" if health else ""
                a.decide(f"gossip: {member} {old} -> {new}{self._reason(member, new)}{sick}")
            if new != "dead" or member == a.cfg.name:
                continue
            unhealthy = self.swim.local_health > self.cfg.awareness_max // 2
            if not a.lease_fresh() or a.lease_is_lost or unhealthy:
                # We may be the one that stalled (paused, overloaded): our verdicts
                # about others are not to be trusted until we are healthy again.
                a.decide(f"gossip: not acting on {member}'s death while unhealthy")
                continue
            before = a.rejoined_since(suspected_at)
            if before or a.rejoined_since(now - a.cfg.lease_ttl):
                # What our gossip concluded while we were cut off (every peer we could
                # not reach suspected, probes through connections the cut left dead) may
                # be about our own isolation: the others, who kept their leases, judge.
                # A suspicion that started before our rejoin ends as a death whenever
                # its timeout runs out (once in CI 5.8 s after the heal, past the 3 s
                # lease TTL), and a death heard within a TTL of the rejoin may rest on
                # such a suspicion elsewhere.
                doubt = ("we suspected it before we rejoined with a new lease" if before
                         else "we rejoined with a new lease less than a lease TTL ago")
                a.decide(f"gossip: not acting on {member}'s death: {doubt}")
                continue
            leader = a.view.leader()
            delay = 0.0
            if leader not in (a.cfg.name, None, member) and not self._sick(leader):
                # The leader acts on it; we step in only if it has not after a while
                # (it may be unhealthy itself, or not have reached the verdict yet).
                delay = BACKUP_REVOKE_PERIODS * self.cfg.protocol_period
            node = a.view.nodes.get(member)
            if node is None or (member, node.lease) in self.revoked:
                continue
            why = new_life(self.swim.member(member), node)
            if why is not None:
                a.decide(f"gossip: {member} {why}: a new life; not revoking its lease")
                continue
            self.revoked.add((member, node.lease))
            task = asyncio.create_task(self._revoke(member, node.lease, delay))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    def _sync_chunks(self) -> None:
        """Hand peers' changed metas (chunk summaries) to the chunk share; it fetches
        snapshots of replicas a delta cannot bring up to date."""
        assert self.swim is not None
        share = self.agent.share
        for member in self.swim.drain_meta_changes():
            view = self.swim.member(member)
            if view is not None and member != self.agent.cfg.name:
                share.observe(member, view.meta)
                self._on_given_up(member, view.meta.get("gave_up"))
        share.tick()

    def _on_given_up(self, member: str, flagged: object) -> None:
        """``member`` says it gave its lease up (it cannot reach etcd; its tasks are
        stopped): revoke that lease for it, so that its claims are taken over now
        rather than when the lease expires. Only the lease its node record holds, as
        for a death: the leader at once, the others if it has not after a while."""
        a = self.agent
        lease = parse_lease(flagged)
        node = a.view.nodes.get(member)
        if lease is None or node is None or node.lease != lease or a.lease_is_lost:
            return
        if (member, lease) in self.revoked or not a.lease_fresh():
            return  # done, or we may be the one cut off
        self.revoked.add((member, lease))
        leader = a.view.leader()
        delay = 0.0
        if leader not in (a.cfg.name, None, member) and not self._sick(leader):
            delay = BACKUP_REVOKE_PERIODS * self.cfg.protocol_period
        task = asyncio.create_task(self._revoke_given_up(member, lease, delay))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _revoke_given_up(self, member: str, lease: int, delay: float) -> None:
        a = self.agent
        if delay:
            await asyncio.sleep(delay)
            node = a.view.nodes.get(member)
            if node is None or node.lease != lease:
                return  # revoked meanwhile (by the leader, or itself on its way back)
        a.decide(f"gossip: {member} gave up its lease {lease:x} (it cannot reach etcd); "
                 "revoking it")
        try:
            await a.etcd.revoke(lease)
        except Exception:  # a failed revoke must not stop gossip; the TTL still ends it
            log.exception("revoking the lease %s gave up", member)

    def _sick(self, member: str) -> bool:
        """Whether ``member`` last gossiped a local health too poor to act on deaths."""
        assert self.swim is not None
        view = self.swim.member(member)
        health = view.meta.get("health", 0) if view is not None else 0
        return isinstance(health, int) and health > self.cfg.awareness_max // 2

    def _reason(self, member: str, new: str) -> str:
        """Why this member declared ``member`` dead itself (empty when it heard it)."""
        assert self.swim is not None
        if new == "dead":
            for _, who, what, why in reversed(self.swim.log):
                if who == member and what == "declared-dead":
                    return f" ({why})"
        return ""

    async def _revoke(self, member: str, lease: int, delay: float) -> None:
        a = self.agent
        if delay:
            await asyncio.sleep(delay)
            node = a.view.nodes.get(member)
            seen = self.swim.member(member) if self.swim is not None else None
            if node is None or node.lease != lease or (seen is not None and seen.state == "alive"):
                return  # revoked by the leader meanwhile, or refuted
        if not await self._witness(member):
            self.revoked.discard((member, lease))  # a later death may still be acted on
            return
        if delay:
            a.decide(f"gossip: {member} is dead and the leader has not acted; revoking")
        a.decide(f"gossip: {member} is dead; revoking its lease {lease:x}")
        try:
            await a.etcd.revoke(lease)
        except Exception:  # a failed revoke must not stop gossip; the TTL still ends it
            log.exception("revoking the lease of %s", member)

    async def _witness(self, member: str) -> bool:
        """Whether this node's own probes found ``member`` dead, probing it now when its
        death is only what others said: a lease is revoked on a death this node saw,
        never on one message (which anyone who reaches the port can forge)."""
        swim = self.swim
        assert swim is not None
        if swim.witnessed(member) is not None:
            return True
        self.agent.decide(f"gossip: {member} was reported dead; probing it before acting")
        self._send(swim.check_death(member, time.monotonic()))
        self._wake.set()
        probe_s = health_scaled(probe_deadline(self.cfg), swim.local_health)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._checks.setdefault(member, []).append(waiter)
        try:
            async with asyncio.timeout(2 * probe_s + self.cfg.protocol_period):
                await waiter
        except TimeoutError:
            pass
        finally:
            waiters = self._checks.get(member, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._checks.pop(member, None)
        if swim.witnessed(member) is not None:
            return True
        self.agent.decide(f"gossip: not acting on {member}'s death: our probe did not confirm it")
        return False

    def _settle_checks(self) -> None:
        """Wake :meth:`_witness` calls whose probe has ended (or whose member is no
        longer dead)."""
        assert self.swim is not None
        for member, waiters in self._checks.items():
            view = self.swim.member(member)
            done = (
                self.swim.witnessed(member) is not None
                or view is None
                or view.state != "dead"
                or not self.swim.probing(member)
            )
            if done:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    def refused(self) -> dict[str, int]:
        """Gossip refused since this agent started, by reason (see ``trust.py``)."""
        return dict(self.swim.refusals.totals) if self.swim is not None else {}

    def alive(self, name: str) -> bool:
        """Whether gossip has ``name`` alive (or has not heard of it yet)."""
        member = self.swim.member(name) if self.swim is not None else None
        return member is None or member.state == "alive"

    def free_gpus(self, name: str) -> float | None:
        """The GPUs ``name`` last said it has free (its gossiped ``free_gpus``, a second
        or two old), or None when gossip has no word of it."""
        member = self.swim.member(name) if self.swim is not None else None
        free = member.meta.get("free_gpus") if member is not None else None
        return float(free) if isinstance(free, (int, float)) else None

    def members(self) -> agent_pb2.Members:
        if self.swim is None:
            return agent_pb2.Members()
        to_wall = time.time() - time.monotonic()  # state_since is on the monotonic clock
        return agent_pb2.Members(
            members=[
                agent_pb2.Member(
                    name=m.name,
                    address=m.address,
                    state=m.state,
                    incarnation=m.incarnation,
                    meta_json=json.dumps(m.meta, sort_keys=True),
                    state_since=m.state_since + to_wall,
                )
                for m in sorted(self.swim.members().values(), key=lambda m: m.name)
            ],
            local_health=self.swim.local_health,
        )
