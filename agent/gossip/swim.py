"""SWIM membership with Lifeguard, as a pure state machine: no I/O, no clock.

A :class:`Swim` is fed events — :meth:`~Swim.tick`, :meth:`~Swim.receive`,
:meth:`~Swim.send_failed` — each with the current time, and answers with the
:class:`Outgoing` messages the transport must send. The same code runs behind
the agent's gRPC transport and in :mod:`simnet`, 10,000 members in one process.

The protocol, per member:

* Every protocol period it probes the member a stride away along the ring of
  members by name, a stride every member draws alike from the wall clock's
  period, so that each member is probed by one other a period: a ping; without
  an ack within the probe timeout, ``ping_req`` to k others, who ping the target
  and forward its ack (or a nack when they could not reach it); without an ack
  by the end of the period, the target is suspect.
* A suspicion becomes a death after the Lifeguard timeout, which starts long and
  shrinks as independent members confirm the suspicion. A suspected (or dead)
  member that hears of it refutes by raising its incarnation — including a
  member declared dead: the agent above revokes the lease of a member it sees
  dead, and that member rejoins with a new lease anyway, so a false death costs
  work, never correctness, and refuting it lets gossip recover at once.
* Updates (alive/suspect/dead/left, with meta while alive) ride on every
  message; a gossip round sends them to a few random members besides.
* Every push-pull period, member tables are exchanged with one random member:
  whole up to ``push_pull_rows`` members, a bounded share of them beyond
  (:mod:`~hypermesh.agent.gossip.antientropy`).
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

And some against forged news (:mod:`~hypermesh.agent.gossip.trust`): a suspect
or dead claim above the incarnation a member announced itself is not believed,
a left above it only from the member, the table is bounded, a message from a
connection authenticated as another member is refused; and :meth:`Swim.witnessed`
tells a death this member's own probes saw from one it only heard of, which
:meth:`Swim.check_death` probes (the agent acts only on the first kind). Likewise
:meth:`Swim.heard` tells a member that sent us a message itself from one only
others' rows named: only the first kind serves as an indirect prober or counts
against local health, so made-up members that never answer can neither make this
member too unhealthy to act on deaths nor fail its indirect probes.

Where the parts live: :class:`Swim` (here) is the public face — events in,
outgoing messages and views out — and the scheduler that fires timers in
order; its state and the primitives that keep it consistent are
:class:`~hypermesh.agent.gossip.state.SwimState`, which it extends; failure
detection is :mod:`~hypermesh.agent.gossip.probe` and dissemination (merging and
spreading news) :mod:`~hypermesh.agent.gossip.dissemination`, both functions
over that state. The timing formulas are in
:mod:`~hypermesh.agent.gossip.suspicion`, the member table in
:mod:`~hypermesh.agent.gossip.members`, messages and the piggyback queue in
:mod:`~hypermesh.agent.gossip.broadcast`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from hypermesh.agent.gossip import dissemination, probe
from hypermesh.agent.gossip.broadcast import (
    ALIVE,
    DEAD,
    KINDS,
    LEFT,
    SUSPECT,
    Message,
    Outgoing,
    Update,
)
from hypermesh.agent.gossip.members import _LIVE, MemberView, Roster, _Member, supersedes
from hypermesh.agent.gossip.state import SwimState
from hypermesh.agent.gossip.trust import NOT_PEER

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


class Swim(SwimState):
    """One member's view of the mesh and its part in the protocol.

    Built with ``Swim(name, address, cfg, rng, now, meta=None, roster=None)``.
    Only its owner calls its methods, always with a non-decreasing ``now``; the
    state changes only inside them. It reads no clock and does no I/O: the
    transport sends what the methods return and reports undeliverable messages
    through :meth:`send_failed`.

    Its methods decide nothing and write no field themselves: they route each
    event to :mod:`~hypermesh.agent.gossip.probe` and
    :mod:`~hypermesh.agent.gossip.dissemination` in a fixed order, which is part
    of the protocol (it fixes the order of the messages and of the random draws).
    """

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
        return {name: _view(name, rec) for name, rec in self._table.items()}

    def member(self, name: str) -> MemberView | None:
        """What this member believes about ``name``, or None if it does not know it."""
        rec = self._table.get(name)
        return None if rec is None else _view(name, rec)

    def witnessed(self, member: str) -> str | None:
        """How this member's own probes found ``member`` silent or refusing since it was
        last alive (a failed probe, refusals, a failed last probe of its suspicion), or
        None: its suspicion or death, if any, is only what others said."""
        return self._witnessed.get(member)

    def heard(self, member: str) -> bool:
        """Whether ``member`` is in the table and this member has heard it directly at
        the address the table holds (a message from it, an ack included), or has known
        it since the roster it started from: only such members serve as indirect
        probers, and only their silence counts against local health."""
        return self._table.get(member) is not None and member not in self._unheard

    def probing(self, member: str) -> bool:
        """Whether a probe of ``member`` by this member is in flight."""
        return member in self._probing

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
        events = self._events.copy()
        self._events.clear()
        return events

    def stale_row(self, row: Any) -> bool:
        """Whether a raw update row carries nothing this member does not hold (see
        :func:`~hypermesh.agent.gossip.dissemination.stale_row`): the transport leaves
        such rows out unread (``Message.from_json``'s ``stale``)."""
        return dissemination.stale_row(self, row)

    def drain_meta_changes(self) -> list[str]:
        """Members whose meta changed since the last call (in order of change)."""
        changed = list(self._meta_changed)
        self._meta_changed.clear()
        return changed

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to do (it may be called earlier)."""
        d = self._due()
        if self._to_confirm or self._to_check:
            return -_INF  # confirmation probes go out at once
        if self._queue.loud and self._next_gossip < d:
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
            d = min(d, max(self._suspicion_next(), self._grace_until, self._susp_floor))
        return d

    # ---------------------------------------------------------------- inputs

    def join(self, seeds: Sequence[tuple[str, str]], now: float) -> list[Outgoing]:
        """Learn ``seeds`` as alive members (incarnation 0) and push-pull with one of them;
        the next seed is tried if no reply comes within two protocol periods."""
        out: list[Outgoing] = []
        dissemination.join(self, seeds, now, out)
        return out

    def tick(self, now: float) -> list[Outgoing]:
        """Fire whatever timers are due: probes, timeouts, suspicions, gossip, push-pull."""
        out: list[Outgoing] = []
        if now - self._due() > self.cfg.late_tick_threshold:
            probe.on_late_tick(self, now)
        if self._suspicions and now >= self._grace_until and self._suspicion_next() <= now:
            probe.expire_suspicions(self, now, out)
        if self._relays:
            probe.expire_relays(self, now, out)
        for p in list(self._probes.values()):
            if not p.indirect and now >= p.timeout_at:
                probe.go_indirect(self, p, now, out)
            if now >= p.end_at and p.seq in self._probes:
                probe.probe_failed(self, p, now, out)
        if now >= self._join_retry_at:
            dissemination.join_next(self, now, out)
        if self._to_confirm or self._to_check:
            probe.confirmation_probes(self, now, out)
        if now >= self._next_probe:
            probe.start_probe(self, now, out)
        if self._queue.loud and now >= self._next_gossip:
            dissemination.gossip_round(self, now, out)
        if now >= self._next_push_pull:
            dissemination.push_pull_round(self, now, out)
        if now >= self._next_reconnect:
            dissemination.reconnect_round(self, now, out)
        return out

    def receive(self, msg: Message, now: float, peer: str | None = None) -> list[Outgoing]:
        """Handle one message from another member.

        ``peer``: the member the connection it came on is authenticated as (the name
        in the peer's certificate), or None where connections are not authenticated.
        A message whose sender is not ``peer`` is refused whole: a member speaks in
        gossip only for itself."""
        if peer is not None and msg.sender != peer:
            self.refusals.add(NOT_PEER, f"a {msg.kind} from {msg.sender!r} sent by {peer!r}")
            return []
        out: list[Outgoing] = []
        for update in msg.updates:
            dissemination.apply(self, update, now, True, msg.sender)
        kind = msg.kind
        if kind == "ping":
            probe.on_ping(self, msg, out)
        elif kind == "ack":
            probe.on_ack(self, msg, now, out)
        elif kind == "nack":
            probe.on_nack(self, msg, now, out)
        elif kind == "ping_req":
            probe.on_ping_req(self, msg, now, out)
        elif kind == "push_pull":
            dissemination.on_push_pull(self, msg, now, out)
        elif kind == "push_pull_reply":
            dissemination.on_push_pull_reply(self, msg, now, out)
        probe.heard(self, msg)  # last: a newcomer's own row may have come with it
        return out

    def send_failed(self, to: str, now: float, refused: bool) -> list[Outgoing]:
        """The transport could not deliver a message to ``to``.

        ``refused``: the connection was actively refused (nothing listens there any
        more); then ``to`` is probed through others at once. Any failure of our
        direct probe of ``to`` moves that probe to its indirect stage early."""
        out: list[Outgoing] = []
        handled = probe.undelivered(self, to, now, refused, out)
        if to == self._join_target:
            dissemination.join_next(self, now, out)
        if refused and not handled and not self._left:
            rec = self._table.get(to)
            if rec is not None and rec.state in _LIVE:
                probe.start_fast_probe(self, to, rec, now, out)
        return out

    def connection_lost(self, member: str, address: str, now: float) -> list[Outgoing]:
        """The transport's stream to ``member`` at ``address`` ended on its own: probe
        the member out of turn (nothing if it is not alive to us or already probed)."""
        out: list[Outgoing] = []
        probe.connection_lost(self, member, address, now, out)
        return out

    def check_death(self, member: str, now: float) -> list[Outgoing]:
        """Probe ``member``, which others reported dead, ourselves before acting on it:
        if the probe fails, :meth:`witnessed` says so; if it answers, it refutes (the
        ping carries the report). Nothing is sent for a death already witnessed or a
        member already under probe."""
        out: list[Outgoing] = []
        probe.check_death(self, member, now, out)
        return out

    def dead_members(self) -> list[str]:
        """Members held dead (not left), in the order they died, about."""
        return list(self._dead)

    def reconnect(self, member: str, address: str, now: float) -> list[Outgoing]:
        """Push-pull with ``member``, which we hold dead, at ``address`` now, not when a
        reconnect round happens to pick it (about once per ``reconnect_interval``
        mesh-wide): the transport knows from elsewhere (etcd) that a later life of it
        runs there. An exchange across a healed link makes both ends refute the deaths
        they hold of each other. Nothing for a member not held dead."""
        rec = self._table.get(member)
        if self._left or rec is None or rec.state != DEAD:
            return []
        return [dissemination.push_pull_request(self, member, address)]

    def set_meta(self, meta: dict[str, Any], now: float) -> None:
        """Publish new meta about this member (bumps meta_version; gossiped as alive)."""
        dissemination.publish_meta(self, meta, now)

    def leave(self, now: float) -> list[Outgoing]:
        """Leave gracefully: broadcast ``left`` and stop probing. Keep ticking a little
        while (a few gossip intervals) to let the news spread."""
        out: list[Outgoing] = []
        dissemination.leave(self, now, out)
        return out


def _view(name: str, rec: _Member) -> MemberView:
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
