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

No node is left with nothing while another holds two blocks (it takes the other's
second), nor, at a whole plan, while another has left a block unclaimed for
``RESCAN_S``: that node has no free slot, and at the end of the work its one block would
wait there for as long as its running tasks take.

Planning is incremental. A whole plan (:func:`plan_offers`) looks at every node and
every block: it runs on the first round, every ``RESCAN_S``, and after any change of
nodes or workflows (``MeshView.offer_epoch``). Between them a round looks only at the
blocks whose keys changed since the last one (``MeshView.offer_blocks``: claims taken or
released, batches, reopened tasks): a block offered to a node that is no longer
claimable leaves that node's offer, a block that became claimable joins the blocks
waiting for a node, and nodes short of offers take waiting blocks; once none waits, a
node the round left with nothing takes the second block of a node offered two (as a
whole plan shares). A round with nothing changed costs nothing, and a busy one costs
in proportion to what changed, not to the size of the mesh.

A block of an experiment with a ``workers`` cap is offered with a slot of the cap
(``agent/leader/cap_slots.py``), only to a node with a free slot for it, and stays with
that node; those the cap has no room for wait per experiment until slots free.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

from hypermesh.agent.leader.cap_slots import CapSlots
from hypermesh.agent.leader.offer_hooks import (
    BlockLocality,
    CapOpener,
    FreeGpus,
    KeepFor,
    Opener,
)
from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import BlockRef
from hypermesh.state.records import TERMINAL, NodeRecord, dumps

if TYPE_CHECKING:
    from hypermesh.config import AgentConfig
    from hypermesh.recipe.recipe import Experiment
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

SHARE_TRIES = 8
"""Nodes offered two blocks that a round looks at for one to share with a node it left
with nothing."""


def claimable(view: MeshView, bref: BlockRef) -> bool:
    """Nobody holds ``bref`` and a task of it has no result, as far as ``view`` knows."""
    return bref not in view.block_claims and view.block_unfinished(bref) > 0


def plan_offers(
    view: MeshView, cursors: dict[tuple[str, str], int] | None = None,
    ahead: int = OFFER_AHEAD, current: dict[str, tuple[BlockRef, ...] | None] | None = None,
    stale: Collection[BlockRef] = (), free_gpus: FreeGpus | None = None,
    keep_for: KeepFor | None = None, apart: Callable[[BlockRef], bool] | None = None,
    cap: CapOpener | None = None,
) -> dict[str, tuple[BlockRef, ...]]:
    """What each live node that chooses from offers should be offered now.

    A node keeps the blocks of its current offer that are still claimable (and that it
    may run); the rest is filled in order (oldest workflow first, experiments in
    dependency order, blocks in order), each block to one node. ``cursors`` (per
    experiment, the position of its first block that was not finished) lets a round
    skip the finished blocks a former round passed; the caller keeps it between rounds.
    ``current``: the offers as last written, where the view may not show them yet.
    ``stale``: offered blocks their node has left unclaimed for a while (it has no free
    slot): a node left with nothing takes one (``_share``). ``free_gpus``: the GPUs a
    node has free, as gossip last said (``_open_to``). ``keep_for``: the node a block
    of an experiment with ``inputs`` or ``prefer_pools`` waits for (``KeepFor``); no other
    node is offered it. ``apart``: blocks the caller offers itself (those of capped
    experiments, ``agent/leader/cap_slots.py``), which stay only where they are offered
    now, as ``cap`` says.
    """
    nodes = _takers(view.nodes)
    keeps = _cached(keep_for)
    open_to = _opener(view, free_gpus, keeps, cap)
    taken: set[BlockRef] = set()
    plan: dict[str, list[BlockRef]] = {}
    for name, rec in nodes.items():
        now = (current or {}).get(name, view.offers.get(name, ((), 0))[0]) or ()
        kept = [b for b in now if b not in taken and open_to(b, rec) and claimable(view, b)]
        plan[name] = kept[:ahead]
        taken.update(plan[name])
    hungry = [name for name in nodes if len(plan[name]) < ahead]
    if hungry:
        for bref in _candidates(view, cursors if cursors is not None else {}):
            if bref in taken or (apart is not None and apart(bref)):
                continue
            keeper = keeps(bref) if keeps is not None and _kept_kind(view, bref) else None
            if keeper is not None:  # only that node may take it: no need to ask the others
                if keeper in hungry and open_to(bref, nodes[keeper]):
                    plan[keeper].append(bref)
                    taken.add(bref)
                    if len(plan[keeper]) >= ahead:
                        hungry.remove(keeper)
                if not hungry:
                    break
                continue
            for name in hungry:
                if open_to(bref, nodes[name]):
                    plan[name].append(bref)
                    taken.add(bref)
                    if len(plan[name]) >= ahead:
                        hungry.remove(name)
                    break
            if not hungry:
                break
    _share(open_to, nodes, plan, stale, apart)
    return {name: tuple(blocks) for name, blocks in plan.items()}


