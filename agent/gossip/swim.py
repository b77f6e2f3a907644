"""SWIM membership with Lifeguard, as a pure state machine: no I/O, no clock.

A :class:`Swim` is fed events — :meth:`~Swim.tick`, :meth:`~Swim.receive`,
:meth:`~Swim.send_failed` — each with the current time, and answers with the
:class:`Outgoing` messages the transport must send. The same code runs behind
the agent's gRPC transport and in :mod:`simnet`, 10,000 members in one process.

The protocol, per member:

* Every protocol period it probes the next member of a shuffled round-robin
  order: a ping; without an ack within the probe timeout, ``ping_req`` to k
  others, who ping the target and forward its ack (or a nack when they could not
  reach it); without an ack by the end of the period, the target is suspect.
* A suspicion becomes a death after the Lifeguard timeout, which starts long and
  shrinks as independent members confirm the suspicion. A suspected (or dead)
  member that hears of it refutes by raising its incarnation — including a
  member declared dead: the agent above revokes the lease of a member it sees
  dead, and that member rejoins with a new lease anyway, so a false death costs
  work, never correctness, and refuting it lets gossip recover at once.
* Updates (alive/suspect/dead/left, with meta while alive) ride on every
  message; a gossip round sends them to a few random members besides.
* Every push-pull period, the whole table is exchanged with one random member.
* Local health (Lifeguard awareness) stretches this member's own probe timeout
  and period when its probes fail without nacks, when it must refute a
  suspicion of itself, or when its ticks come late: a slow member accuses later.

Refused connections (``send_failed(refused=True)``) are the fast path: the
target is probed through k others at once, and when ``refused_quorum`` members
(this one included) saw it refuse, it is declared dead on the spot — about two
network round trips after the first message to a crashed member. A silent
member (stopped, partitioned) never refuses, so it waits out the suspicion; the
transport must therefore say ``refused`` only for an actively refused connection
(ECONNREFUSED), never for a timeout or an unreachable host.

Two additions to memberlist's rules, both against false deaths: a suspicion
that nobody confirmed gets one last probe (carrying the suspicion) before it
becomes a death, and a member that hears an accusation it already refuted sends
its refutation round again.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypermesh.agent.gossip.broadcast import (
    ALIVE,
    DEAD,
    KINDS,
    LEFT,
    SUSPECT,
    BroadcastQueue,
    Message,
    Outgoing,
    Update,
    encode_meta,
)
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.members import (
    _GONE,
    _LIVE,
    MemberView,
    Roster,
    _Member,
    _Table,
    supersedes,
)
from hypermesh.agent.gossip.suspicion import (
    Suspicion,
    expected_confirmations,
    health_scaled,
    probe_deadline,
    push_pull_period,
    retransmit_limit,
    suspicion_bounds,
)

__all__ = [
    "ALIVE",
    "DEAD",
    "KINDS",
    "LEFT",
    "SUSPECT",
    "MemberView",
    "Message",
    "Outgoing",
    "Roster",
    "Swim",
    "Update",
    "supersedes",
]

_INF = math.inf


@dataclass(slots=True)
class _Probe:
    seq: int
    target: str
    address: str
    timeout_at: float
    end_at: float
    indirect: bool = False
    direct_refused: bool = False
    verify: bool = False  # a last check of an unconfirmed suspicion before it becomes a death
    sent: int = 0  # ping_reqs sent
    answered: int = 0  # ... of which answered: a nack, or our send to the prober failed
    via: set[str] = field(default_factory=set)  # probers yet to answer
    refused_by: set[str] = field(default_factory=set)  # probers that saw a refusal


@dataclass(slots=True)
class _Relay:
    requester: str
    requester_addr: str
    seq: int
    target: str
    nack_at: float


class Swim:
    """One member's view of the mesh and its part in the protocol.

    Only its owner calls its methods, always with a non-decreasing ``now``; the
    state changes only inside them. It reads no clock and does no I/O: the
    transport sends what the methods return and reports undeliverable messages
    through :meth:`send_failed`.
    """

    def __init__(
        self,
        name: str,
        address: str,
        cfg: GossipConfig,
        rng: random.Random,
        now: float,
        meta: dict[str, Any] | None = None,
        roster: Roster | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self.cfg = cfg
        self._rng = rng
        self._incarnation = 0
        self._meta_json = self._checked_meta(meta or {})
        self._meta_version = 1 if meta else 0
        self._table = _Table(roster)
        self._n_live = len(roster.names) if roster else 0
        self._dead: dict[str, float] = {}  # dead (not left) members -> since, for reconnects
        self._gone: dict[str, float] = {}  # dead and left members -> since, for reclaiming
        self._queue = BroadcastQueue()
        self._suspicions: dict[str, Suspicion] = {}
        self._verifying: dict[str, Suspicion] = {}  # expired, unconfirmed, under a last probe
        self._susp_next = _INF
        self._susp_dirty = False
        self._probes: dict[int, _Probe] = {}
        self._probing: dict[str, int] = {}  # target -> seq of our probe of it
        self._to_confirm: set[str] = set()  # suspects others accused: probe them ourselves
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        self._awareness = 0
        self._left = False
        self._events: list[tuple[str, str, str]] = []
        self._meta_changed: dict[str, None] = {}
        self.log: deque[tuple[float, str, str, str]] = deque(maxlen=256)
        self._grace_until = -_INF
        self._order = (0, 0, 1, 0)  # position, length, multiplier, offset of the probe pass
        self._join_pending: list[tuple[str, str]] = []
        self._join_target = ""
        self._join_retry_at = _INF
        self._limit_cache = (-1, 0)
        self._store(name, _Member(address, ALIVE, 0, self._meta_version, self._meta_json, now))
        period = cfg.protocol_period
        self._next_probe = now + rng.uniform(0.0, period)
        self._next_gossip = now
        pp = push_pull_period(self._n_live, cfg)
        self._next_push_pull = now + rng.uniform(0.0, pp) if pp > 0 else _INF
        ri = cfg.reconnect_interval
        self._next_reconnect = now + rng.uniform(0.0, ri) if ri > 0 else _INF

    # ---------------------------------------------------------------- views

    @property
    def local_health(self) -> int:
        """The Lifeguard awareness score, 0 (healthy) to ``cfg.awareness_max``."""
        return self._awareness

    @property
    def incarnation(self) -> int:
        """This member's own incarnation (raised by each refutation)."""
        return self._incarnation

    def members(self) -> dict[str, MemberView]:
        """Every member this one knows, itself included."""
        return {name: self._view(name, rec) for name, rec in self._table.items()}

    def member(self, name: str) -> MemberView | None:
        """What this member believes about ``name``, or None if it does not know it."""
        rec = self._table.get(name)
        return None if rec is None else self._view(name, rec)

    def live_count(self) -> int:
        """N: members alive or suspect, this one included."""
        return self._n_live

    @property
    def has_events(self) -> bool:
        """Whether :meth:`drain_events` has anything to return."""
        return bool(self._events)

    def drain_events(self) -> list[tuple[str, str, str]]:
        """State changes since the last call: ``(member, old, new)``; old is "" for a
        member first heard of."""
        events, self._events = self._events, []
        return events

    def drain_meta_changes(self) -> list[str]:
        """Members whose meta changed since the last call (in order of change)."""
        changed = list(self._meta_changed)
        self._meta_changed.clear()
        return changed

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to do (it may be called earlier)."""
        d = self._due()
        if self._to_confirm:
            return -_INF  # confirmation probes go out at once
        if self._queue and self._next_gossip < d:
            d = self._next_gossip
        return d

    def _due(self) -> float:
        """The earliest timer other than gossip (which waits whenever nothing is queued):
        a tick later than this by ``late_tick_threshold`` means our event loop stalled."""
        d = min(self._next_probe, self._next_push_pull, self._next_reconnect, self._join_retry_at)
        for p in self._probes.values():
            d = min(d, p.end_at if p.indirect else p.timeout_at)
        for r in self._relays.values():
            d = min(d, r.nack_at)
        if self._suspicions:
            d = min(d, max(self._suspicion_next(), self._grace_until))
        return d

    # ---------------------------------------------------------------- inputs

    def join(self, seeds: Sequence[tuple[str, str]], now: float) -> list[Outgoing]:
        """Learn ``seeds`` as alive members (incarnation 0) and push-pull with one of them;
        the next seed is tried if no reply comes within two protocol periods."""
        out: list[Outgoing] = []
        pending = []
        for name, address in seeds:
            if name == self.name:
                continue
            if self._table.get(name) is None:
                self._apply(Update(name, address, ALIVE, 0), now, gossip=False)
            pending.append((name, address))
        self._rng.shuffle(pending)
        self._join_pending = pending
        self._queue.push(self._self_update())
        self._join_next(now, out)
        return out

    def tick(self, now: float) -> list[Outgoing]:
        """Fire whatever timers are due: probes, timeouts, suspicions, gossip, push-pull."""
        out: list[Outgoing] = []
        if now - self._due() > self.cfg.late_tick_threshold:
            self._on_late_tick(now)
        if self._suspicions and now >= self._grace_until and self._suspicion_next() <= now:
            self._expire_suspicions(now, out)
        if self._relays:
            self._expire_relays(now, out)
        for p in list(self._probes.values()):
            if not p.indirect and now >= p.timeout_at:
                self._go_indirect(p, now, out)
            if now >= p.end_at and p.seq in self._probes:
                self._probe_failed(p, now, out)
        if now >= self._join_retry_at:
            self._join_next(now, out)
        if self._to_confirm:
            self._confirmation_probes(now, out)
        if now >= self._next_probe:
            self._start_probe(now, out)
        if self._queue and now >= self._next_gossip:
            self._gossip(now, out)
        if now >= self._next_push_pull:
            self._next_push_pull = now + push_pull_period(self._n_live, self.cfg)
            self._push_pull_random(now, out)
        if now >= self._next_reconnect:
            self._next_reconnect = now + self.cfg.reconnect_interval
            self._reconnect(now, out)
        return out

    def receive(self, msg: Message, now: float) -> list[Outgoing]:
        """Handle one message from another member."""
        out: list[Outgoing] = []
        for update in msg.updates:
            self._apply(update, now, gossip=True)
        kind = msg.kind
        if kind == "ping":
            if not msg.target or msg.target == self.name:
                out.append(self._send(msg.sender, msg.sender_addr, "ack", seq=msg.seq))
        elif kind == "ack":
            self._on_ack(msg, now, out)
        elif kind == "nack":
            self._on_nack(msg, now, out)
        elif kind == "ping_req":
            self._on_ping_req(msg, now, out)
        elif kind == "push_pull":
            self._merge_table(msg, now)
            reply = Message("push_pull_reply", self.name, self.address, table=self._table_rows())
            out.append(Outgoing(msg.sender, msg.sender_addr, reply))
        elif kind == "push_pull_reply":
            self._merge_table(msg, now)
            if msg.sender == self._join_target:
                self._join_pending, self._join_target, self._join_retry_at = [], "", _INF
        return out

    def send_failed(self, to: str, now: float, refused: bool) -> list[Outgoing]:
        """The transport could not deliver a message to ``to``.

        ``refused``: the connection was actively refused (nothing listens there any
        more); then ``to`` is probed through others at once. Any failure of our
        direct probe of ``to`` moves that probe to its indirect stage early."""
        out: list[Outgoing] = []
        handled = False
        seq = self._probing.get(to)
        if seq is not None:
            probe = self._probes[seq]
            probe.direct_refused = probe.direct_refused or refused
            if not probe.indirect:
                self._go_indirect(probe, now, out)
            else:
                self._check_refused(probe, now, out)
            handled = True
        for rseq, relay in list(self._relays.items()):
            if relay.target == to:
                del self._relays[rseq]
                out.append(self._nack(relay, refused))
                handled = True
        for probe in list(self._probes.values()):
            if to in probe.via:
                probe.via.discard(to)
                probe.answered += 1
                self._check_refused(probe, now, out)
        if to == self._join_target:
            self._join_next(now, out)
        if refused and not handled and not self._left:
            rec = self._table.get(to)
            if rec is not None and rec.state in _LIVE:
                self._start_fast_probe(to, rec, now, out)
        return out

    def set_meta(self, meta: dict[str, Any], now: float) -> None:
        """Publish new meta about this member (bumps meta_version; gossiped as alive)."""
        self._meta_json = self._checked_meta(meta)
        self._meta_version += 1
        self._store_self(now)
        self._meta_changed[self.name] = None
        self._queue.push(self._self_update())

    def leave(self, now: float) -> list[Outgoing]:
        """Leave gracefully: broadcast ``left`` and stop probing. Keep ticking a little
        while (a few gossip intervals) to let the news spread."""
        out: list[Outgoing] = []
        if self._left:
            return out
        self._left = True
        self._record(self.name, ALIVE, LEFT, now)
        self._store(
            self.name,
            _Member(
                self.address, LEFT, self._incarnation, self._meta_version, self._meta_json, now
            ),
        )
        self._queue.push(Update(self.name, self.address, LEFT, self._incarnation, source=self.name))
        for p in list(self._probes.values()):
            self._end_probe(p)
        self._next_probe = self._next_push_pull = self._next_reconnect = _INF
        self._join_retry_at = _INF
        self._gossip(now, out)
        return out

    # ---------------------------------------------------------------- probing

    def _start_probe(self, now: float, out: list[Outgoing]) -> None:
        period = health_scaled(self.cfg.protocol_period, self._awareness)
        self._next_probe = now + period
        target = self._next_target(now)
        if target is None or target in self._probing:
            return
        rec = self._table.get(target)
        assert rec is not None
        timeout = health_scaled(self.cfg.probe_timeout, self._awareness)
        end = now + health_scaled(probe_deadline(self.cfg), self._awareness)
        probe = _Probe(self._new_seq(), target, rec.address, now + timeout, end)
        self._probes[probe.seq] = probe
        self._probing[target] = probe.seq
        out.append(self._ping(target, rec, probe.seq))

    def _confirmation_probes(self, now: float, out: list[Outgoing]) -> None:
        """Probe, out of turn, suspects that others accused: our independent verdict
        is a confirmation that brings the suspicion to its shortest timeout (or our
        ack-carrying probe helps the suspect refute). Waiting for our round-robin turn
        would take up to N periods — longer still while we are sick ourselves."""
        for target in self._to_confirm:
            rec = self._table.get(target)
            if rec is None or rec.state != SUSPECT or target in self._probing:
                continue
            timeout = health_scaled(self.cfg.probe_timeout, self._awareness)
            end = now + health_scaled(probe_deadline(self.cfg), self._awareness)
            probe = _Probe(self._new_seq(), target, rec.address, now + timeout, end)
            self._probes[probe.seq] = probe
            self._probing[target] = probe.seq
            out.append(self._ping(target, rec, probe.seq))
        self._to_confirm.clear()

    def _start_fast_probe(self, target: str, rec: _Member, now: float, out: list[Outgoing]) -> None:
        if target in self._probing:
            return
        window = probe_deadline(self.cfg) - self.cfg.probe_timeout
        end = now + health_scaled(window, self._awareness)
        probe = _Probe(self._new_seq(), target, rec.address, now, end, direct_refused=True)
        self._probes[probe.seq] = probe
        self._probing[target] = probe.seq
        self._go_indirect(probe, now, out)

    def _next_target(self, now: float) -> str | None:
        """The next live member of a pseudo-random round-robin order.

        Each pass visits every member exactly once in the order ``(a*i + b) mod M``
        with fresh random a (coprime to M) and b: a shuffle that needs no list of
        its own, so 10,000 simulated members do not each hold 10,000 names.
        """
        size = self._table.size()
        for _ in range(2 * size + 2):
            pos, length, mult, offset = self._order
            if pos >= length:
                self._reclaim(now)
                length = self._table.size()
                if length < 2:
                    return None
                mult = self._rng.randrange(1, length)
                while math.gcd(mult, length) != 1:
                    mult = self._rng.randrange(1, length)
                pos, offset = 0, self._rng.randrange(length)
            self._order = (pos + 1, length, mult, offset)
            name = self._table.name_at((mult * pos + offset) % length)
            rec = self._table.get(name)
            if name != self.name and rec is not None and rec.state in _LIVE:
                return name
        return None

    def _go_indirect(self, probe: _Probe, now: float, out: list[Outgoing]) -> None:
        probe.indirect = True
        helpers = self._random_members(
            self.cfg.indirect_checks, (self.name, probe.target), (ALIVE,)
        )
        for helper in helpers:
            rec = self._table.get(helper)
            assert rec is not None
            out.append(
                self._send(
                    helper,
                    rec.address,
                    "ping_req",
                    seq=probe.seq,
                    target=probe.target,
                    target_addr=probe.address,
                )
            )
        probe.sent = len(helpers)
        probe.via = set(helpers)
        self._check_refused(probe, now, out)

    def _check_refused(self, probe: _Probe, now: float, out: list[Outgoing]) -> None:
        """The refused fast path: dead on a quorum of refusals, else suspect as soon as
        every indirect prober has answered."""
        if probe.seq not in self._probes:
            return
        refusals = len(probe.refused_by) + probe.direct_refused
        quorum = self.cfg.refused_quorum
        if quorum and refusals >= quorum:
            self._end_probe(probe)
            self._declare_dead(probe.target, now, "refused")
        elif probe.direct_refused and probe.indirect and not probe.via:
            self._end_probe(probe)
            self._fail_target(probe, now)

    def _probe_failed(self, probe: _Probe, now: float, out: list[Outgoing]) -> None:
        self._end_probe(probe)
        if not probe.direct_refused:
            missed = probe.sent - probe.answered if probe.sent else 1
            self._bump_awareness(max(0, missed))
        self._fail_target(probe, now)

    def _fail_target(self, probe: _Probe, now: float) -> None:
        if probe.verify and self._verifying.pop(probe.target, None) is not None:
            self._declare_dead(
                probe.target, now, "suspicion timeout, unconfirmed, last probe failed"
            )
        else:
            self._suspect(probe.target, now)

    def _end_probe(self, probe: _Probe) -> None:
        self._probes.pop(probe.seq, None)
        if self._probing.get(probe.target) == probe.seq:
            del self._probing[probe.target]

    def _on_ack(self, msg: Message, now: float, out: list[Outgoing]) -> None:
        probe = self._probes.get(msg.seq)
        if probe is not None and probe.target in (msg.sender, msg.target):
            self._end_probe(probe)
            self._bump_awareness(-1)
            susp = self._verifying.pop(probe.target, None) if probe.verify else None
            rec = self._table.get(probe.target)
            if susp is not None and rec is not None and rec.state == SUSPECT:
                # It answered but its refutation did not reach us: give it a new term.
                self._hold_suspicion(
                    probe.target,
                    Suspicion(now, susp.accuser, susp.k, susp.min_timeout, susp.max_timeout),
                )
            return
        relay = self._relays.pop(msg.seq, None)
        if relay is not None and msg.sender == relay.target:
            out.append(
                self._send(
                    relay.requester, relay.requester_addr, "ack", seq=relay.seq, target=relay.target
                )
            )

    def _on_nack(self, msg: Message, now: float, out: list[Outgoing]) -> None:
        probe = self._probes.get(msg.seq)
        if probe is None or msg.sender not in probe.via:
            return
        probe.via.discard(msg.sender)
        probe.answered += 1
        if msg.refused:
            probe.refused_by.add(msg.sender)
        self._check_refused(probe, now, out)

    def _on_ping_req(self, msg: Message, now: float, out: list[Outgoing]) -> None:
        if not msg.target or msg.target == self.name:
            return
        seq = self._new_seq()
        self._relays[seq] = _Relay(
            msg.sender, msg.sender_addr, msg.seq, msg.target, now + self.cfg.probe_timeout
        )
        rec = self._table.get(msg.target)
        if rec is not None and rec.state == SUSPECT:
            out.append(self._ping(msg.target, rec, seq))
        else:
            out.append(self._send(msg.target, msg.target_addr, "ping", seq=seq, target=msg.target))

    def _expire_relays(self, now: float, out: list[Outgoing]) -> None:
        for seq, relay in list(self._relays.items()):
            if now >= relay.nack_at:
                del self._relays[seq]
                out.append(self._nack(relay, False))

    def _nack(self, relay: _Relay, refused: bool) -> Outgoing:
        msg = Message(
            "nack",
            self.name,
            self.address,
            seq=relay.seq,
            target=relay.target,
            updates=self._piggyback(),
            refused=refused,
        )
        return Outgoing(relay.requester, relay.requester_addr, msg)

    def _on_late_tick(self, now: float) -> None:
        """Our own event loop stalled: raise local health, void the probes in flight
        (their silence proves nothing about the targets), hold suspicion timers for
        a period so that the messages that queued up meanwhile are read first."""
        self._bump_awareness(1)
        for probe in list(self._probes.values()):
            self._end_probe(probe)
        for member, susp in self._verifying.items():
            self._hold_suspicion(member, susp)  # already due: checked again after the grace
        self._verifying.clear()
        self._next_probe = now + health_scaled(self.cfg.protocol_period, self._awareness)
        self._grace_until = now + self.cfg.protocol_period
        self.log.append((now, self.name, "late-tick", str(self._awareness)))

    def _bump_awareness(self, delta: int) -> None:
        self._awareness = min(self.cfg.awareness_max, max(0, self._awareness + delta))

    # ---------------------------------------------------------------- suspicion

    def _suspect(self, target: str, now: float) -> None:
        rec = self._table.get(target)
        if rec is not None and rec.state in _LIVE:
            self._apply(
                Update(target, rec.address, SUSPECT, rec.incarnation, source=self.name),
                now,
                gossip=True,
            )

    def _declare_dead(self, target: str, now: float, reason: str) -> None:
        rec = self._table.get(target)
        if rec is not None and rec.state in _LIVE:
            self.log.append((now, target, "declared-dead", reason))
            self._apply(
                Update(target, rec.address, DEAD, rec.incarnation, source=self.name),
                now,
                gossip=True,
            )

    def _suspicion_next(self) -> float:
        if self._susp_dirty:
            self._susp_next = min((s.deadline() for s in self._suspicions.values()), default=_INF)
            self._susp_dirty = False
        return self._susp_next

    def _drop_suspicion(self, member: str) -> None:
        self._verifying.pop(member, None)
        if self._suspicions.pop(member, None) is not None:
            self._susp_dirty = True

    def _hold_suspicion(self, member: str, susp: Suspicion) -> None:
        self._suspicions[member] = susp
        self._susp_next = min(self._susp_next, susp.deadline())

    def _expire_suspicions(self, now: float, out: list[Outgoing]) -> None:
        """Confirmed suspicions that ran out become deaths. One that nobody confirmed
        gets a last probe first (carrying the suspicion): if the suspect answers, it
        refutes in its ack; only if it stays silent is it dead. This catches the rare
        member that missed a refutation on every one of its retransmissions."""
        for member, susp in list(self._suspicions.items()):
            if susp.deadline() > now:
                continue
            self._drop_suspicion(member)
            if susp.confirmers:
                self._declare_dead(
                    member, now, f"suspicion timeout, {len(susp.confirmers)} confirmations"
                )
                continue
            self._verifying[member] = susp
            seq = self._probing.get(member)
            if seq is not None:
                self._probes[seq].verify = True
                continue
            rec = self._table.get(member)
            assert rec is not None
            period = health_scaled(self.cfg.protocol_period, self._awareness)
            timeout = health_scaled(self.cfg.probe_timeout, self._awareness)
            probe = _Probe(
                self._new_seq(), member, rec.address, now + timeout, now + period, verify=True
            )
            self._probes[probe.seq] = probe
            self._probing[member] = probe.seq
            out.append(self._ping(member, rec, probe.seq))

    # ---------------------------------------------------------------- merging

    def _apply(self, u: Update, now: float, gossip: bool) -> None:
        """Merge one update by the precedence rules; re-gossip it if it was news."""
        if u.member == self.name:
            self._about_me(u, now)
            return
        cur = self._table.get(u.member)
        if cur is None:
            if u.state != ALIVE:
                return  # suspicions and deaths of strangers are no news to act on
            meta = u.meta_json if u.meta_json is not None else "{}"
            self._store(
                u.member, _Member(u.address, ALIVE, u.incarnation, u.meta_version, meta, now)
            )
            self._record(u.member, "", ALIVE, now)
            self._meta_changed[u.member] = None
        elif u.state == ALIVE:
            if not self._apply_alive(u, cur, now):
                return
        elif u.state == SUSPECT and cur.state == SUSPECT and u.incarnation >= cur.incarnation:
            if u.incarnation > cur.incarnation:
                self._store(
                    u.member,
                    _Member(
                        cur.address,
                        SUSPECT,
                        u.incarnation,
                        cur.meta_version,
                        cur.meta_json,
                        cur.since,
                    ),
                )
            susp = self._suspicions.get(u.member)
            if susp is None or not susp.confirm(u.source):
                return
            self._susp_next = min(self._susp_next, susp.deadline())
        elif supersedes(u.state, u.incarnation, cur.state, cur.incarnation):
            self._store(
                u.member,
                _Member(cur.address, u.state, u.incarnation, cur.meta_version, cur.meta_json, now),
            )
            self._record(u.member, cur.state, u.state, now)
            self._drop_suspicion(u.member)
            if u.state == SUSPECT:
                low, high = suspicion_bounds(self._n_live, self.cfg)
                if u.source == self.name:
                    # Our own accusation, alone, waits as long as we are sick; once
                    # healthy members confirm it, our health no longer matters.
                    high = health_scaled(high, self._awareness)
                k = expected_confirmations(self._n_live, self.cfg)
                self._hold_suspicion(u.member, Suspicion(now, u.source, k, low, high))
                # About 2k members check an accusation for themselves (all of them in
                # a small mesh): enough confirmations, no storm of pings at the suspect.
                if u.source != self.name and self._rng.random() * self._n_live < 2 * k + 2:
                    self._to_confirm.add(u.member)
        else:
            return
        if gossip:
            self._queue.push(u)

    def _apply_alive(self, u: Update, cur: _Member, now: float) -> bool:
        take_meta = u.meta_json is not None and u.meta_version >= cur.meta_version
        meta_json = u.meta_json if take_meta and u.meta_json is not None else cur.meta_json
        version = u.meta_version if take_meta else cur.meta_version
        if u.incarnation > cur.incarnation:
            since = cur.since if cur.state == ALIVE else now
            self._store(
                u.member, _Member(u.address, ALIVE, u.incarnation, version, meta_json, since)
            )
            self._drop_suspicion(u.member)
            if cur.state != ALIVE:
                self._record(u.member, cur.state, ALIVE, now)
        elif (
            u.incarnation == cur.incarnation
            and u.meta_version > cur.meta_version
            and take_meta
            and cur.state in _LIVE
        ):
            self._store(
                u.member,
                _Member(cur.address, cur.state, cur.incarnation, version, meta_json, cur.since),
            )
        else:
            return False
        if take_meta and meta_json != cur.meta_json:
            self._meta_changed[u.member] = None
        return True

    def _about_me(self, u: Update, now: float) -> None:
        """News about this member: refute suspicion and death, catch up with stale
        incarnations from an earlier life under the same name."""
        if self._left:
            return
        if u.state == ALIVE:
            if u.incarnation > self._incarnation or u.meta_version > self._meta_version:
                self._refute(u, now)
        elif u.incarnation >= self._incarnation:
            self._bump_awareness(1)
            self.log.append((now, self.name, "refuted", u.state))
            self._refute(u, now)
        elif u.state != LEFT and self.name not in self._queue:
            # An accusation we already refuted is still going round: whoever carries it
            # missed the refutation, so spread it again (no new incarnation needed).
            self._queue.push(self._self_update())

    def _refute(self, u: Update, now: float) -> None:
        self._incarnation = max(self._incarnation, u.incarnation) + 1
        if u.meta_version > self._meta_version:
            self._meta_version = u.meta_version + 1
        self._store_self(now)
        self._queue.push(self._self_update())

    def _merge_table(self, msg: Message, now: float) -> None:
        """Push-pull merge. A reported death only counts as a suspicion here (the
        member can still refute it); news about the peer itself and new suspicions
        are gossiped on, the rest stays a local repair."""
        table = self._table
        for u in msg.table:
            cur = table.get(u.member)
            if cur is not None and cur.row is u:
                continue  # the very record we hold (shared roster entries): nothing new
            if u.state == DEAD or (u.state == SUSPECT and not u.source):
                u = Update(u.member, u.address, SUSPECT, u.incarnation, source=msg.sender)
            self._apply(u, now, gossip=u.member == msg.sender or u.state == SUSPECT)

    # ---------------------------------------------------------------- gossip

    def _gossip(self, now: float, out: list[Outgoing]) -> None:
        self._next_gossip = now + self.cfg.gossip_interval
        limit = self._retransmit_limit()
        for name in self._random_members(self.cfg.gossip_fanout, (self.name,), _LIVE):
            updates = self._queue.take(self.cfg.max_piggyback, limit)
            if not updates:
                break
            rec = self._table.get(name)
            assert rec is not None
            msg = Message("gossip", self.name, self.address, updates=tuple(updates))
            out.append(Outgoing(name, rec.address, msg))

    def _push_pull_random(self, now: float, out: list[Outgoing]) -> None:
        for name in self._random_members(1, (self.name,), (ALIVE,)):
            rec = self._table.get(name)
            assert rec is not None
            out.append(self._push_pull(name, rec.address))

    def _reconnect(self, now: float, out: list[Outgoing]) -> None:
        """Push-pull with one random dead member, now and then: after a partition
        heals, the first exchange across it makes both ends refute their deaths."""
        # Attempt with probability dead/live: the whole mesh then tries each dead
        # member about once per interval, however large it is.
        if self._dead and self._rng.random() * max(1, self._n_live - 1) < len(self._dead):
            name = self._rng.choice(list(self._dead))
            rec = self._table.get(name)
            if rec is not None:
                out.append(self._push_pull(name, rec.address))

    def _join_next(self, now: float, out: list[Outgoing]) -> None:
        self._join_target, self._join_retry_at = "", _INF
        if self._join_pending:
            name, address = self._join_pending.pop()
            self._join_target = name
            self._join_retry_at = now + 2 * self.cfg.protocol_period
            out.append(self._push_pull(name, address))

    def _push_pull(self, name: str, address: str) -> Outgoing:
        msg = Message("push_pull", self.name, self.address, table=self._table_rows())
        return Outgoing(name, address, msg)

    def _table_rows(self) -> tuple[Update, ...]:
        return tuple(rec.as_row(name) for name, rec in self._table.items())

    def _ping(self, target: str, rec: _Member, seq: int) -> Outgoing:
        """A ping; to a suspect it carries the suspicion first, so the suspect hears
        of it from whoever probes it and can refute at once (Lifeguard's buddy system)."""
        updates: list[Update] = []
        if rec.state == SUSPECT:
            susp = self._suspicions.get(target)
            accuser = susp.accuser if susp else self.name
            updates.append(Update(target, rec.address, SUSPECT, rec.incarnation, source=accuser))
        updates += self._queue.take(
            self.cfg.max_piggyback - len(updates),
            self._retransmit_limit(),
            skip=target if updates else "",
        )
        msg = Message(
            "ping", self.name, self.address, seq=seq, target=target, updates=tuple(updates)
        )
        return Outgoing(target, rec.address, msg)

    def _send(
        self,
        to: str,
        address: str,
        kind: str,
        seq: int = 0,
        target: str = "",
        target_addr: str = "",
    ) -> Outgoing:
        msg = Message(
            kind,
            self.name,
            self.address,
            seq=seq,
            target=target,
            target_addr=target_addr,
            updates=self._piggyback(),
        )
        return Outgoing(to, address, msg)

    def _piggyback(self) -> tuple[Update, ...]:
        if not self._queue:
            return ()
        return tuple(self._queue.take(self.cfg.max_piggyback, self._retransmit_limit()))

    def _retransmit_limit(self) -> int:
        n, limit = self._limit_cache
        if n != self._n_live:
            limit = retransmit_limit(self._n_live, self.cfg)
            self._limit_cache = (self._n_live, limit)
        return limit

    def _random_members(
        self, count: int, exclude: tuple[str, ...], states: tuple[str, ...]
    ) -> list[str]:
        """Up to ``count`` distinct random members in ``states``, none in ``exclude``."""
        size = self._table.size()
        if count <= 0 or size == 0:
            return []
        chosen: list[str] = []
        if size > 4 * count + 16:
            for _ in range(8 * count + 16):
                name = self._table.name_at(self._rng.randrange(size))
                rec = self._table.get(name)
                if (
                    rec is not None
                    and rec.state in states
                    and name not in exclude
                    and name not in chosen
                ):
                    chosen.append(name)
                    if len(chosen) == count:
                        return chosen
        pool = [
            n
            for n, rec in self._table.items()
            if rec.state in states and n not in exclude and n not in chosen
        ]
        return chosen + self._rng.sample(pool, min(count - len(chosen), len(pool)))

    # ---------------------------------------------------------------- records

    def _store(self, name: str, rec: _Member) -> None:
        old = self._table.get(name)
        self._n_live += (rec.state in _LIVE) - (old is not None and old.state in _LIVE)
        if rec.state == DEAD:
            self._dead[name] = rec.since
        else:
            self._dead.pop(name, None)
        if rec.state in _GONE and name != self.name:
            self._gone[name] = rec.since
        else:
            self._gone.pop(name, None)
        self._table.set(name, rec)

    def _store_self(self, now: float) -> None:
        rec = self._table.get(self.name)
        since = rec.since if rec is not None else now
        self._store(
            self.name,
            _Member(
                self.address,
                LEFT if self._left else ALIVE,
                self._incarnation,
                self._meta_version,
                self._meta_json,
                since,
            ),
        )

    def _record(self, member: str, old: str, new: str, now: float) -> None:
        self._events.append((member, old, new))
        self.log.append((now, member, old, new))

    def _reclaim(self, now: float) -> None:
        """Forget dead and left members older than ``dead_retention``."""
        horizon = now - self.cfg.dead_retention
        for name in [name for name, since in self._gone.items() if since < horizon]:
            del self._gone[name]
            self._dead.pop(name, None)
            self._table.forget(name)

    def _self_update(self) -> Update:
        return Update(
            self.name, self.address, ALIVE, self._incarnation, self._meta_version, self._meta_json
        )

    def _new_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _checked_meta(self, meta: dict[str, Any]) -> str:
        text = encode_meta(meta)
        if len(text.encode()) > self.cfg.max_meta_bytes:
            raise ValueError(
                f"meta is {len(text.encode())} bytes as JSON; the limit "
                f"(max_meta_bytes) is {self.cfg.max_meta_bytes}"
            )
        return text

    def _view(self, name: str, rec: _Member) -> MemberView:
        return MemberView(
            name,
            rec.address,
            rec.state,
            rec.incarnation,
            dict(_decode(rec.meta_json)),
            rec.meta_version,
            rec.since,
        )


def _decode(meta_json: str) -> dict[str, Any]:
    value = json.loads(meta_json)
    return value if isinstance(value, dict) else {}
