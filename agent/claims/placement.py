"""Locality-aware claims with delay scheduling: which open tasks this node should take
first, and which it should leave a while to a node that holds their data. Pure.

A task's *inputs* are chunk id → bytes (from its experiment's ``inputs``, through the
data set manifest; ``agent/claims/locality.py`` resolves them). For one claim round the I/O
layer builds a :class:`Placement` from what it knows now — the inputs resolved so far,
which chunks this node holds (``ChunkLocator.local``) and which other nodes hold
(``ChunkLocator.holders``, from gossip), the other live nodes that could run the task,
and the clock — and ``choose_claims`` asks it to sort each experiment's open tasks:

- **preferred**: tasks this node holds bytes of, most bytes held first — unless another
  eligible node holds more (then it is *deferred*, below);
- **deferred** (skipped this round): another eligible node (registered, alive in
  gossip, not draining, whose hardware and pool fit the experiment) holds more of the
  task's bytes than this node, and the task has been claimable for less than
  ``delay_s``. After that anyone takes it, so nothing starves; a busy holder does not
  keep a task waiting longer than the delay. A task whose inputs are still being
  resolved is deferred the same way (bounded by the same delay);
- **neutral**: everything else — tasks nobody holds, experiments without ``inputs`` —
  is claimed at once, in the usual order.

Bytes held count a chunk's input bytes whole when a node holds any block of it (peers
advertise chunk sets, not blocks). Only the ``LOOKAHEAD`` lowest open indices of an
experiment are ranked in one round; higher ones wait for their turn, which bounds the
work of a round on experiments with many thousands of tasks.

"When the task became claimable" is when this node first saw it open: ``since`` maps
each open task to that time, and ``split`` fills it in. The owner prunes tasks that are
no longer open (``prune_since``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from hypermesh.recipe.recipe import Experiment
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import NodeRecord

LOOKAHEAD = 256  # open tasks per experiment ranked in one claim round
DEFAULT_DELAY_S = 3.0


class ChunkLocator(Protocol):
    """Who holds a chunk, as this node sees it now."""

    def local(self, chunk: str) -> bool:
        """Whether this node's chunk caches hold (a block of) ``chunk``."""
        ...

    def holders(self, chunk: str) -> frozenset[str]:
        """Other nodes that advertise ``chunk`` (this node may be among them; ignored)."""
        ...


Inputs = Mapping[str, int]  # chunk id -> bytes of the task's inputs in it


@dataclass(frozen=True)
class Holdings:
    """Bytes of one task's inputs held here, and the most held by an eligible peer."""

    mine: int
    best_other: int
    best_node: str | None


def held(inputs: Inputs, locator: ChunkLocator, me: str, peers: Iterable[str]) -> Holdings:
    """How much of ``inputs`` this node holds, and the best of ``peers`` (eligible nodes)."""
    eligible = set(peers)
    mine = 0
    others: dict[str, int] = {}
    for chunk, size in inputs.items():
        if locator.local(chunk):
            mine += size
        for node in locator.holders(chunk):
            if node != me and node in eligible:
                others[node] = others.get(node, 0) + size
    if not others:
        return Holdings(mine, 0, None)
    best = max(sorted(others), key=lambda n: others[n])
    return Holdings(mine, others[best], best)


@dataclass
class Placement:
    """One claim round's view of where tasks' data is. Built by the I/O layer;
    ``choose_claims`` calls :meth:`split` once per experiment with open tasks.

    After the round, ``missing`` lists tasks whose inputs the I/O layer should
    resolve, ``deferred`` what was left to holders (task → holder), and
    ``next_deadline`` when the first deferral ends (None: none), so the I/O layer can
    run a claim round again then.
    """

    me: str
    locator: ChunkLocator
    inputs: Callable[[TaskRef], Inputs | None]  # None: not resolved yet
    peers: Mapping[str, NodeRecord]  # other live nodes that may run tasks
    now: float
    since: dict[TaskRef, float]
    delay_s: float = DEFAULT_DELAY_S
    fits: Callable[[Experiment, NodeRecord], bool] = lambda exp, node: True
    missing: list[TaskRef] = field(default_factory=list)
    deferred: dict[TaskRef, str] = field(default_factory=dict)
    next_deadline: float | None = None

    def split(
        self, workflow: str, exp: Experiment, open_indices: set[int]
    ) -> tuple[list[int], set[int]]:
        """``(preferred, neutral)``: indices to try first, best first, and the rest
        of the open indices minus the deferred ones. Experiments without ``inputs``
        come back unchanged (``[]``, ``open_indices``)."""
        if not exp.inputs:
            return [], open_indices
        peers = [n for n, rec in self.peers.items() if n != self.me and self.fits(exp, rec)]
        ranked: list[tuple[int, int]] = []
        neutral: set[int] = set()
        for index in heapq.nsmallest(LOOKAHEAD, open_indices):
            ref = TaskRef(workflow, exp.name, index)
            waited = self.now - self.since.setdefault(ref, self.now)
            patient = waited < self.delay_s
            inputs = self.inputs(ref)
            if inputs is None:
                self.missing.append(ref)
                if patient:
                    self._defer(ref, "", waited)
                else:
                    neutral.add(index)
                continue
            h = held(inputs, self.locator, self.me, peers)
            if patient and h.best_other > h.mine:
                assert h.best_node is not None
                self._defer(ref, h.best_node, waited)
            elif h.mine > 0:
                ranked.append((-h.mine, index))
            else:
                neutral.add(index)
        return [index for _, index in sorted(ranked)], neutral

    def _defer(self, ref: TaskRef, holder: str, waited: float) -> None:
        self.deferred[ref] = holder
        ends = self.now + (self.delay_s - waited)
        if self.next_deadline is None or ends < self.next_deadline:
            self.next_deadline = ends


def prune_since(since: dict[TaskRef, float], is_open: Callable[[TaskRef], bool]) -> None:
    """Forget when tasks that are no longer open became claimable (claimed, ended):
    if one opens again (a retry, a lost node), its wait starts afresh."""
    for ref in [r for r in since if not is_open(r)]:
        del since[ref]