def _share(open_to: Opener, nodes: dict[str, NodeRecord], plan: dict[str, list[BlockRef]],
           stale: Collection[BlockRef] = (),
           apart: Callable[[BlockRef], bool] | None = None) -> None:
    """No node is left with nothing while another holds two blocks: the one with nothing
    takes the other's last. Without this, a node that joins once every block is offered
    (a burst node, provisioned for exactly that backlog) would wait while the busy
    nodes' offers keep the next blocks for later. Nor while another has left a block
    unclaimed for a while (``stale``): that node is busy, and at the end of the work its
    one offered block would wait for a free slot there (up to a task's length) while
    this node idles. Blocks ``apart`` stay where they are."""
    def shared(bref: BlockRef) -> bool:
        return apart is None or not apart(bref)

    donors = [name for name in nodes if len(plan[name]) > 1 and shared(plan[name][-1])]
    empty = [n for n in nodes if not plan[n]]
    for name in empty:
        for donor in donors:
            if len(plan[donor]) > 1 and open_to(plan[donor][-1], nodes[name]):
                plan[name].append(plan[donor].pop())
                break
    if not stale:
        return
    held = [(name, bref) for name in nodes for bref in plan[name]
            if bref in stale and shared(bref)]
    for name in (n for n in empty if not plan[n]):
        for i, (donor, bref) in enumerate(held):
            if bref in plan[donor] and open_to(bref, nodes[name]):
                plan[donor].remove(bref)
                plan[name].append(bref)
                del held[i]
                break


_T = TypeVar("_T")
_R = TypeVar("_R")


def _cached(fn: Callable[[_T], _R] | None) -> Callable[[_T], _R] | None:
    """``fn`` asked at most once per argument (for one round of planning)."""
    return None if fn is None else functools.lru_cache(maxsize=None)(fn)


def _kept_kind(view: MeshView, bref: BlockRef) -> bool:
    """Whether ``bref``'s experiment is of a kind whose blocks may be kept for a node."""
    exp = view.workflows[bref.workflow].recipe.experiment(bref.experiment)
    return bool(exp.inputs or exp.prefer_pools)


def _open_to(view: MeshView, bref: BlockRef, node: NodeRecord,
             free_gpus: FreeGpus | None = None, keep_for: KeepFor | None = None,
             cap: CapOpener | None = None) -> bool:
    """``node`` may run ``bref``: its work is live and allowed there, and when it asks
    for GPUs, ``free_gpus`` (when given) does not say the node has too few free now: GPU
    work goes where a GPU is free, so that a node whose GPUs are busy is offered other
    work. A block kept for a node (``keep_for``: the one that holds its data, or one of
    a preferred pool) is open to that node only. A block of an experiment with a
    ``workers`` cap is open as ``cap`` says. (A node pulling the experiment's image is
    offered it too: it claims once the image is there.)"""
    if not _live(view, bref):
        return False
    exp = view.workflows[bref.workflow].recipe.experiment(bref.experiment)
    if not allowed_on(exp, node):
        return False
    if cap is not None and view.workers(bref.workflow, exp) is not None and not cap(bref, node):
        return False
    if (exp.inputs or exp.prefer_pools) and keep_for is not None:
        keeper = keep_for(bref)
        if keeper is not None and keeper != node.name:
            return False
    if exp.hardware.gpus and free_gpus is not None:
        free = free_gpus(node.name)
        return free is None or free >= exp.hardware.gpus
    return True


