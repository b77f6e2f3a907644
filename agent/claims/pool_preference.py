"""Soft pool preference in claims: which open tasks a node leaves, for a while, to live
nodes of the pools an experiment prefers. Pure: reads records, returns indices.

An experiment's ``prefer_pools`` (the recipe) names pools whose nodes should run its
tasks first; every pool it allows may still run them. For one claim round the I/O layer
(``agent/claims/pool_wait.py``) builds a :class:`PoolPreference` from what it knows now — this
node, the other live nodes (registered, alive in gossip, not draining) with their free
slots, the clock, and when each open task became claimable — and ``choose_claims`` asks
it to thin each experiment's open tasks:

- a node of a preferred pool, or any node for an experiment without ``prefer_pools``,
  leaves nothing: it claims as before;
- a node of another pool adds up the *room* of the preferred peers whose hardware fits
  the experiment (their free slots, less what this round already left to them for
  other experiments) and leaves that many of the lowest open tasks that became
  claimable less than ``delay_s`` ago; it may claim every other task at once.

So a preferred node with room gets the tasks first; when preferred nodes are full or
gone the others take the work without waiting; a preferred node that looks free but
does not claim (stalled, its view behind, out of GPUs) delays a task by at most
``delay_s``: nothing starves. "Became claimable" is when this node first saw the task
open (``since``, filled in by :meth:`split`; the owner prunes it with
``placement.prune_since``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hypermesh.recipe.recipe import Experiment
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import NodeRecord

LOOKAHEAD = 256  # open tasks per experiment weighed in one claim round
DEFAULT_DELAY_S = 5.0


@dataclass
class PoolPreference:
    """One claim round's view of the preferred pools' room. Built by the I/O layer;
    ``choose_claims`` calls :meth:`split` once per experiment with open tasks.

    After the round, ``deferred`` says what was left and to whom (task -> node) and
    ``next_deadline`` when the first wait ends (None: none), so the I/O layer can run
    a claim round again then."""

    me: NodeRecord
    peers: Mapping[str, NodeRecord]  # other live nodes that may take tasks
    free: Callable[[], Mapping[str, int]]  # free slots per peer; asked once, when needed
    now: float
    since: dict[TaskRef, float]
    delay_s: float = DEFAULT_DELAY_S
    fits: Callable[[Experiment, NodeRecord], bool] = lambda exp, node: True
    deferred: dict[TaskRef, str] = field(default_factory=dict)
    next_deadline: float | None = None
    _room: dict[str, int] | None = None

    def split(self, workflow: str, exp: Experiment, open_indices: set[int]) -> set[int]:
        """The open indices this node may claim now: all of them, less the ones it
        leaves to preferred peers with room (see the module docstring)."""
        if not exp.prefer_pools or self.me.pool in exp.prefer_pools:
            return open_indices
        if self._room is None:
            free = self.free()
            self._room = {n: max(0, free.get(n, 0)) for n in self.peers if n != self.me.name}
        room = self._room
        holders = [
            name for name, rec in sorted(self.peers.items())
            if name != self.me.name and rec.pool in exp.prefer_pools
            and room.get(name, 0) > 0 and self.fits(exp, rec)
        ]
        if not holders:
            return open_indices
        left: set[int] = set()
        for index in heapq.nsmallest(LOOKAHEAD, open_indices):
            ref = TaskRef(workflow, exp.name, index)
            waited = self.now - self.since.setdefault(ref, self.now)
            if waited >= self.delay_s or not holders:
                continue
            holder = holders[0]
            left.add(index)
            self._leave(ref, holder, waited)
            room[holder] -= 1
            if room[holder] <= 0:
                holders.pop(0)
        return open_indices - left if left else open_indices

    def _leave(self, ref: TaskRef, holder: str, waited: float) -> None:
        self.deferred[ref] = holder
        ends = self.now + (self.delay_s - waited)
        if self.next_deadline is None or ends < self.next_deadline:
            self.next_deadline = ends

