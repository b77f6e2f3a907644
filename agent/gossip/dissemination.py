"""SWIM's dissemination half: how news about members spreads and how it is merged.

Merging (memberlist's aliveNode/suspectNode/deadNode and mergeState):
:func:`apply` takes one update by the precedence of
:func:`~hypermesh.agent.gossip.members.supersedes`, starts a Lifeguard
:class:`~hypermesh.agent.gossip.suspicion.Suspicion` for a new suspect (or
counts a confirmation of a held one), and refutes news that this member is
suspect or dead; :func:`merge_table` takes a push-pull table.

Spreading: every message carries queued updates (:func:`piggyback`,
:func:`message`, :func:`ping`), a gossip round sends them to a few random
members besides (:func:`gossip_round`), and tables are exchanged by push-pull:
periodically with a random member, now and then with a dead one (to heal a
partition), and with a seed on joining (:func:`join`), page by page. Which rows
an exchange carries, at most ``cfg.push_pull_rows`` however large the mesh, is
:mod:`~hypermesh.agent.gossip.antientropy`'s choice. News of this
member itself starts here too: new meta (:func:`publish_meta`) and leaving
(:func:`leave`).

What it guarantees: news is re-gossiped only when it changed what this member
knows (or confirmed a suspicion it holds); a member's incarnation here rises
only with its own alive rows (or its own left), never with others' claims about
it (:func:`_refusal`); the table never grows past ``cfg.max_members``; a member
that has not left answers
a suspicion or death of itself at its incarnation (or above) with a higher one,
and a stale one by spreading its current alive update again; a push-pull never
makes a death here on its own (a reported death counts as a suspicion, which
its member can still refute).

It holds no state: every function works on the
:class:`~hypermesh.agent.gossip.state.SwimState` it is given, called from
:class:`~hypermesh.agent.gossip.swim.Swim`'s event methods or from
:mod:`~hypermesh.agent.gossip.probe`. Pure, like both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from hypermesh.agent.gossip import antientropy
from hypermesh.agent.gossip.broadcast import (
    ALIVE,
    DEAD,
    LEFT,
    STATES,
    SUSPECT,
    Message,
    Outgoing,
    Update,
)
from hypermesh.agent.gossip.members import _LIVE, _Member, supersedes
from hypermesh.agent.gossip.state import SwimState
from hypermesh.agent.gossip.suspicion import (
    Suspicion,
    expected_confirmations,
    health_scaled,
    push_pull_period,
    suspicion_bounds,
)
from hypermesh.agent.gossip.trust import (
    INCARNATION,
    LEFT_BY_OTHER,
    MAX_COUNTER,
    OVERSIZED,
    TABLE_FULL,
)

_INF = math.inf
_ALIVE_CODE = STATES.index(ALIVE)

# ---------------------------------------------------------------- merging


def apply(s: SwimState, u: Update, now: float, gossip: bool, sender: str) -> None:
    """Merge one update that ``sender`` sent (this member, for its own verdicts) by
    the precedence rules, unless :func:`_refusal` refuses it; re-gossip it if it
    was news (quietly if it only changed the member's load, see :func:`quiet_change`)."""
    quiet = False
    if u.meta_json is not None and len(u.meta_json) > s.cfg.max_meta_bytes:
        s.refusals.add(OVERSIZED, f"{len(u.meta_json)} bytes of meta for {u.member}")
        return
    if u.member == s.name:
        _about_me(s, u, now)
        return
    cur = s._table.get(u.member)
    if cur is None:
        if u.state != ALIVE:
            return  # suspicions and deaths of strangers are no news to act on
        if not s._make_room():
            s.refusals.add(TABLE_FULL, f"{u.member} from {sender}")
            return
        meta = u.meta_json if u.meta_json is not None else "{}"
        s._store(u.member, _Member(u.address, ALIVE, u.incarnation, u.meta_version, meta, now))
        s._record(u.member, "", ALIVE, now)
        s._meta_changed[u.member] = None
    elif u.state == ALIVE:
        old_meta, same_life = cur.meta_json, u.incarnation == cur.incarnation
        if not _apply_alive(s, u, cur, now):
            return
        quiet = same_life and quiet_change(s.cfg.quiet_meta, old_meta, u.meta_json)
    elif (why := _refusal(u, cur, sender)) is not None:
        s.refusals.add(why, f"{u.state} {u.member} at {u.incarnation} from {sender}")
        if cur.state == SUSPECT:
            # Honest news of a newer incarnation means we missed a refutation: our
            # own probe of the suspect carries our suspicion, and its ack the answer.
            s._to_confirm.add(u.member)
        return
    elif u.state == SUSPECT and cur.state == SUSPECT and u.incarnation == cur.incarnation:
        susp = s._suspicions.get(u.member)
        if susp is None or not susp.confirm(u.source):
            return
        s._confirmed(susp, now)
    elif supersedes(u.state, u.incarnation, cur.state, cur.incarnation):
        s._store(
            u.member,
            _Member(cur.address, u.state, u.incarnation, cur.meta_version, cur.meta_json, now),
        )
        s._record(u.member, cur.state, u.state, now)
        s._drop_suspicion(u.member)
        if u.state == SUSPECT:
            low, high = suspicion_bounds(s._n_live, s.cfg)
            if u.source == s.name:
                # Our own accusation, alone, waits as long as we are sick; once
                # healthy members confirm it, our health no longer matters.
                high = health_scaled(high, s._awareness)
            k = expected_confirmations(s._n_live, s.cfg)
            s._hold_suspicion(u.member, Suspicion(now, u.source, k, low, high))
            # About 2k members check an accusation for themselves (all of them in
            # a small mesh): enough confirmations, no storm of pings at the suspect.
            # The one that acts on deaths always does (``confirm_all``).
            if u.source != s.name and (
                s.confirm_all or s._rng.random() * s._n_live < 2 * k + 2
            ):
                s._to_confirm.add(u.member)
    else:
        return
    if gossip:
        s._queue.push(u, quiet)


def stale_row(s: SwimState, row: Any) -> bool:
    """Whether a raw update row (``[member, address, state code, incarnation, meta
    version, ...]``, see :meth:`Update.to_wire`) is an alive row about another member
    that this member holds at a newer incarnation, or at the same incarnation with the
    same meta version or a newer one. :func:`apply` would change nothing for it, so it
    need not be checked or decoded. Anything else, malformed rows included, is read."""
    if type(row) is not list or len(row) < 4:
        return False
    member, code, incarnation = row[0], row[2], row[3]
    if type(code) is not int or code != _ALIVE_CODE or type(incarnation) is not int:
        return False
    cur = s._table.get(member) if type(member) is str and member != s.name else None
    if cur is None:
        return False
    if incarnation != cur.incarnation:
        return incarnation < cur.incarnation
    version = row[4] if len(row) > 4 else 0
    return type(version) is int and version <= cur.meta_version


def quiet_change(keys: frozenset[str], old_json: str, new_json: str | None) -> bool:
    """Whether a member's meta went from ``old_json`` to ``new_json`` changing only
    ``keys`` (``GossipConfig.quiet_meta``): news that need not start gossip rounds.

    The same meta at a newer version is quiet too: a busy one-slot node's counts go
    from 1 to 0 and back between two of its versions, and a member that missed the
    one between sees no change at all."""
    if not keys or new_json is None:
        return False
    if new_json == old_json:
        return True
    old, new = json.loads(old_json), json.loads(new_json)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return False
    return all(old.get(k) == new.get(k) for k in old.keys() | new.keys() if k not in keys)


def _refusal(u: Update, cur: _Member, sender: str) -> str | None:
    """Why a suspect, dead or left claim ``u`` about a known member is not believed
    (None: it is weighed by the precedence rules).

    Only a member raises its own incarnation, in the alive rows it announces (its
    join, its refutations): what this member holds for it, ``cur.incarnation``, is
    the highest it has heard the member announce, since nothing else raises it. A
    claim above it was made about an incarnation the member never announced as far
    as we know, so it is refused: a forged death at incarnation + 1000 would
    otherwise be irrefutable until the member's own incarnation caught up. An
    honest accuser's claim is above ours only if we missed the member's latest
    refutation; then our own probe (see :func:`apply`) or the member's next alive
    row catches us up, and push-pull repairs the rest. A left above it is taken
    only from the member itself: leaving is the one claim only its subject makes.
    """
    if u.incarnation <= cur.incarnation:
        return None
    if u.state == LEFT:
        return None if sender == u.member else LEFT_BY_OTHER
    return INCARNATION


def _apply_alive(s: SwimState, u: Update, cur: _Member, now: float) -> bool:
    """An alive row orders by (incarnation, meta version): a higher incarnation's
    meta is the member's newest whatever its version. Within one life a member's
    meta version never falls as its incarnation rises; a member restarted under
    the same name counts its meta versions from 1 again, and once it has refuted
    the old life's rows it is its new meta, not the old life's, that counts."""
    take_meta = u.meta_json is not None and (
        u.incarnation > cur.incarnation or u.meta_version >= cur.meta_version
    )
    meta_json = u.meta_json if take_meta and u.meta_json is not None else cur.meta_json
    version = u.meta_version if take_meta else cur.meta_version
    if u.incarnation > cur.incarnation:
        since = cur.since if cur.state == ALIVE else now
        s._store(u.member, _Member(u.address, ALIVE, u.incarnation, version, meta_json, since))
        s._drop_suspicion(u.member)
        if cur.state != ALIVE:
            s._record(u.member, cur.state, ALIVE, now)
    elif (
        u.incarnation == cur.incarnation
        and u.meta_version > cur.meta_version
        and take_meta
        and cur.state in _LIVE
    ):
        s._store(
            u.member,
            _Member(cur.address, cur.state, cur.incarnation, version, meta_json, cur.since),
        )
    else:
        return False
    if take_meta and meta_json != cur.meta_json:
        s._meta_changed[u.member] = None
    return True


def _about_me(s: SwimState, u: Update, now: float) -> None:
    """News about this member: refute suspicion and death, catch up with stale
    incarnations from an earlier life under the same name, and outbid a row of this
    incarnation at another address (an earlier life's, before a restart at a new
    address), which peers would otherwise keep: a row of the same incarnation does not
    replace theirs."""
    if s._left:
        return
    if u.state == ALIVE:
        if (
            u.incarnation > s._incarnation
            or u.meta_version > s._meta_version
            or (u.incarnation == s._incarnation and u.address != s.address)
        ):
            _refute(s, u, now)
    elif u.incarnation >= s._incarnation:
        s._bump_awareness(1)
        s.log.append((now, s.name, "refuted", u.state))
        _refute(s, u, now)
    elif u.state != LEFT and s.name not in s._queue:
        # An accusation we already refuted is still going round: whoever carries it
        # missed the refutation, so spread it again (no new incarnation needed).
        s._queue.push(s._self_update())


def _refute(s: SwimState, u: Update, now: float) -> None:
    # Capped at the largest incarnation decoding accepts: a claim at the cap (which
    # only a forger makes) then goes unanswered rather than making our own rows
    # unreadable to everyone.
    s._incarnation = min(MAX_COUNTER, max(s._incarnation, u.incarnation) + 1)
    if u.meta_version > s._meta_version:
        s._meta_version = min(MAX_COUNTER, u.meta_version + 1)
    s._store_self(now)
    s._queue.push(s._self_update())


def merge_table(s: SwimState, msg: Message, now: float) -> None:
    """Push-pull merge. A reported death only counts as a suspicion here (the
    member can still refute it); news about the peer itself and new suspicions
    are gossiped on, the rest stays a local repair."""
    table = s._table
    for u in msg.table:
        cur = table.get(u.member)
        if cur is not None and cur.row is u:
            continue  # the very record we hold (shared roster entries): nothing new
        if u.state == DEAD or (u.state == SUSPECT and not u.source):
            u = Update(u.member, u.address, SUSPECT, u.incarnation, source=msg.sender)
        apply(s, u, now, u.member == msg.sender or u.state == SUSPECT, msg.sender)


# ---------------------------------------------------------------- push-pull and joining


def push_pull_request(s: SwimState, name: str, address: str, page: int = 0) -> Outgoing:
    """A push-pull request to ``name``: this member's whole table up to
    ``cfg.push_pull_rows`` members, else that many rows of it (see
    :mod:`~hypermesh.agent.gossip.antientropy`); asking for ``page`` of its table
    (see :class:`~hypermesh.agent.gossip.broadcast.Message`), from page 2 on with
    only this member's own row."""
    if page > 1:
        own = s._table.get(s.name)
        assert own is not None
        rows: tuple[Update, ...] = (own.as_row(s.name),)
    else:
        rows = antientropy.request_rows(s)
    msg = Message("push_pull", s.name, s.address, table=rows, page=page)
    return Outgoing(name, address, msg)


def on_push_pull(s: SwimState, msg: Message, now: float, out: list[Outgoing]) -> None:
    """A push-pull request: merge the peer's rows, answer with ours (the page it asked
    for, if it asked for one)."""
    merge_table(s, msg, now)
    if msg.page:
        rows, next_page = antientropy.page(s, msg.page - 1)
    else:
        rows, next_page = antientropy.reply_rows(s, msg.table), 0
    reply = Message("push_pull_reply", s.name, s.address, table=rows, page=next_page)
    out.append(Outgoing(msg.sender, msg.sender_addr, reply))


def on_push_pull_reply(s: SwimState, msg: Message, now: float, out: list[Outgoing]) -> None:
    """The answer to our push-pull: merge it. From the seed we join through, it is a
    page of its table: ask for the next one (a later page than the last, and one a
    table of ``max_members`` can have), or, when there is none, the join is complete."""
    merge_table(s, msg, now)
    if msg.sender != s._join_target:
        return
    if not s._left and s._join_page < msg.page <= s.cfg.max_members + 1:
        s._join_page = msg.page
        s._join_retry_at = now + 2 * s.cfg.protocol_period
        out.append(push_pull_request(s, s._join_target, s._join_addr, page=msg.page))
        return
    s._join_pending, s._join_target, s._join_retry_at = [], "", _INF
    s._join_addr, s._join_page = "", 0


def push_pull_round(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Push-pull with one random alive member; the next round is a push-pull period on."""
    s._next_push_pull = now + push_pull_period(s._n_live, s.cfg)
    for name in s._random_members(1, (s.name,), (ALIVE,)):
        rec = s._table.get(name)
        assert rec is not None
        out.append(push_pull_request(s, name, rec.address))


def reconnect_round(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Push-pull with one random dead member, now and then: after a partition
    heals, the first exchange across it makes both ends refute their deaths."""
    s._next_reconnect = now + s.cfg.reconnect_interval
    # Attempt with probability dead/live: the whole mesh then tries each dead
    # member about once per interval, however large it is.
    if s._dead and s._rng.random() * max(1, s._n_live - 1) < len(s._dead):
        name = s._rng.choice(list(s._dead))
        rec = s._table.get(name)
        if rec is not None:
            out.append(push_pull_request(s, name, rec.address))


def join(s: SwimState, seeds: Sequence[tuple[str, str]], now: float, out: list[Outgoing]) -> None:
    """Learn ``seeds`` as alive members (incarnation 0), queue news of this member,
    and push-pull with one seed (in random order)."""
    pending = []
    for name, address in seeds:
        if name == s.name:
            continue
        if s._table.get(name) is None:
            apply(s, Update(name, address, ALIVE, 0), now, False, s.name)
        pending.append((name, address))
    s._rng.shuffle(pending)
    s._join_pending = pending
    s._queue.push(s._self_update())
    join_next(s, now, out)


def join_next(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Push-pull with the next untried seed, if any, asking for the first page of its
    table; each page is retried with the next seed after two periods without an answer."""
    s._join_target, s._join_addr, s._join_page, s._join_retry_at = "", "", 0, _INF
    if s._join_pending:
        name, address = s._join_pending.pop()
        s._join_target, s._join_addr, s._join_page = name, address, 1
        s._join_retry_at = now + 2 * s.cfg.protocol_period
        out.append(push_pull_request(s, name, address, page=1))


# ---------------------------------------------------------------- news of this member


def publish_meta(s: SwimState, meta: dict[str, Any], now: float) -> None:
    """New meta for this member: a new meta version, spread as an alive update
    (a quiet one when only ``quiet_meta`` keys changed)."""
    old_json, s._meta_json = s._meta_json, s._checked_meta(meta)
    s._meta_version = min(MAX_COUNTER, s._meta_version + 1)
    s._store_self(now)
    s._meta_changed[s.name] = None
    s._queue.push(s._self_update(), quiet_change(s.cfg.quiet_meta, old_json, s._meta_json))


def leave(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """Announce that this member left, stop every round but gossip, and gossip now."""
    if s._left:
        return
    s._left = True
    s._record(s.name, ALIVE, LEFT, now)
    s._store(s.name, _Member(s.address, LEFT, s._incarnation, s._meta_version, s._meta_json, now))
    s._queue.push(Update(s.name, s.address, LEFT, s._incarnation, source=s.name))
    for p in list(s._probes.values()):
        s._end_probe(p)
    s._next_probe = s._next_push_pull = s._next_reconnect = _INF
    s._join_retry_at = _INF
    gossip_round(s, now, out)


# ---------------------------------------------------------------- piggybacking


def gossip_round(s: SwimState, now: float, out: list[Outgoing]) -> None:
    """One gossip round: queued updates to ``gossip_fanout`` random live members."""
    s._next_gossip = now + s.cfg.gossip_interval
    limit = s._retransmit_limit()
    for name in s._random_members(s.cfg.gossip_fanout, (s.name,), _LIVE):
        updates = s._queue.take(s.cfg.max_piggyback, limit)
        if not updates:
            break
        rec = s._table.get(name)
        assert rec is not None
        msg = Message("gossip", s.name, s.address, updates=tuple(updates))
        out.append(Outgoing(name, rec.address, msg))


def ping(s: SwimState, target: str, rec: _Member, seq: int) -> Outgoing:
    """A ping; to a suspect it carries the suspicion first (to a member reported dead,
    the death), so the suspect hears of it from whoever probes it and can refute at
    once (Lifeguard's buddy system)."""
    updates: list[Update] = []
    if rec.state in (SUSPECT, DEAD):
        susp = s._suspicions.get(target)
        accuser = susp.accuser if susp else s.name
        updates.append(Update(target, rec.address, rec.state, rec.incarnation, source=accuser))
    updates += s._queue.take(
        s.cfg.max_piggyback - len(updates),
        s._retransmit_limit(),
        skip=target if updates else "",
    )
    msg = Message("ping", s.name, s.address, seq=seq, target=target, updates=tuple(updates))
    return Outgoing(target, rec.address, msg)


def message(
    s: SwimState,
    to: str,
    address: str,
    kind: str,
    seq: int = 0,
    target: str = "",
    target_addr: str = "",
) -> Outgoing:
    """A protocol message from this member with queued updates riding on it."""
    msg = Message(
        kind,
        s.name,
        s.address,
        seq=seq,
        target=target,
        target_addr=target_addr,
        updates=piggyback(s),
    )
    return Outgoing(to, address, msg)


def piggyback(s: SwimState) -> tuple[Update, ...]:
    """The queued updates for one message (each taken counts a transmission)."""
    if not s._queue:
        return ()
    return tuple(s._queue.take(s.cfg.max_piggyback, s._retransmit_limit()))