def _opener(view: MeshView, free_gpus: FreeGpus | None,
            keep_for: KeepFor | None = None, cap: CapOpener | None = None) -> Opener:
    """``_open_to`` for one round of planning: each node's free GPUs asked of gossip at
    most once (the caller caches ``keep_for`` likewise: ``_cached``)."""
    asked = _cached(free_gpus)
    return lambda bref, node: _open_to(view, bref, node, asked, keep_for, cap)


def _live(view: MeshView, bref: BlockRef) -> bool:
    """The work of ``bref`` goes on: its workflow is known and has not ended, and its
    experiment was not cancelled."""
    if bref.workflow not in view.workflows:
        return False
    if view.workflow_state(bref.workflow) in TERMINAL:
        return False
    return not view.experiment_cancelled(bref.workflow, bref.experiment)


def _takers(nodes: dict[str, NodeRecord]) -> dict[str, NodeRecord]:
    """The nodes that choose from offers and may take work, by name."""
    return {name: rec for name, rec in sorted(nodes.items())
            if rec.offers and rec.state == "alive"}


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
            for bref in view.open_blocks(wf.id, name, cursors):
                if bref not in view.block_claims:
                    yield bref


LOOKUP_POLL_S = 0.2
"""While the inputs of blocks kept for no node are being looked up, a round every this
many seconds looks for the answers."""


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
        self._epoch = -1  # the view's offer_epoch at the last whole plan
        self._offered_to: dict[BlockRef, str] = {}
        self._short: dict[str, None] = {}  # nodes offered fewer than OFFER_AHEAD blocks
        self._full: dict[str, None] = {}  # nodes offered OFFER_AHEAD blocks: donors to share
        self._waiting: dict[BlockRef, None] = {}  # claimable, offered to no one, in order
        # Capped experiments' blocks: their slots, those waiting with a slot for a node
        # with room, and those the caps have no room for (agent/leader/cap_slots.py).
        self._caps = CapSlots()
        self._capped_waiting: dict[BlockRef, None] = {}
        self._roomy: dict[str, None] = {}  # nodes that may have room for capped blocks
        self._written_slots: dict[str, tuple[int | None, ...]] = {}
        self._takers_epoch = -1
        self._any_taker = False
        # When each offered block was offered to the node it is offered to, by the clock
        # of :meth:`changes`: one left unclaimed for ``RESCAN_S`` is ``stale``.
        self._since: dict[BlockRef, tuple[str, float]] = {}
        # A node's free GPUs as gossip says (set by the agent): GPU work is offered
        # where a GPU is free. None: every node that may run it.
        self.free_gpus: FreeGpus | None = None
        # Where blocks' data is (set by the agent when it places by locality): a block
        # of an experiment with ``inputs`` is kept for the node that holds most of its
        # data for ``delay_s`` from when this leader first found it claimable.
        self.locality: BlockLocality | None = None
        # Pools (set by the agent): a block of an experiment with ``prefer_pools`` is
        # kept for a node of a preferred pool with room for ``pool_delay`` (None: not).
        self.pool_delay: float | None = None
        self.alive: Callable[[str], bool] = lambda name: True  # gossip's verdict
        self._room: dict[str, int] | None = None  # free slots per node, this round
        self._preferred: dict[tuple[str, str], deque[str]] = {}  # per experiment, this round
        self._pool_kept: dict[BlockRef, str] = {}  # the node each block was kept for
        self._keep_ends: dict[BlockRef, float] = {}
        self.wake_at: Callable[[float], None] = lambda when: None  # a round at `when`
        self._now = 0.0
        self._open_since: dict[BlockRef, float] = {}
        self._keep_until: list[tuple[float, BlockRef]] = []  # a heap: when keeping ends
        self._kept: dict[str, dict[BlockRef, None]] = {}  # waiting for that node, in order
        self._kept_by: dict[BlockRef, str] = {}
        self._looked_up = -1
        self._keeps: KeepFor | None = None
        self._kinds_epoch = -1
        self._any_kind = False
        self._open: Opener = _opener(agent.view, None)
        self._open_anew: Opener = self._open  # for a capped block offered to no node yet

    def handed_over(self) -> None:
        self._written.clear()
        self._written_slots.clear()
        self._caps.clear()
        self._capped_waiting.clear()
        self._since.clear()
        self._cursors.clear()
        self._open_since.clear()
        self._keep_until.clear()
        self._pool_kept.clear()
        self._epoch = -1
        self.agent.view.offer_blocks = None  # a follower's view need not keep them
        self.agent.view.load_dropped.clear()

    def wanted(self) -> bool:
        """Whether any node chooses from offers, or offers are left to delete."""
        view = self.agent.view
        if view.offer_epoch != self._takers_epoch:
            self._takers_epoch = view.offer_epoch
            self._any_taker = any(rec.offers for rec in view.nodes.values())
        return self._any_taker or bool(view.offers)

    def plan(self, now: float) -> tuple[dict[str, tuple[BlockRef, ...]], bool]:
        """The offers of the nodes whose offers may have changed, and whether that is a
        whole plan (every node that chooses from offers: the others' are deleted)."""
        view = self.agent.view
        self._now = now
        self._keeps = _cached(self._keep) if self._keeping(view) else None
        self._caps.begin()
        self._open = _opener(view, self.free_gpus, self._keeps, self._cap_open)
        self._open_anew = _opener(view, self.free_gpus, self._keeps,
                                  lambda bref, node: self._caps.admit(view, bref))
        self._room = None
        whole = view.offer_blocks is None or view.offer_epoch != self._epoch
        if whole or now >= self._rescan_at:
            planned, whole = self._plan_whole(view, now), True
        else:
            touched, view.offer_blocks = view.offer_blocks, set()
            due = self._keeping_ended(now) or (bool(self._kept) and self._answers_came())
            planned = (self._plan_changes(view, touched or set())
                       if touched or due or self._caps.penned else {})
        self._arm(now)
        return planned, whole

    def _arm(self, now: float) -> None:
        """A round when the first keeping ends, and soon while blocks wait for their
        data to be looked up (the timer keeps only the earliest: armed every round)."""
        if self._keep_until:
            self.wake_at(self._keep_until[0][0])
        if "" in self._kept:
            self.wake_at(now + LOOKUP_POLL_S)

    def _keeping(self, view: MeshView) -> bool:
        """Whether a block may be kept for a node this round: this leader places by
        locality or pools, and a live workflow has an experiment of that kind (looked
        up again when the workflows change), or blocks are kept from before."""
        if self.locality is None and self.pool_delay is None:
            return False
        if view.offer_epoch != self._kinds_epoch:
            self._kinds_epoch = view.offer_epoch
            self._any_kind = any(
                (exp.inputs or exp.prefer_pools) and view.workflow_state(wf.id) not in TERMINAL
                for wf in view.workflows.values() for exp in wf.recipe.experiments)
        return self._any_kind or bool(self._kept)

    def _keeping_ended(self, now: float) -> bool:
        return bool(self._keep_until) and self._keep_until[0][0] <= now

    def _answers_came(self) -> bool:
        """Blocks wait for their data to be looked up, and lookups ended since."""
        return ("" in self._kept and self.locality is not None
                and self.locality.looked_up != self._looked_up)

    def _keep(self, bref: BlockRef) -> str | None:
        """``KeepFor``: the node that holds most of ``bref``'s data while the block has
        waited less than the locality delay since this leader found it claimable, else a
        node of a preferred pool with room while it has waited less than the pool delay."""
        view = self.agent.view
        exp = view.workflows[bref.workflow].recipe.experiment(bref.experiment)
        since = self._open_since.setdefault(bref, self._now)
        waited = self._now - since
        loc = self.locality
        if exp.inputs and loc is not None and waited < loc.delay_s:
            keeper = loc.holder(view, bref.task(0))
            if keeper is not None:
                self._keeps_until(bref, since + loc.delay_s)
                return keeper
        if exp.prefer_pools and self.pool_delay is not None and waited < self.pool_delay:
            keeper = self._pool_kept.get(bref)  # kept once, kept for that node
            if keeper is None or not self._up(view, keeper):
                keeper = self._preferred_with_room(view, bref.workflow, exp)
            if keeper is not None:
                self._pool_kept[bref] = keeper
                self._keeps_until(bref, since + self.pool_delay)
                return keeper
        return None

    def _keeps_until(self, bref: BlockRef, ends: float) -> None:
        """``bref`` is kept for a node until ``ends``: a round then looks at it again,
        waiting or offered."""
        if self._keep_ends.get(bref) != ends:
            self._keep_ends[bref] = ends
            heapq.heappush(self._keep_until, (ends, bref))

    def _up(self, view: MeshView, name: str) -> bool:
        rec = view.nodes.get(name)
        return rec is not None and rec.state == "alive" and self.alive(name)

    def _preferred_with_room(self, view: MeshView, wid: str, exp: Experiment) -> str | None:
        """A node of a pool ``exp`` prefers that may run it and has a slot no claim,
        offer or kept block takes this round (taking it): the first by name. A node
        passed over stays passed over this round, so a round costs O(nodes + blocks)."""
        if self._room is None:
            self._room, self._preferred = self._free_slots(view), {}
        names = self._preferred.get((wid, exp.name))
        if names is None:
            names = self._preferred[(wid, exp.name)] = deque(sorted(
                n for n in self._room
                if view.nodes[n].pool in exp.prefer_pools and allowed_on(exp, view.nodes[n])))
        while names and self._room[names[0]] <= 0:
            names.popleft()
        if not names:
            return None
        self._room[names[0]] -= 1
        return names[0]

    def _busy(self, view: MeshView, name: str) -> bool:
        """``name`` has no free slot, as this round sees it."""
        if self._room is None:
            self._room, self._preferred = self._free_slots(view), {}
        return self._room.get(name, 0) <= 0

    def _free_slots(self, view: MeshView) -> dict[str, int]:
        """Free slots per live node: its slots, less the tasks it runs and the claimable
        blocks kept for it as a node of a preferred pool."""
        held: Counter[str] = Counter()
        in_block: Counter[BlockRef] = Counter()
        for ref, claim in view.claims.items():
            bref = view.block_of(ref)
            if bref is None:
                held[claim.node] += 1
            else:
                in_block[bref] += 1
        for bref, claim in view.block_claims.items():  # one slot at least, before a start
            held[claim.node] += max(1, in_block[bref])
        for bref, name in self._pool_kept.items():
            if claimable(view, bref):
                held[name] += 1
        room: dict[str, int] = {}
        for name, rec in view.nodes.items():
            if rec.state != "alive" or not self.alive(name):
                continue
            room[name] = rec.slots - held[name]
        return room

    def _wait(self, view: MeshView, bref: BlockRef) -> None:
        """``bref`` is claimable and offered to no node: it waits, for any node or for
        the node it is kept for; a block of a capped experiment waits for a slot of the
        cap first, then for a node with room."""
        is_capped = self._caps.is_capped(view, bref)
        if is_capped and not self._caps.admit(view, bref):
            self._caps.pen(bref)
            return
        keeper = (self._keeps(bref) if self._keeps is not None and _kept_kind(view, bref)
                  else None)
        if keeper is None:
            (self._capped_waiting if is_capped else self._waiting)[bref] = None
            return
        self._kept.setdefault(keeper, {})[bref] = None
        self._kept_by[bref] = keeper

    def _unwait(self, bref: BlockRef) -> None:
        self._waiting.pop(bref, None)
        self._capped_waiting.pop(bref, None)
        self._caps.unpen(bref)
        keeper = self._kept_by.pop(bref, None)
        if keeper is not None:
            bucket = self._kept[keeper]
            del bucket[bref]
            if not bucket:
                del self._kept[keeper]

    def _review_kept(self, view: MeshView, changed: dict[str, list[BlockRef]]) -> set[str]:
        """Blocks whose keeping ended wait for any node, and so does one offered to the
        node it was kept for when that node has no free slot (it would hold the block
        until one of its tasks ends: a busy holder keeps a task waiting for the delay
        at most, as with per-task claims); those kept for no node while their data was
        looked up are placed again once answers came. Returns the busy nodes that gave
        blocks up: the caller fills them only after the others."""
        due: list[BlockRef] = []
        gave: set[str] = set()
        while self._keep_until and self._keep_until[0][0] <= self._now:
            bref = heapq.heappop(self._keep_until)[1]
            if bref in self._kept_by:
                due.append(bref)
            elif bref in self._offered_to and self._busy(view, self._offered_to[bref]):
                node = self._offered_to.pop(bref)
                blocks = changed.setdefault(node, list(self._written.get(node) or ()))
                if bref in blocks:
                    blocks.remove(bref)
                self._short.pop(node, None)
                self._full.pop(node, None)
                gave.add(node)
                due.append(bref)
        if self.locality is not None and self.locality.looked_up != self._looked_up:
            self._looked_up = self.locality.looked_up
            due.extend(self._kept.get("", ()))
        for bref in due:
            self._unwait(bref)
            if claimable(view, bref) and _live(view, bref):
                self._wait(view, bref)
        return gave

    def _plan_whole(self, view: MeshView, now: float) -> dict[str, tuple[BlockRef, ...]]:
        if now >= self._rescan_at:
            self._cursors.clear()
            self._rescan_at = now + RESCAN_S
        view.offer_blocks, self._epoch = set(), view.offer_epoch
        stale = {b for b, (_, since) in self._since.items() if now - since >= RESCAN_S}
        if self.locality is not None:
            self._looked_up = self.locality.looked_up
        candidates = list(_candidates(view, dict(self._cursors)))
        if self._keeps is not None:  # in block order, as room for a preferred pool goes
            for bref in candidates:
                if _kept_kind(view, bref):
                    self._keeps(bref)
        self._caps.penned.clear()
        wanted = plan_offers(view, self._cursors, current=self._written, stale=stale,
                             free_gpus=self.free_gpus, keep_for=self._keeps,
                             apart=functools.partial(self._caps.is_capped, view),
                             cap=self._cap_open)
        self._offered_to = {b: name for name, blocks in wanted.items() for b in blocks}
        self._since = {b: v for b, v in self._since.items() if b in self._offered_to}
        self._short = {name: None for name, blocks in wanted.items() if len(blocks) < OFFER_AHEAD}
        self._full = {name: None for name, blocks in wanted.items() if len(blocks) >= OFFER_AHEAD}
        self._waiting, self._kept, self._kept_by = {}, {}, {}
        self._capped_waiting = {}
        self._roomy = dict.fromkeys(wanted)
        for bref in candidates:
            if bref not in self._offered_to:
                self._wait(view, bref)
        if self._kept or self._capped_waiting:  # (kept: a node that gave its last block
            changed = {name: list(blocks) for name, blocks in wanted.items()}  # away)
            self._fill_kept(view, changed)
            self._fill_capped(view, changed)
            wanted = {name: tuple(blocks) for name, blocks in changed.items()}
        if self._caps.given:
            self._caps.keep_only(self._offered_to.keys() | self._capped_waiting.keys()
                                 | self._kept_by.keys())
        if self._open_since:
            live = self._offered_to.keys() | self._kept_by.keys() | self._waiting.keys()
            self._open_since = {b: t for b, t in self._open_since.items() if b in live}
            self._keep_ends = {b: t for b, t in self._keep_ends.items() if b in live}
            self._pool_kept = {b: n for b, n in self._pool_kept.items() if b in live}
            self._keep_until = [(t, b) for t, b in self._keep_until
                                if b in live and self._keep_ends.get(b) == t]
            heapq.heapify(self._keep_until)
            if self.locality is not None:
                self.locality.forget({b.task(0) for b in self._open_since})
        return wanted

    def _plan_changes(
        self, view: MeshView, touched: set[BlockRef]
    ) -> dict[str, tuple[BlockRef, ...]]:
        changed: dict[str, list[BlockRef]] = {}
        for bref in sorted(touched):
            node = self._offered_to.get(bref)
            rec = view.nodes.get(node) if node is not None else None
            if node is None:
                waits = (bref in self._waiting or bref in self._kept_by
                         or bref in self._capped_waiting or self._caps.is_penned(bref))
                if not (claimable(view, bref) and _live(view, bref)):
                    self._unwait(bref)
                    self._caps.drop(bref)
                elif not waits:
                    self._wait(view, bref)
            elif rec is None or not (claimable(view, bref) and self._open(bref, rec)):
                del self._offered_to[bref]
                if claimable(view, bref) and _live(view, bref):
                    self._wait(view, bref)  # open still, to another node
                else:
                    self._caps.drop(bref)
                blocks = changed.setdefault(node, list(self._written.get(node) or ()))
                if bref in blocks:
                    blocks.remove(bref)
                self._mark_short(node)
                self._full.pop(node, None)
        gave = self._review_kept(view, changed)
        for bref in self._caps.released(view):  # slots of the caps freed
            if claimable(view, bref) and _live(view, bref):
                self._wait(view, bref)
        filled = self._fill_kept(view, changed)  # a donor for any node with nothing
        self._fill_capped(view, changed)
        if self._waiting:
            for node in list(self._short):
                blocks = changed.get(node, list(self._written.get(node) or ()))
                self._fill(view, node, blocks)
                changed[node] = blocks
                filled = filled or len(blocks) >= OFFER_AHEAD
                if not self._waiting:
                    break
        if not self._waiting:
            self._share(view, changed, filled)
            self._fill_kept(view, changed)  # a donor may have blocks kept for it
        for node in gave:  # filled from the next round on, after the others took theirs
            self._mark_short(node)
        return {name: tuple(blocks) for name, blocks in changed.items()}

    def _mark_short(self, node: str) -> None:
        self._short[node] = None
        self._roomy[node] = None

    def _fill_capped(self, view: MeshView, changed: dict[str, list[BlockRef]]) -> None:
        """Nodes short of offers with room take the blocks of capped experiments that
        wait with a slot. Only the nodes that may have room are looked at (``_roomy``:
        every node at a whole plan, then those whose load fell or whose offer shrank,
        and those left with room when no such block was left), so a round costs what
        changed, not the size of the mesh."""
        self._roomy.update(dict.fromkeys(view.load_dropped))
        view.load_dropped.clear()
        for node in list(self._roomy):
            if not self._capped_waiting:
                return
            del self._roomy[node]
            blocks = changed.get(node, list(self._written.get(node) or ()))
            if node not in self._short or self._cap_room(view, node, blocks) <= 0:
                continue  # looked at again once its offer shrinks or its load falls
            self._fill(view, node, blocks)
            changed[node] = blocks
            if node in self._short and self._cap_room(view, node, blocks) > 0:
                self._roomy[node] = None  # room left: no capped block waits any more

    def _cap_open(self, bref: BlockRef, node: NodeRecord) -> bool:
        """``CapOpener``: a block of a capped experiment has a slot of the cap, and stays
        with the node it is offered to; it is offered anew only by ``_fill``
        (``_open_anew``), to a node with room for it (a slot of the cap given to a busy
        node would go unused)."""
        return self._caps.admit(self.agent.view, bref) and (
            self._offered_to.get(bref) == node.name)

    def _cap_room(self, view: MeshView, node: str, blocks: list[BlockRef]) -> int:
        """Blocks of capped experiments ``node`` has room for beside its offer ``blocks``:
        its slots, less the tasks it runs (or the blocks it holds, if more)."""
        rec = view.nodes.get(node)
        if rec is None or rec.state != "alive" or not self.alive(node):
            return 0
        held = max(view.node_running[node], view.node_blocks[node])
        return rec.slots - held - sum(1 for b in blocks if self._caps.slot(b) is not None)

    def _fill_kept(self, view: MeshView, changed: dict[str, list[BlockRef]]) -> bool:
        """Nodes short of offers take the blocks kept for them; whether one was filled
        to ``OFFER_AHEAD``."""
        filled = False
        for node in [n for n in self._kept if n in self._short]:
            blocks = changed.get(node, list(self._written.get(node) or ()))
            self._fill(view, node, blocks)
            changed[node] = blocks
            filled = filled or len(blocks) >= OFFER_AHEAD
        return filled

    def _share(self, view: MeshView, changed: dict[str, list[BlockRef]], filled: bool) -> None:
        """What a whole plan does (``_share``), between whole plans: a node left with
        nothing, while no block waits, takes the last block of a node offered
        ``OFFER_AHEAD``. Only the nodes that emptied this round are looked at (every
        node short of blocks when this round ``filled`` one to ``OFFER_AHEAD``, which
        the fill already went through), and ``SHARE_TRIES`` donors each: a large mesh
        with little work pays nothing for the nodes that had nothing before."""
        empty = ([n for n in self._short if not changed.get(n, self._written.get(n))]
                 if filled else [n for n, blocks in changed.items() if not blocks])
        for node in empty:
            rec = view.nodes.get(node)
            if rec is None or not rec.offers or rec.state != "alive":
                continue
            for donor in list(itertools.islice(self._full, SHARE_TRIES)):
                given = changed.get(donor, list(self._written.get(donor) or ()))
                if len(given) < OFFER_AHEAD:  # stale: it lost a block meanwhile
                    self._full.pop(donor, None)
                    continue
                if donor == node or not self._open(given[-1], rec):
                    continue
                bref = given.pop()
                changed[donor], changed[node] = given, [bref]
                self._offered_to[bref] = node
                self._full.pop(donor, None)
                self._mark_short(donor)
                break

    def _fill(self, view: MeshView, node: str, blocks: list[BlockRef]) -> None:
        """Give ``node`` waiting blocks until it has ``OFFER_AHEAD``; forget waiting
        blocks that are no longer claimable on the way."""
        rec = view.nodes.get(node)
        if rec is None or not rec.offers or rec.state != "alive":
            self._short.pop(node, None)
            return
        taken: list[BlockRef] = []
        gone: list[BlockRef] = []
        room: int | None = None  # for blocks of capped experiments, worked out once
        for waiting in (self._kept.get(node, {}), self._waiting, self._capped_waiting):
            for bref in waiting:  # its data's blocks first
                if len(blocks) + len(taken) >= OFFER_AHEAD:
                    break
                if not (claimable(view, bref) and _live(view, bref)):
                    gone.append(bref)
                    continue
                capped = waiting is self._capped_waiting or self._caps.slot(bref) is not None
                if capped:
                    if room is None:
                        room = self._cap_room(view, node, blocks)
                    if room <= 0:
                        continue
                if (self._open_anew if capped else self._open)(bref, rec):
                    taken.append(bref)
                    if capped:
                        assert room is not None
                        room -= 1
        for bref in gone:
            self._caps.drop(bref)
        for bref in gone + taken:
            self._unwait(bref)
        for bref in taken:
            self._offered_to[bref] = node
        blocks += taken
        if len(blocks) >= OFFER_AHEAD:
            self._short.pop(node, None)
            self._full[node] = None

    def changes(self, now: float) -> list[tuple[str, tuple[BlockRef, ...] | None]]:
        """Plan, and the offers to write: (node, its blocks), or (node, None) to delete a
        node's offer (after a whole plan: nodes gone or no longer choosing from offers).
        They count as written from here on."""
        view = self.agent.view
        wanted, whole = self.plan(now)
        out: list[tuple[str, tuple[BlockRef, ...] | None]] = []
        for name, blocks in wanted.items():
            for bref in blocks:
                if self._since.get(bref, ("", 0.0))[0] != name:
                    self._since[bref] = (name, now)
            slots = tuple(self._caps.slot(b) for b in blocks)
            before = self._written_slots.get(name)
            if before is None:  # as a former leader wrote it, if it did
                before = tuple(view.offered_slots.get((b.workflow, b.experiment), {}).get(b)
                               for b in blocks)
            if (self._written.get(name, view.offers.get(name, ((), 0))[0]) != blocks
                    or before != slots):
                out.append((name, blocks))
                self._written[name] = blocks
            self._written_slots[name] = slots
        if whole:
            for name in sorted(set(view.offers) | set(self._written)):
                if name not in wanted and self._written.get(name, ()) is not None:
                    out.append((name, None))
                    self._written[name] = None
        return out

    async def publish(self) -> int:
        """Write the offers that changed (see :meth:`changes`), each with the revision of
        the view it was planned from (``at``); how many keys were written."""
        etcd, ks, at = self.agent.etcd, self.agent.ks, self.agent.view.revision
        ops = [
            etcd.op_delete(ks.offer(name)) if blocks is None else etcd.op_put(
                ks.offer(name), dumps({"blocks": [self._row(b) for b in blocks], "at": at}))
            for name, blocks in self.changes(time.monotonic())
        ]
        for i in range(0, len(ops), TXN_OPS):
            await etcd.txn([], ops[i:i + TXN_OPS])
        return len(ops)

    def _row(self, bref: BlockRef) -> list[str | int]:
        """A block as its offer lists it: with the slot of its experiment's cap, if any."""
        slot = self._caps.slot(bref)
        row: list[str | int] = [bref.workflow, bref.experiment, bref.first]
        return row if slot is None else [*row, slot]
