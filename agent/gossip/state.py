"""What one SWIM member knows and has in flight: :class:`SwimState`.

The member table (a private overlay over an optional shared
:class:`~hypermesh.agent.gossip.members.Roster`), this member's own incarnation
and meta, the suspicions it holds, its probes and relays in flight, its timers,
its local health (Lifeguard awareness), and the queue of updates waiting to ride
on messages. Pure: no I/O, no clock; every change is made at a ``now`` its
caller passes.

What it guarantees, through the primitives below (the only code that writes the
fields they name):

* ``_n_live``, ``_dead`` and ``_gone`` agree with the table after every
  :meth:`~SwimState._store` (this member is never in ``_gone``), and
  ``_witnessed`` holds no alive member;
* ``_unheard`` holds exactly the members of the table that this member has not
  heard directly at their current address (:meth:`~SwimState._store` adds a
  member new to the table or whose address changed, :meth:`~SwimState._heard_from`
  removes one); never this member itself, and never a member of the roster
  it started from until that member's address changes;
* the table holds at most ``cfg.max_members`` members (:meth:`~SwimState._make_room`);
* ``_susp_next`` is never later than the earliest suspicion deadline
  (:meth:`~SwimState._hold_suspicion`, :meth:`~SwimState._drop_suspicion`);
* ``_probing`` maps each member under probe to its one probe in ``_probes``
  (:meth:`~SwimState._end_probe` removes both);
* the awareness score stays within ``0 .. cfg.awareness_max``;
* ``_changed`` holds, oldest first, at most ``cfg.push_pull_rows`` members of the
  table other than this one whose membership (state, incarnation, address) changed
  and which push-pull has not yet sent as recent rows ``RECENT_SENDS`` times (see
  :mod:`~hypermesh.agent.gossip.antientropy`, which alone takes them out, and moves
  the push-pull cursor ``_pp_cursor``).

Who may change it: the primitives below, and the functions of
:mod:`~hypermesh.agent.gossip.probe` and
:mod:`~hypermesh.agent.gossip.dissemination`, called by the event methods of
:class:`~hypermesh.agent.gossip.swim.Swim` (which is a ``SwimState`` and writes
no field itself), within one event. The underscored fields are private to these
modules (as unexported fields are to a Go package); everyone else reads through
``Swim``'s views.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypermesh.agent.gossip.broadcast import (
    ALIVE,
    DEAD,
    LEFT,
    BroadcastQueue,
    Update,
    encode_meta,
)
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.members import _GONE, _LIVE, Roster, _Member, _Table
from hypermesh.agent.gossip.suspicion import Suspicion, push_pull_period, retransmit_limit
from hypermesh.agent.gossip.trust import Refusals

__all__ = ["SwimState"]

_INF = math.inf


@dataclass(slots=True)
class _Probe:
    """One probe of ``target`` in flight: direct until ``timeout_at``, then indirect
    through ``sent`` others until ``end_at``."""

    seq: int
    target: str
    address: str
    timeout_at: float
    end_at: float
    indirect: bool = False
    direct_refused: bool = False
    verify: bool = False  # a last check of an unconfirmed suspicion before it becomes a death
    sent: int = 0  # ping_reqs sent
    via: set[str] = field(default_factory=set)  # probers yet to answer (a nack, or our
    # send to the prober failed, is an answer)
    refused_by: set[str] = field(default_factory=set)  # probers that saw a refusal


@dataclass(slots=True)
class _Relay:
    """A ping this member sent for ``requester``'s indirect probe of ``target``:
    an ack is forwarded, silence until ``nack_at`` is answered with a nack."""

    requester: str
    requester_addr: str
    seq: int
    target: str
    nack_at: float


class SwimState:
    """One member's protocol state, and the primitives that keep it consistent.

    It makes no protocol decision of its own: what to probe, whom to suspect and
    what news to take is decided in :mod:`~hypermesh.agent.gossip.probe` and
    :mod:`~hypermesh.agent.gossip.dissemination`, which call these primitives.
    Built by :class:`~hypermesh.agent.gossip.swim.Swim`, whose owner is the only
    caller, always with a non-decreasing ``now``.
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
        self._susp_floor = -_INF  # when a confirmation last brought a deadline forward
        self._probes: dict[int, _Probe] = {}
        self._probing: dict[str, int] = {}  # target -> seq of our probe of it
        self._to_confirm: set[str] = set()  # suspects others accused: probe them ourselves
        # Check every accusation ourselves, not only as one of about 2k random members:
        # set on the member that acts on deaths (the leader), so that a death it must act
        # on is one it witnessed by then, with no probe left to wait for.
        self.confirm_all = False
        self._to_check: dict[str, None] = {}  # helpers that keep missing nacks: probe them
        self._missed_nacks: dict[str, int] = {}  # helper -> nacks missed since last heard
        # Members our own probes found silent or refusing since they were last alive,
        # and how: a death we witnessed, not one we only heard of.
        self._witnessed: dict[str, str] = {}
        # Members known only by hearsay (a row someone sent), never heard directly at
        # their current address: a name anyone could have made up (see _heard_from).
        self._unheard: set[str] = set()
        self.refusals = Refusals()  # news refused (see trust.py); the agent logs it
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        self._awareness = 0
        self._left = False
        self._events: list[tuple[str, str, str]] = []
        self._meta_changed: dict[str, None] = {}
        self.log: deque[tuple[float, str, str, str]] = deque(maxlen=256)
        self._grace_until = -_INF
        # Wall time less the ``now`` this member is given: the agent's ``now`` is
        # monotonic, and the probe ring's stride is drawn from the wall clock's period
        # number, which every member reads alike (``probe._next_target``).
        self.clock_offset = 0.0
        self._reclaim_in = 0  # probes until dead members are looked at for reclaiming
        self._join_pending: list[tuple[str, str]] = []
        self._join_target = ""
        self._join_addr = ""
        self._join_page = 0  # the page last asked of the join target (0: none)
        self._join_retry_at = _INF
        # Members whose membership changed lately (oldest first), with the push-pulls
        # that carried each as a recent row; and where push-pull's sweep goes on.
        self._changed: dict[str, int] = {}
        # Members sweep from different places (a hash of the name, not a random draw:
        # the draws, and so meshes of at most push_pull_rows, stay as they were).
        self._pp_cursor = zlib.crc32(name.encode())
        self._limit_cache = (-1, 0)
        self._store(name, _Member(address, ALIVE, 0, self._meta_version, self._meta_json, now))
        period = cfg.protocol_period
        self._next_probe = now + rng.uniform(0.0, period)
        self._next_gossip = now
        pp = push_pull_period(self._n_live, cfg)
        self._next_push_pull = now + rng.uniform(0.0, pp) if pp > 0 else _INF
        ri = cfg.reconnect_interval
        self._next_reconnect = now + rng.uniform(0.0, ri) if ri > 0 else _INF

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
        if rec.state == ALIVE:
            self._witnessed.pop(name, None)
        if name != self.name and (old is None or old.address != rec.address):
            self._unheard.add(name)
        if name != self.name and (
            old is None
            or old.state != rec.state
            or old.incarnation != rec.incarnation
            or old.address != rec.address
        ):
            self._changed.pop(name, None)
            self._changed[name] = 0
            if len(self._changed) > self.cfg.push_pull_rows:
                del self._changed[next(iter(self._changed))]
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
            self._forget(name)

    def _forget(self, name: str) -> None:
        del self._gone[name]
        self._dead.pop(name, None)
        self._witnessed.pop(name, None)
        self._unheard.discard(name)
        self._missed_nacks.pop(name, None)
        self._changed.pop(name, None)
        self._table.forget(name)

    def _make_room(self) -> bool:
        """Whether the table can take one more member (``cfg.max_members``); when it is
        full, the member longest dead or left is forgotten to make room, if any."""
        if self._table.count() < self.cfg.max_members:
            return True
        if not self._gone:
            return False
        self._forget(next(iter(self._gone)))  # in order of death, about: the oldest
        return True

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

    # ---------------------------------------------------------------- suspicions, probes, health

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

    def _confirmed(self, susp: Suspicion, now: float) -> None:
        """``susp`` just counted a confirmation, which may have brought its deadline
        forward, even to before ``now``: a suspicion timer that falls due that way is
        due from ``now`` on, not overdue (``_susp_floor``: a tick that fires it is not
        a late one, see :meth:`~hypermesh.agent.gossip.swim.Swim.tick`)."""
        self._susp_next = min(self._susp_next, susp.deadline())
        self._susp_floor = now

    def _end_probe(self, probe: _Probe) -> None:
        self._probes.pop(probe.seq, None)
        if self._probing.get(probe.target) == probe.seq:
            del self._probing[probe.target]

    def _bump_awareness(self, delta: int) -> None:
        self._awareness = min(self.cfg.awareness_max, max(0, self._awareness + delta))

    def _heard_from(self, member: str, address: str) -> None:
        """``member`` sent us a message from ``address``: if that is the address we hold
        for it, it is heard directly (it exists, and answers there), for as long as its
        record keeps that address."""
        if self._missed_nacks:
            self._missed_nacks.pop(member, None)
        if member in self._unheard:
            rec = self._table.get(member)
            if rec is not None and rec.address == address:
                self._unheard.discard(member)

    # ---------------------------------------------------------------- reading the table

    def _retransmit_limit(self) -> int:
        n, limit = self._limit_cache
        if n != self._n_live:
            limit = retransmit_limit(self._n_live, self.cfg)
            self._limit_cache = (self._n_live, limit)
        return limit

    def _random_members(
        self, count: int, exclude: tuple[str, ...], states: tuple[str, ...], heard: bool = False
    ) -> list[str]:
        """Up to ``count`` distinct random members in ``states``, none in ``exclude``
        (and, if ``heard``, none in ``_unheard``)."""
        size = self._table.size()
        if count <= 0 or size == 0:
            return []
        skip = self._unheard if heard else frozenset()
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
                    and name not in skip
                ):
                    chosen.append(name)
                    if len(chosen) == count:
                        return chosen
        pool = [
            n
            for n, rec in self._table.items()
            if rec.state in states and n not in exclude and n not in chosen and n not in skip
        ]
        return chosen + self._rng.sample(pool, min(count - len(chosen), len(pool)))

    def _table_rows(self) -> tuple[Update, ...]:
        return tuple(rec.as_row(name) for name, rec in self._table.items())

