"""The member table of :mod:`~hypermesh.agent.gossip.swim`: records, roster and precedence.

:func:`supersedes` is the rule by which news about a member replaces what is
known; :class:`_Member` is one immutable record; :class:`Roster` is a shared,
read-only starting membership; :class:`_Table` is one member's private overlay
over an optional roster. :class:`MemberView` is the public snapshot of a record.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hypermesh.agent.gossip.broadcast import ALIVE, DEAD, LEFT, SUSPECT, Update, encode_meta

__all__ = ["MemberView", "Roster", "supersedes"]

_LIVE = (ALIVE, SUSPECT)
_GONE = (DEAD, LEFT)


@dataclass(frozen=True)
class MemberView:
    """What one member currently believes about another (or itself)."""

    name: str
    address: str
    state: str
    incarnation: int
    meta: dict[str, Any]
    meta_version: int
    state_since: float


def supersedes(new_state: str, new_inc: int, cur_state: str, cur_inc: int) -> bool:
    """Whether news ``(new_state, new_inc)`` about a member replaces ``(cur_state, cur_inc)``.

    * alive wins over anything with a strictly higher incarnation (a refutation);
    * suspect wins over alive with an equal or higher incarnation, and over
      suspect only with a higher one;
    * dead wins over alive and suspect with an equal or higher incarnation;
    * left wins over alive, suspect and dead with an equal or higher incarnation;
    * nothing but a higher alive replaces dead or left.
    """
    if new_state == ALIVE:
        return new_inc > cur_inc
    if new_inc < cur_inc:
        return False
    if new_state == SUSPECT:
        return cur_state == ALIVE or (cur_state == SUSPECT and new_inc > cur_inc)
    if new_state == DEAD:
        return cur_state in _LIVE
    return cur_state != LEFT  # left


class _Member:
    """One member's record. Treated as immutable: changes replace it, so that
    records can be shared between simulated members (see :class:`Roster`)."""

    __slots__ = ("address", "incarnation", "meta_json", "meta_version", "row", "since", "state")

    def __init__(
        self,
        address: str,
        state: str,
        incarnation: int,
        meta_version: int,
        meta_json: str,
        since: float,
    ) -> None:
        self.address = address
        self.state = state
        self.incarnation = incarnation
        self.meta_version = meta_version
        self.meta_json = meta_json
        self.since = since
        self.row: Update | None = None  # this record as a push-pull row, built once

    def as_row(self, name: str) -> Update:
        row = self.row
        if row is None:
            meta = self.meta_json if self.state in _LIVE else None
            row = Update(name, self.address, self.state, self.incarnation, self.meta_version, meta)
            self.row = row
        return row


_FORGOTTEN = _Member("", LEFT, -1, 0, "{}", 0.0)


class Roster:
    """A starting membership, all alive at incarnation 0, shared read-only.

    A simulation aid: thousands of simulated members can start from one roster
    instead of each holding its own copy of the whole table (each keeps only
    what changed). A real agent starts without one and joins. With ``meta``, every
    member starts with that meta at meta version 1 (rows as large as real ones).
    """

    def __init__(
        self,
        members: Sequence[tuple[str, str]],
        now: float = 0.0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        version, meta_json = (1, encode_meta(meta)) if meta else (0, "{}")
        self.names: tuple[str, ...] = tuple(name for name, _ in members)
        self.ring: tuple[str, ...] = tuple(sorted(self.names))  # the probe ring's order
        self.ring_index: dict[str, int] = {name: i for i, name in enumerate(self.ring)}
        self.records: dict[str, _Member] = {
            name: _Member(address, ALIVE, 0, version, meta_json, now) for name, address in members
        }
        if len(self.records) != len(self.names):
            raise ValueError("roster names must be unique")


class _Table:
    """name -> record: a private overlay over an optional shared roster.

    Its *ring* orders every slot (forgotten roster members keep theirs) by name: the
    roster's names sorted, then the others sorted. Members that hold the same names
    hold the same ring, which the probe order relies on (``probe._next_target``)."""

    def __init__(self, roster: Roster | None) -> None:
        self._base: dict[str, _Member] = roster.records if roster else {}
        self._base_names: tuple[str, ...] = roster.names if roster else ()
        self._ring: tuple[str, ...] = roster.ring if roster else ()
        self._ring_index: dict[str, int] = roster.ring_index if roster else {}
        self._local: dict[str, _Member] = {}
        self._extra: list[str] = []  # names not in the roster, in the order first held
        self._extra_ring: list[str] = []  # the same, sorted: positions (name_at) stay put
        self._forgotten = 0  # roster members forgotten (they keep their slot in size())

    def count(self) -> int:
        """Members held (forgotten roster members not counted)."""
        return self.size() - self._forgotten

    def get(self, name: str) -> _Member | None:
        rec = self._local.get(name)
        if rec is None:
            return self._base.get(name)
        return None if rec is _FORGOTTEN else rec

    def set(self, name: str, rec: _Member) -> None:
        old = self._local.get(name)
        if old is None and name not in self._base:
            self._extra.append(name)
            bisect.insort(self._extra_ring, name)
        elif old is _FORGOTTEN:
            self._forgotten -= 1
        self._local[name] = rec

    def forget(self, name: str) -> None:
        if name in self._base:
            if self._local.get(name) is not _FORGOTTEN:
                self._local[name] = _FORGOTTEN
                self._forgotten += 1
        elif self._local.pop(name, None) is not None:
            self._extra.remove(name)
            del self._extra_ring[bisect.bisect_left(self._extra_ring, name)]

    def size(self) -> int:
        return len(self._base_names) + len(self._extra)

    def name_at(self, i: int) -> str:
        n = len(self._base_names)
        return self._base_names[i] if i < n else self._extra[i - n]

    def ring_index(self, name: str) -> int:
        """``name``'s place in the ring (where it would go, if it holds no slot)."""
        i = self._ring_index.get(name)
        if i is not None:
            return i
        return len(self._ring) + bisect.bisect_left(self._extra_ring, name)

    def ring_at(self, i: int) -> str:
        n = len(self._ring)
        return self._ring[i] if i < n else self._extra_ring[i - n]

    def items(self) -> Iterator[tuple[str, _Member]]:
        for i in range(self.size()):
            name = self.name_at(i)
            rec = self.get(name)
            if rec is not None:
                yield name, rec
