"""SWIM's failure-detection half: probes, relays, and the verdicts they lead to.

Every protocol period this member pings the member a stride away along the ring
of members, a stride every member draws alike from the wall clock's period, so
that each is probed by one other a period (:func:`start_probe`); without an ack
by the probe timeout it asks k others to ping the target for it
(:func:`go_indirect`), chosen among the members it heard directly
(:func:`heard`), never among those it only heard of, which anyone could have
made up; without an ack by the end of the period the target is suspect. It also
probes, out of turn, suspects that others accused and helpers that keep missing
their nacks (:func:`confirmation_probes`), and members that refused a connection
(:func:`start_fast_probe`), which are declared dead when ``refused_quorum``
members saw them refuse. For others' indirect probes it relays pings
(:func:`on_ping_req`) and answers each with an ack or a nack.

Suspicion timeouts end here too (:func:`expire_suspicions`): a confirmed one
is a death, an unconfirmed one gets one last probe first. Local health
(Lifeguard awareness) rises with probes that fail without the nacks of helpers
heard directly (:func:`probe_failed`) and with late ticks (:func:`on_late_tick`),
falls with acks and with failed probes that every helper answered, and stretches
this member's timeouts and period. Members never heard cannot raise it.

What it guarantees: at most one probe per target, and every probe ends by its
``end_at`` (on an ack, a quorum of refusals, every prober's answer about a
refusing target, or its end); a relay answers its requester at most once; a
member is declared dead here only on a quorum of refusals or on a suspicion
that ran out; probes in flight across a stall of our own event loop count for
nothing.

It holds no state: every function works on the
:class:`~hypermesh.agent.gossip.state.SwimState` it is given, called from
:class:`~hypermesh.agent.gossip.swim.Swim`'s event methods. News it makes (a
suspicion, a death) goes through :func:`~hypermesh.agent.gossip.dissemination.apply`
like news from anyone else. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math

from hypermesh.agent.gossip.broadcast import (
    ALIVE,
    DEAD,
    LEFT,
    SUSPECT,
    Message,
    Outgoing,
    Update,
)
from hypermesh.agent.gossip.dissemination import apply, message, piggyback, ping
from hypermesh.agent.gossip.members import _LIVE, _Member
from hypermesh.agent.gossip.state import SwimState, _Probe, _Relay
from hypermesh.agent.gossip.suspicion import Suspicion, health_scaled, probe_deadline

CHECK_AFTER_MISSES = 2
"""Nacks a helper may miss, with nothing heard from it in between, before this member
probes it out of turn. One missed nack is often a lost message; two in a row (likely
only when the helper is asked often: a small mesh, or one whose table is full of
members never heard, whose probes all go indirect) suggest the helper is gone,
and each further silence would raise our local health."""

# ---------------------------------------------------------------- starting probes


def start_probe(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """This period's probe: the target a stride along the ring (:func:`_next_target`)."""
    period = health_scaled(s.cfg.protocol_period, s._awareness)
    s._next_probe = now + period
    target = _next_target(s, now)
    if target is None or target in s._probing:
        return
    rec = s._table.get(target)
    assert rec is not None
    _ping(s, target, rec, now, out)


