"""The leader's offers: which blocks each node that does not watch the blocks may claim.

A node started with ``--watch own`` sees neither the blocks of batched experiments nor
their claims and batches (``Keyspace.own_ranges``), so it cannot choose one itself. The
leader, which sees everything, writes ``offer/<node>`` for each such live node: up to
``OFFER_AHEAD`` blocks that nobody holds, that have a task without a result and whose
experiment the node may run, none offered to two nodes. Blocks still claimable stay in
a node's offer, so an offer is rewritten only when its node claimed a block of it (or
the block was finished, or its work cancelled): about one write per block, whatever
the number of nodes.

An offer is a hint, never a grant: the claim (``claim_open_block``) is what decides, so
a stale offer costs one refused transaction. The next leader plans again from etcd.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import BlockRef
from hypermesh.state.records import TERMINAL, NodeRecord, dumps

if TYPE_CHECKING:
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

OFFER_AHEAD = 2
"""Blocks offered to each node at a time."""

RESCAN_S = 5.0
"""How often the scan of every experiment starts again from its first block (a block
passed as finished may have been reopened by ``hypermesh retry``), seconds."""

TXN_OPS = 64
"""Offers written per transaction."""


def claimable(view: MeshView, bref: BlockRef) -> bool:
    """Nobody holds ``bref`` and a task of it has no result, as far as ``view`` knows."""
    return bref not in view.block_claims and view.block_unfinished(bref) > 0


def plan_offers(
    view: MeshView, cursors: dict[tuple[str, str], int] | None = None,
    ahead: int = OFFER_AHEAD, current: dict[str, tuple[BlockRef, ...] | None] | None = None,
) -> dict[str, tuple[BlockRef, ...]]:
    """What each live node that chooses from offers should be offered now.

    A node keeps the blocks of its current offer that are still claimable (and that it
    may run); the rest is filled in order (oldest workflow first, experiments in
    dependency order, blocks in order), each block to one node. ``cursors`` (per
    experiment, the position of its first block that was not finished) lets a round
    skip the finished blocks a former round passed; the caller keeps it between rounds.
    ``current``: the offers as last written, where the view may not show them yet.
    """
    nodes = {name: rec for name, rec in sorted(view.nodes.items())
             if rec.offers and rec.state == "alive"}
    taken: set[BlockRef] = set()
    plan: dict[str, list[BlockRef]] = {}
    for name, rec in nodes.items():
        now = (current or {}).get(name, view.offers.get(name, ((), 0))[0]) or ()
        kept = [b for b in now if b not in taken and _open_to(view, b, rec) and claimable(view, b)]
        plan[name] = kept[:ahead]
        taken.update(plan[name])
    hungry = [name for name in nodes if len(plan[name]) < ahead]
    if hungry:
        for bref in _candidates(view, cursors if cursors is not None else {}):
            if bref in taken:
                continue
            for name in hungry:
                if _open_to(view, bref, nodes[name]):
                    plan[name].append(bref)
                    taken.add(bref)
                    if len(plan[name]) >= ahead:
                        hungry.remove(name)
                    break
            if not hungry:
                break
    return {name: tuple(blocks) for name, blocks in plan.items()}


def _open_to(view: MeshView, bref: BlockRef, node: NodeRecord) -> bool:
    """``node`` may run ``bref``: its work is live and allowed there. (A node pulling the
    experiment's image is offered it too: it claims once the image is there.)"""
    wf = view.workflows.get(bref.workflow)
    if wf is None or view.workflow_state(bref.workflow) in TERMINAL:
        return False
    if view.experiment_cancelled(bref.workflow, bref.experiment):
        return False
    return allowed_on(wf.recipe.experiment(bref.experiment), node)


def _candidates(view: MeshView, cursors: dict[tuple[str, str], int]) -> Iterator[BlockRef]:
    """The claimable blocks in order; moves each experiment's cursor past the finished
    blocks at its start."""
    for wf in sorted(view.workflows.values(), key=lambda w: (w.submitted_at, w.id)):
        if view.workflow_state(wf.id) in TERMINAL:
            continue
        for name in wf.recipe.topological_order():
            key = (wf.id, name)
            if key not in view.expanded or not view.batched(wf.id, name):
                continue
            if view.experiment_cancelled(wf.id, name):
                continue
            firsts = view.block_firsts(wf.id, name)
            start = cursors.get(key, 0)
            finished_so_far = True
            for i in range(start, len(firsts)):
                bref = BlockRef(wf.id, name, firsts[i])
                unfinished = view.block_unfinished(bref) > 0
                if finished_so_far and not unfinished:
                    cursors[key] = i + 1
                    continue
                finished_so_far = False
                if unfinished and bref not in view.block_claims:
                    yield bref


class OfferHost(Protocol):
    """What :class:`Offers` uses of its agent."""

    cfg: AgentConfig
    view: MeshView
    etcd: Etcd
    ks: Keyspace


class Offers:
    """The offers this node wrote while it leads; :meth:`publish` runs in each leader
    round. What it wrote is remembered, since the view shows its own writes only later."""

    def __init__(self, agent: OfferHost) -> None:
        self.agent = agent
        self._written: dict[str, tuple[BlockRef, ...] | None] = {}
        self._cursors: dict[tuple[str, str], int] = {}
        self._rescan_at = 0.0

    def handed_over(self) -> None:
        self._written.clear()
        self._cursors.clear()

    async def publish(self) -> int:
        """Write the offers that changed (and delete those of nodes gone or that no
        longer choose from offers); how many keys were written."""
        view, now = self.agent.view, time.monotonic()
        if now >= self._rescan_at:
            self._cursors.clear()
            self._rescan_at = now + RESCAN_S
        wanted = plan_offers(view, self._cursors, current=self._written)
        ops: list[Any] = []
        etcd, ks = self.agent.etcd, self.agent.ks
        for name, blocks in wanted.items():
            current = self._written.get(name, view.offers.get(name, ((), 0))[0])
            if current != blocks:
                value = {"blocks": [[b.workflow, b.experiment, b.first] for b in blocks]}
                ops.append(etcd.op_put(ks.offer(name), dumps(value)))
                self._written[name] = blocks
        for name in set(view.offers) | set(self._written):
            if name not in wanted and self._written.get(name, ()) is not None:
                ops.append(etcd.op_delete(ks.offer(name)))
                self._written[name] = None
        for i in range(0, len(ops), TXN_OPS):
            await etcd.txn([], ops[i:i + TXN_OPS])
        return len(ops)
