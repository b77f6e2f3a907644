"""Push-pull anti-entropy: which member rows one exchange carries. Pure.

Gossip tells everyone within a few periods but may miss a member now and then (a
lost message, a queue past its retransmit limit, a partition). Push-pull repairs
that: now and then each member sends rows of its table to one random member, which
merges them and answers with rows of its own
(:func:`~hypermesh.agent.gossip.dissemination.on_push_pull`).

memberlist, and Serf and Consul over it, send the whole table both ways and
stretch the interval like log N past 32 members; Lifeguard leaves push-pull as it
is. An exchange then costs O(N) bytes and a member's push-pull traffic grows like
N / log N per second: 1,000 rows per message at 1,000 members, 20 MB at 10,000
members with full meta, five times gRPC's default message limit. Here one message
carries at most K = ``cfg.push_pull_rows`` rows, so an exchange costs the same at
any N (and :func:`~hypermesh.agent.gossip.suspicion.push_pull_period` stops
growing at K members). The rows, in this order:

1. the sender's own row, always: the peer hears of the sender first-hand (a join,
   a refutation, new meta) whatever else fits;
2. in a reply, corrections: each row of the request about which this member holds
   newer news (:func:`newer`), so that each row a request carries ends up equal at
   both ends, whichever end was behind;
3. the rows whose membership changed most recently (a new member, a new state,
   incarnation or address; not new meta alone, which the member itself repeats
   with its next change), newest first, each in up to :data:`RECENT_SENDS`
   exchanges: news gossip missed is most likely recent news, and after a
   partition heals, the deaths and refutations it caused are what both sides need
   first. Corrections and recent rows together take at most K // 2 places;
4. the rest from a cursor that walks the table position by position, on from
   where this member's previous exchange (request or reply) left it; a row already
   in the message counts as passed.

So every exchange moves the cursor at least ``K - 1 - K // 2`` positions, and each
row of this member's table goes out within ``ceil(N / (K - 1 - K // 2))`` of its
exchanges (31 rows an exchange at K = 64), whatever else is going on. A row that
gossip missed at one member reaches it after about ``N / (2 * (K - 1 - K // 2))``
push-pull periods on average: the member takes part in about two exchanges a
period (its own and one it answers), each carrying the row with a chance of at
least ``(K - 1 - K // 2) / N``. That is the price of the bound: at 1,000 members
about 16 periods of 60 s, where whole tables every 180 s took one. It buys a cost
per member that stays flat past K members. A mesh of at most K members exchanges
its whole table in table order, exactly as before.

Joining (:func:`page`): a joining member asks its seed for page 1; the seed answers
with its own row and the next K - 1 rows of its table from position 0, and names
the page that follows; the joiner asks for it at once, until the seed names none.
Paging, rather than one join reply as large as the table: the join still costs the
seed O(N) rows, since the joiner must learn them from someone, but only once per
join, in messages no larger than any other push-pull (none outgrows gRPC's message
limit, nor holds the seed's stream for long), and the joiner holds the whole table
after ``ceil(N / (K - 1))`` round trips: 16 at 1,000 members, milliseconds on a LAN.
Positions shift when the seed forgets a member mid-join, so a page may skip a row;
gossip and the cursor's sweep bring it later.

Called by :mod:`~hypermesh.agent.gossip.dissemination` and
:class:`~hypermesh.agent.gossip.state.SwimState` only; the cursor
(``_pp_cursor``) and the recent changes (``_changed``, kept by
:meth:`~hypermesh.agent.gossip.state.SwimState._store`) are written only here and
there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hypermesh.agent.gossip.broadcast import Update
from hypermesh.agent.gossip.members import _LIVE, _Member, supersedes

if TYPE_CHECKING:
    from hypermesh.agent.gossip.state import SwimState

__all__ = ["RECENT_SENDS", "newer", "page", "reply_rows", "request_rows"]

RECENT_SENDS = 3
"""Exchanges that carry a membership change as a recent row before it is left to the
cursor. More: a change reaches more members by push-pull as well as by gossip, and
holds its place longer (at most K // 2 recent rows go into one message)."""


def request_rows(s: SwimState) -> tuple[Update, ...]:
    """The rows of a push-pull request: the whole table up to K members, else at most
    K rows (own, recent, cursor)."""
    if s._table.count() <= s.cfg.push_pull_rows:
        return s._table_rows()
    return _bounded(s, ())


def reply_rows(s: SwimState, request: Iterable[Update]) -> tuple[Update, ...]:
    """The rows of a reply to a push-pull whose rows were ``request`` (already merged):
    the whole table up to K members, else at most K rows (own, corrections of the
    request's rows, recent, cursor)."""
    if s._table.count() <= s.cfg.push_pull_rows:
        return s._table_rows()
    return _bounded(s, request)


def page(s: SwimState, start: int) -> tuple[tuple[Update, ...], int]:
    """One page of this member's table for a joining member: its own row and up to
    K - 1 rows from table position ``start`` on; and 1 + the position the next page
    starts at, or 0 when the table ends in this page. A whole table of at most K
    members is one page, in table order."""
    table = s._table
    k = s.cfg.push_pull_rows
    if start == 0 and table.count() <= k:
        return s._table_rows(), 0
    rows = [_own(s)]
    size = table.size()
    pos = start
    while pos < size and len(rows) < k:
        name = table.name_at(pos)
        pos += 1
        rec = table.get(name)
        if rec is not None and name != s.name:
            rows.append(rec.as_row(name))
    return tuple(rows), (pos + 1 if pos < size else 0)


def newer(cur: _Member, row: Update) -> bool:
    """Whether ``cur``, this member's record of ``row.member``, is newer news than
    ``row``: it supersedes it by the precedence rules, or both are live at one
    incarnation and ``cur`` carries a later meta version."""
    if supersedes(cur.state, cur.incarnation, row.state, row.incarnation):
        return True
    return (
        cur.state in _LIVE
        and row.state in _LIVE
        and cur.incarnation == row.incarnation
        and cur.meta_version > row.meta_version
    )


def _own(s: SwimState) -> Update:
    rec = s._table.get(s.name)
    assert rec is not None  # a member never forgets itself
    return rec.as_row(s.name)


def _bounded(s: SwimState, request: Iterable[Update]) -> tuple[Update, ...]:
    """At most K rows: own, corrections of ``request``, recent changes, then the cursor."""
    table = s._table
    k = s.cfg.push_pull_rows
    rows = [_own(s)]
    chosen = {s.name}
    priority = k // 2  # places for corrections and recent rows together
    for u in request:
        if len(rows) > priority:
            break
        cur = table.get(u.member)
        if cur is not None and u.member not in chosen and newer(cur, u):
            rows.append(cur.as_row(u.member))
            chosen.add(u.member)
    recent = []
    for name in reversed(s._changed):
        if len(rows) > priority:
            break
        rec = table.get(name)
        if rec is not None and name not in chosen:
            rows.append(rec.as_row(name))
            chosen.add(name)
            recent.append(name)
    for name in recent:
        sends = s._changed[name] + 1
        if sends >= RECENT_SENDS:
            del s._changed[name]
        else:
            s._changed[name] = sends
    size = table.size()
    pos = s._pp_cursor % size
    for _ in range(size):
        if len(rows) >= k:
            break
        name = table.name_at(pos)
        pos = pos + 1 if pos + 1 < size else 0
        rec = table.get(name)
        if rec is not None and name not in chosen:
            rows.append(rec.as_row(name))
            chosen.add(name)
    s._pp_cursor = pos
    return tuple(rows)