def confirmation_probes(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Probe, out of turn, suspects that others accused: our independent verdict
    is a confirmation that brings the suspicion to its shortest timeout (or our
    ack-carrying probe helps the suspect refute). Waiting for our turn along the ring
    would take about N periods — longer still while we are sick ourselves."""
    _ping_each(s, s._to_confirm, SUSPECT, now, out)
    # Helpers that keep missing nacks (see probe_failed): one that died would otherwise
    # be asked again and again until our turn along the ring reaches it, each silence
    # raising our local health — for hundreds of periods where made-up members fill the table.
    _ping_each(s, s._to_check, ALIVE, now, out)


def _ping_each(s: SwimState, targets: set[str] | dict[str, None], state: str, now: float,
               out: list[Outgoing]) -> None:
    """Probe each of ``targets`` still in ``state`` and not under probe; empty it."""
    for target in targets:
        rec = s._table.get(target)
        if rec is not None and rec.state == state and target not in s._probing:
            _ping(s, target, rec, now, out)
    targets.clear()


def _ping(s: SwimState, target: str, rec: _Member, now: float, out: list[Outgoing]) -> None:
    """Probe ``target`` directly: a ping with its deadlines (both scaled by our health)."""
    timeout = health_scaled(s.cfg.probe_timeout, s._awareness)
    end = now + health_scaled(probe_deadline(s.cfg), s._awareness)
    probe = _Probe(s._new_seq(), target, rec.address, now + timeout, end)
    s._probes[probe.seq] = probe
    s._probing[target] = probe.seq
    out.append(ping(s, target, rec, probe.seq))


def check_death(s: SwimState, target: str, now: float, out: list[Outgoing]) -> None:
    """Probe ``target``, which others reported dead (or suspect), ourselves: the ping
    carries the report, so a live target refutes it in its ack; a failed probe makes
    the death one we witnessed (:func:`_fail_target`). Nothing to do for a death we
    witnessed already or a probe of it in flight."""
    rec = s._table.get(target)
    if s._left or rec is None or rec.state == LEFT or target == s.name:
        return
    if target in s._witnessed or target in s._probing:
        return
    _ping(s, target, rec, now, out)


def connection_lost(s: SwimState, target: str, address: str, now: float,
                    out: list[Outgoing]) -> None:
    """Our stream to ``target`` at ``address`` broke (its process died, or the
    connection did): probe it now rather than when a probe along the ring next
    reaches it, a period or two away. A dead process then refuses the ping, and the
    refused fast path declares it dead within a round trip or two; a live one acks."""
    rec = s._table.get(target)
    if s._left or rec is None or rec.state != ALIVE or rec.address != address:
        return
    if target == s.name or target in s._probing:
        return
    _ping(s, target, rec, now, out)


def start_fast_probe(
    s: SwimState, target: str, rec: _Member, now: float, out: list[Outgoing]
) -> None:
    """``target`` refused a connection: probe it through others at once."""
    if target in s._probing:
        return
    window = probe_deadline(s.cfg) - s.cfg.probe_timeout
    end = now + health_scaled(window, s._awareness)
    probe = _Probe(s._new_seq(), target, rec.address, now, end, direct_refused=True)
    s._probes[probe.seq] = probe
    s._probing[target] = probe.seq
    go_indirect(s, probe, now, out)


def _next_target(s: SwimState, now: float) -> str | None:
    """The member to probe this period: the one ``stride`` places after this member in
    the table's ring (every member by name), or the first live one at a multiple of the
    stride, the stride drawn afresh each period from the period's number on the wall
    clock (:func:`ring_stride`).

    Members that agree on the clock and on the membership shift by the same stride, so
    each member is probed by exactly one other in a period: a member that falls silent
    is first probed within about a period (two at most, members' phases apart). With
    each member's own shuffled order, as before, a member went unprobed in a period with
    a chance of about 1/e whatever N, so the first probe of a silent one took a period on
    average and 3 or more about one time in twenty. Members that disagree (clocks apart,
    a member not yet known everywhere) probe one member twice and another not at all in
    that period, as independent orders do every period.
    """
    s._reclaim_in -= 1
    if s._reclaim_in <= 0:  # about once a pass over the table, as the shuffled order did
        s._reclaim(now)
        s._reclaim_in = s._table.size()
    size = s._table.size()
    if size < 2:
        return None
    period = math.floor((now + s.clock_offset) / s.cfg.protocol_period)
    stride = ring_stride(period, size)
    me = s._table.ring_index(s.name)
    # Past a slot that is not live (dead, left, forgotten) go on by the same stride: its
    # target becomes ours, so the live members still make one ring between them.
    for step in (stride, 1):  # 1: no one else live in our orbit of the stride
        at = me
        for _ in range(size - 1):
            at = (at + step) % size
            if at == me:
                break
            name = s._table.ring_at(at)
            rec = s._table.get(name)
            if rec is not None and rec.state in _LIVE:
                return name
    return None


_MASK = (1 << 64) - 1


def ring_stride(period: int, size: int) -> int:
    """How many places along the ring of ``size`` slots every member's probe of
    ``period`` goes: 1 to size - 1 (never itself), the same for every member (a
    splitmix64 hash of the period's number, not Python's per-process ``hash``)."""
    z = (period * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return 1 + (z ^ (z >> 31)) % (size - 1)


# ---------------------------------------------------------------- probes in flight


def go_indirect(s: SwimState, probe: _Probe, now: float, out: list[Outgoing]) -> None:
    """No ack in time (or the send failed): ask k random alive members to ping, chosen
    among those heard directly (see :func:`heard`): a member known only from others'
    rows may be made up, and one that never answers would count against our health.
    With none to ask, the probe waits out its end alone."""
    probe.indirect = True
    helpers = s._random_members(s.cfg.indirect_checks, (s.name, probe.target), (ALIVE,), heard=True)
    for helper in helpers:
        rec = s._table.get(helper)
        assert rec is not None
        out.append(
            message(
                s,
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
    check_refused(s, probe, now, out)


def check_refused(s: SwimState, probe: _Probe, now: float, out: list[Outgoing]) -> None:
    """The refused fast path: dead on a quorum of refusals, else suspect as soon as
    every indirect prober has answered."""
    if probe.seq not in s._probes:
        return
    refusals = len(probe.refused_by) + probe.direct_refused
    quorum = s.cfg.refused_quorum
    if quorum and refusals >= quorum:
        s._end_probe(probe)
        _declare_dead(s, probe.target, now, "refused", seen=True)
    elif probe.direct_refused and probe.indirect and not probe.via:
        s._end_probe(probe)
        _fail_target(s, probe, now)


def probe_failed(s: SwimState, probe: _Probe, now: float, out: list[Outgoing]) -> None:
    """The probe's end came without an ack. Each helper that did not answer either
    (no nack) raises our local health, if we heard it directly, and is probed itself
    out of turn once it missed ``CHECK_AFTER_MISSES`` in a row; if every helper
    answered, our health improves as on an ack; with no helpers, the failure raises
    it if we heard the target directly. Silence from a member never heard says
    nothing about our own health: it may never have existed."""
    s._end_probe(probe)
    if not probe.direct_refused:
        if probe.sent:
            silent = sorted(helper for helper in probe.via if helper not in s._unheard)
            for helper in silent:
                misses = s._missed_nacks.get(helper, 0) + 1
                s._missed_nacks[helper] = misses
                if misses >= CHECK_AFTER_MISSES:
                    s._to_check[helper] = None  # probed next tick, out of turn
            # Every helper answered in time: our own messages and timers work, as
            # much as an ack would show (else a table full of the dead and the
            # made-up, whose probes all fail, would never let our health recover).
            missed = len(silent) if probe.via else -1
        else:
            missed = int(probe.target not in s._unheard)
        s._bump_awareness(missed)
    _fail_target(s, probe, now)


def _fail_target(s: SwimState, probe: _Probe, now: float) -> None:
    rec = s._table.get(probe.target)
    if rec is not None and rec.state == DEAD:  # others' verdict (see check_death)
        _declare_dead(s, probe.target, now, "reported dead; our probe failed too", seen=True)
    elif probe.verify and s._verifying.pop(probe.target, None) is not None:
        _declare_dead(
            s, probe.target, now, "suspicion timeout, unconfirmed, last probe failed", seen=True
        )
    else:
        _suspect(s, probe.target, now)


def undelivered(s: SwimState, to: str, now: float, refused: bool, out: list[Outgoing]) -> bool:
    """A message to ``to`` could not be delivered: move our probe of it to its
    indirect stage (or count the refusal), nack the relays that target it, and
    count it as an answer from a prober. True if ``to`` was under our probe or a
    relay's."""
    handled = False
    seq = s._probing.get(to)
    if seq is not None:
        probe = s._probes[seq]
        probe.direct_refused = probe.direct_refused or refused
        if not probe.indirect:
            go_indirect(s, probe, now, out)
        else:
            check_refused(s, probe, now, out)
        handled = True
    for rseq, relay in list(s._relays.items()):
        if relay.target == to:
            del s._relays[rseq]
            out.append(_nack(s, relay, refused))
            handled = True
    for probe in list(s._probes.values()):
        if to in probe.via:
            probe.via.discard(to)
            check_refused(s, probe, now, out)
    return handled


# ---------------------------------------------------------------- messages


def heard(s: SwimState, msg: Message) -> None:
    """``msg`` came to us from its sender itself (the agent checks the sender against
    the authenticated peer where connections are authenticated): the sender is heard
    directly, and may serve as an indirect prober (:func:`go_indirect`)."""
    s._heard_from(msg.sender, msg.sender_addr)


def on_ping(s: SwimState, msg: Message, out: list[Outgoing]) -> None:
    """A ping meant for this member (or for whoever listens there) is acked."""
    if not msg.target or msg.target == s.name:
        out.append(message(s, msg.sender, msg.sender_addr, "ack", seq=msg.seq))


def on_ack(s: SwimState, msg: Message, now: float, out: list[Outgoing]) -> None:
    """An ack ends our probe, or is forwarded to whoever asked us to relay."""
    probe = s._probes.get(msg.seq)
    if probe is not None and probe.target in (msg.sender, msg.target):
        s._end_probe(probe)
        s._bump_awareness(-1)
        s._witnessed.pop(probe.target, None)  # whatever we saw before, it answers now
        susp = s._verifying.pop(probe.target, None) if probe.verify else None
        rec = s._table.get(probe.target)
        if susp is not None and rec is not None and rec.state == SUSPECT:
            # It answered but its refutation did not reach us: give it a new term.
            s._hold_suspicion(
                probe.target,
                Suspicion(now, susp.accuser, susp.k, susp.min_timeout, susp.max_timeout),
            )
        return
    relay = s._relays.pop(msg.seq, None)
    if relay is not None and msg.sender == relay.target:
        out.append(
            message(
                s, relay.requester, relay.requester_addr, "ack", seq=relay.seq, target=relay.target
            )
        )


def on_nack(s: SwimState, msg: Message, now: float, out: list[Outgoing]) -> None:
    """A prober could not reach our target (``refused``: the target refused it)."""
    probe = s._probes.get(msg.seq)
    if probe is None or msg.sender not in probe.via:
        return
    probe.via.discard(msg.sender)
    if msg.refused:
        probe.refused_by.add(msg.sender)
    check_refused(s, probe, now, out)


def on_ping_req(s: SwimState, msg: Message, now: float, out: list[Outgoing]) -> None:
    """Ping ``msg.target`` for the sender's indirect probe, and relay the answer."""
    if not msg.target or msg.target == s.name:
        return
    seq = s._new_seq()
    s._relays[seq] = _Relay(
        msg.sender, msg.sender_addr, msg.seq, msg.target, now + s.cfg.probe_timeout
    )
    rec = s._table.get(msg.target)
    if rec is not None and rec.state == SUSPECT:
        out.append(ping(s, msg.target, rec, seq))
    else:
        out.append(message(s, msg.target, msg.target_addr, "ping", seq=seq, target=msg.target))


def expire_relays(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Nack the relays whose target stayed silent for a probe timeout."""
    for seq, relay in list(s._relays.items()):
        if now >= relay.nack_at:
            del s._relays[seq]
            out.append(_nack(s, relay, False))


def _nack(s: SwimState, relay: _Relay, refused: bool) -> Outgoing:
    msg = Message(
        "nack",
        s.name,
        s.address,
        seq=relay.seq,
        target=relay.target,
        updates=piggyback(s),
        refused=refused,
    )
    return Outgoing(relay.requester, relay.requester_addr, msg)


# ---------------------------------------------------------------- verdicts and health


def _suspect(s: SwimState, target: str, now: float) -> None:
    rec = s._table.get(target)
    if rec is not None and rec.state in _LIVE:
        s._witnessed[target] = "our probe failed"
        update = Update(target, rec.address, SUSPECT, rec.incarnation, source=s.name)
        apply(s, update, now, True, s.name)


def _declare_dead(s: SwimState, target: str, now: float, reason: str, seen: bool) -> None:
    """``target`` is dead by this member's verdict; ``seen``: our own probe just failed
    (else it is a suspicion, perhaps only others', that ran out). A death we had only
    heard of becomes one we witnessed."""
    rec = s._table.get(target)
    if rec is None or rec.state == LEFT:
        return
    if seen:
        s._witnessed[target] = reason
    if rec.state in _LIVE:
        s.log.append((now, target, "declared-dead", reason))
        update = Update(target, rec.address, DEAD, rec.incarnation, source=s.name)
        apply(s, update, now, True, s.name)
    elif seen:
        s.log.append((now, target, "confirmed-dead", reason))


def expire_suspicions(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Confirmed suspicions that ran out become deaths. One that nobody confirmed
    gets a last probe first (carrying the suspicion): if the suspect answers, it
    refutes in its ack; only if it stays silent is it dead. This catches the rare
    member that missed a refutation on every one of its retransmissions."""
    for member, susp in list(s._suspicions.items()):
        if susp.deadline() > now:
            continue
        s._drop_suspicion(member)
        if susp.confirmers:
            why = f"suspicion timeout, {len(susp.confirmers)} confirmations"
            _declare_dead(s, member, now, why, seen=False)
            continue
        s._verifying[member] = susp
        seq = s._probing.get(member)
        if seq is not None:
            s._probes[seq].verify = True
            continue
        rec = s._table.get(member)
        assert rec is not None
        period = health_scaled(s.cfg.protocol_period, s._awareness)
        timeout = health_scaled(s.cfg.probe_timeout, s._awareness)
        probe = _Probe(s._new_seq(), member, rec.address, now + timeout, now + period, verify=True)
        s._probes[probe.seq] = probe
        s._probing[member] = probe.seq
        out.append(ping(s, member, rec, probe.seq))


def on_late_tick(s: SwimState, now: float) -> None:
    """Our own event loop stalled: raise local health, void the probes in flight
    (their silence proves nothing about the targets), hold suspicion timers for
    a period so that the messages that queued up meanwhile are read first."""
    s._bump_awareness(1)
    for probe in list(s._probes.values()):
        s._end_probe(probe)
    for member, susp in s._verifying.items():
        s._hold_suspicion(member, susp)  # already due: checked again after the grace
    s._verifying.clear()
    s._next_probe = now + health_scaled(s.cfg.protocol_period, s._awareness)
    s._grace_until = now + s.cfg.protocol_period
    s.log.append((now, s.name, "late-tick", str(s._awareness)))
