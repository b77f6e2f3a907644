"""Holding blocks of batched experiments (``hypermesh.state.blocks``) on one agent.

A held block is a queue of task indices this node runs in its own free slots, and
the attempt records and results not yet written. ``BlockDuty`` chooses and claims a
new block when the node has free slots and its blocks have nothing left to start,
starts indices through the agent's normal attempt path, and flushes what ended
once per window (``flush_window``: longer in a larger mesh; sooner when much is
waiting), one fenced transaction per block. A block is released (its claim deleted in
its last flush) when every task has its result, or when the node drains or the
experiment is cancelled; a block whose fence fails is dropped at once: its claim is
gone, so a peer may be running it.

Starts are recorded in the next flush, not before the process starts: if the node
dies within one flush period of a start, that attempt leaves no record (its task
still runs again elsewhere); every attempt that was recorded running is closed as
``node-lost`` by the next holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hypermesh.agent.claims.placement import LOOKAHEAD
from hypermesh.errors import EtcdUnavailable
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.block_txns import (
    block_view,
    claim_block,
    claim_open_block,
    flush_block,
    lost_entries,
    read_block,
)
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import BlockRef, TaskRef
from hypermesh.state.records import COUNTED_REASONS, LOST_REASONS, TERMINAL, NodeRecord
from hypermesh.state.view import MeshView

if TYPE_CHECKING:
    from hypermesh.agent.claims.placement import Placement
    from hypermesh.agent.claims.pool_preference import PoolPreference
    from hypermesh.agent.claims.unsure import UnsureClaims
    from hypermesh.agent.tasks.running import Running
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace

log = logging.getLogger(__name__)

FLUSH_S = 0.05
"""How long ended attempts wait to share a flush in a small mesh (seconds)."""

FLUSH_MAX_S = 10.0
"""The longest they wait, in a mesh however large."""

FLUSH_AT = 64
"""Records waiting that make a flush start at once."""

CURSOR_S = 5.0
"""How long ``choose_block`` skips the finished blocks it passed before looking at them
again: a block ``hypermesh retry`` reopened waits at most this long for a node that
chooses blocks itself (the leader's offers rescan as often)."""


@dataclass
class HeldBlock:
    """A block this node holds: what is left to start, runs, and is not yet written."""

    ref: BlockRef
    fence: int  # the claim's create revision
    retries: int
    todo: deque[int]
    attempts: dict[int, int]  # index -> the last attempt number used
    failures: dict[int, int]  # index -> counted failures since the last retry
    running: set[int] = field(default_factory=set)
    unfinished: set[int] = field(default_factory=set)  # no final result yet
    pending: dict[tuple[int, int], AttemptEntry] = field(default_factory=dict)
    results: list[ResultEntry] = field(default_factory=list)
    releasing: bool = False  # start nothing more; give the block back once idle
    params: list[dict[str, Any]] | None = None  # read with the claim (``--watch own``)
    recovering: set[int] = field(default_factory=set)  # last attempt lost (``--watch own``)
    slot: int | None = None  # the slot of its experiment's ``workers`` cap it holds

    @property
    def complete(self) -> bool:
        return not self.unfinished

    @property
    def may_release(self) -> bool:
        return (self.complete or self.releasing) and not self.running


def choose_block(
    view: MeshView, node: NodeRecord, held: set[BlockRef], rng: random.Random | None = None,
    held_back: Collection[tuple[str, str]] = (), cursors: dict[tuple[str, str], int] | None = None,
    placement: Placement | None = None, preference: PoolPreference | None = None,
) -> BlockRef | None:
    """A block this node may claim: nobody holds it and it has a task without a result
    or claim. Oldest workflow first, experiments in dependency order, blocks in order;
    among the first few (one per live node), a random one, so that agents racing for
    the same experiment rarely collide. Experiments in ``held_back`` (workflow,
    experiment) wait for their image (``agent/tasks/images.py``). A block the leader
    offers another node (``offer/``, in a mesh with ``--watch own`` nodes) is taken only
    when the experiment has no other: the node it is offered to would find it gone.
    ``cursors`` (``MeshView.open_blocks``) lets a call skip the finished blocks an
    earlier one passed: on a large mesh an experiment may have tens of thousands of
    one-task blocks. With ``placement``, the one-task blocks of an experiment with
    ``inputs`` (a large mesh) are placed as its tasks would be on a small one: first
    those whose data this node holds, none that a node holding more of it should take
    first (for the locality delay; ``agent/claims/placement.py``). With ``preference``,
    those of an experiment with ``prefer_pools`` likewise: a node of another pool
    leaves as many as the preferred pools' nodes have room for to them, for the pool
    delay (``agent/claims/pool_preference.py``)."""
    spread = max(1, len(view.nodes)) if rng is not None else 1
    offered = _offered_elsewhere(view, node.name)
    for wf in sorted(view.workflows.values(), key=lambda w: (w.submitted_at, w.id)):
        if view.workflow_state(wf.id) in TERMINAL:
            continue
        for name in wf.recipe.topological_order():
            if (wf.id, name) not in view.expanded or not view.batched(wf.id, name):
                continue
            if view.experiment_cancelled(wf.id, name) or (wf.id, name) in held_back:
                continue
            exp = wf.recipe.experiment(name)
            if not allowed_on(exp, node):
                continue
            if view.workers(wf.id, exp) is not None and not view.free_block_slots(wf.id, exp):
                continue  # its cap is reached (or its free slots are offered to others)
            placed = placement is not None and bool(exp.inputs)
            preferred = preference is not None and bool(exp.prefer_pools)
            want = LOOKAHEAD if placed or preferred else spread
            candidates: list[BlockRef] = []
            fallback: BlockRef | None = None
            for bref in view.open_blocks(wf.id, name, cursors):
                if bref not in view.block_claims and bref not in held:
                    if bref in offered:
                        fallback = fallback or bref
                        continue
                    candidates.append(bref)
                    if len(candidates) >= want:
                        break
            if preferred and candidates:
                assert preference is not None
                allowed = preference.split(wf.id, exp, {b.first for b in candidates})
                candidates = [b for b in candidates if b.first in allowed]
                if not placed:
                    candidates, fallback = candidates[:spread], None
            if placed:  # and a block offered to another node is left to it
                assert placement is not None
                candidates, fallback = _placed(placement, wf.id, exp, candidates, spread), None
            if candidates:
                return rng.choice(candidates) if rng is not None else candidates[0]
            if fallback is not None:
                return fallback
    return None


def _placed(placement: Placement, wid: str, exp: Experiment, candidates: list[BlockRef],
            spread: int) -> list[BlockRef]:
    """The one-task blocks among ``candidates`` to choose from by where their data is:
    the one whose data this node holds most of, else the first ``spread`` that no node
    holding more of their data should take first."""
    if not candidates:
        return []
    by_first = {b.first: b for b in candidates}
    preferred, neutral = placement.split(wid, exp, set(by_first))
    if preferred:
        return [by_first[preferred[0]]]
    return [by_first[i] for i in sorted(neutral)[:spread]]


def _offered_elsewhere(view: MeshView, node: str) -> set[BlockRef]:
    """The blocks the leader offers nodes other than ``node``."""
    return {b for name, (blocks, _) in view.offers.items() if name != node for b in blocks}


def _block_state(view: MeshView, bref: BlockRef) -> tuple[
    dict[int, int], dict[int, int], list[tuple[int, int, str, float | None]], deque[int]
]:
    """What ``view`` says of ``bref``'s tasks: per index the last attempt number and
    the counted failures, the attempts left running (index, attempt, node, start), and
    the indices without a result, in order."""
    size = view.blocks[(bref.workflow, bref.experiment)][bref.first]
    attempts: dict[int, int] = {}
    failures: dict[int, int] = {}
    left: list[tuple[int, int, str, float | None]] = []
    todo: deque[int] = deque()
    for offset in range(size):
        ref = bref.task(offset)
        known = view.attempts.get(ref, {})
        last = known[max(known)] if known else None
        attempts[ref.index] = last.attempt if last else 0
        failures[ref.index] = view.counted_failures(ref)
        if last is not None and last.state == "running":
            left.append((ref.index, last.attempt, last.node, last.started_at))
        if ref not in view.results:
            todo.append(ref.index)
    return attempts, failures, left, todo


class BlockHost(Protocol):
    """What :class:`BlockDuty` uses of its agent. It writes ``written_revision`` (never
    lowers it) and stops the processes of a lost block's attempts in ``running``."""

    cfg: AgentConfig
    ks: Keyspace
    etcd: Etcd
    view: MeshView
    lease: int
    unsure: UnsureClaims
    running: dict[TaskRef, Running]
    written_revision: int

    @property
    def lease_is_lost(self) -> bool: ...

    def lease_fresh(self) -> bool: ...

    def decide(self, message: str) -> None: ...

    def wake(self) -> None: ...


class BlockDuty:
    """The blocks one agent holds. Runs on the agent's event loop; only it changes
    ``held``, and the attempts' task tells it of each end (:meth:`ended`)."""

    def __init__(self, agent: BlockHost) -> None:
        self.agent = agent
        self.held: dict[BlockRef, HeldBlock] = {}
        self._seq = 0
        self._flush_now = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        # ``--watch own``: offered blocks this node lost a claim of, or gave back, and the
        # revision it did: an offer older than that is stale for them.
        self._passed: dict[BlockRef, int] = {}
        # What this node ran of blocks, as its flushes recorded it, for its /metrics where
        # its view holds no block (``--watch own``): ended attempts by (state, reason),
        # and the tasks it took over after their last attempt was lost.
        self.ended_attempts: Counter[tuple[str, str]] = Counter()
        self.recoveries = 0
        # choose_block's cursors past each experiment's finished blocks, and when they
        # are cleared next (a retry may reopen a finished block).
        self._cursors: dict[tuple[str, str], int] = {}
        self._cursors_until = 0.0

    @property
    def own(self) -> bool:
        """This node chooses blocks from its offers and does not watch them."""
        return self.agent.cfg.watch == "own"

    def _wrote(self, revision: int) -> None:
        """A block write of ours at ``revision``: a node that watches the blocks waits for
        its view to reach it before claiming again; one that does not, never would."""
        if not self.own:
            self.agent.written_revision = max(self.agent.written_revision, revision)

    # ------------------------------------------------------------------ claiming
    def wants_block(self) -> bool:
        """Whether this node should look for another block: none it holds has a task
        left to start."""
        return not any(b.todo for b in self.held.values())

    def cursors(self) -> dict[tuple[str, str], int]:
        """``choose_block``'s cursors, cleared every ``CURSOR_S`` seconds."""
        now = time.monotonic()
        if now >= self._cursors_until:
            self._cursors.clear()
            self._cursors_until = now + CURSOR_S
        return self._cursors

    def batch_key(self, bref: BlockRef) -> str:
        self._seq += 1
        return self.agent.ks.block_batch(bref, self.agent.lease, self._seq)

    async def claim(
        self, bref: BlockRef, refused: Callable[[int], None] | None = None
    ) -> HeldBlock | None:
        """Claim ``bref`` (closing attempts its last holder left running as lost);
        ``refused`` is told the revision etcd answered a lost claim at."""
        agent, view = self.agent, self.agent.view
        view.settle(bref)  # every outcome recorded so far, and the attempts left running
        exp = view.workflows[bref.workflow].recipe.experiment(bref.experiment)
        attempts, failures, left, todo = _block_state(view, bref)
        if not todo:
            return None
        slot: int | None = None
        if view.workers(bref.workflow, exp) is not None:
            free = view.free_block_slots(bref.workflow, exp)
            if not free:
                return None
            slot = random.choice(free)  # nodes racing for the cap rarely want the same one
        try:
            fence = await claim_block(
                agent.etcd, agent.ks, bref, agent.cfg.name, agent.lease, view.revision,
                self.batch_key(bref), lost_entries(left, time.time()), refused=refused,
                slot=slot,
            )
        except EtcdUnavailable:
            agent.unsure.block(bref, slot)  # written or not: read back when etcd is back
            raise
        if fence is None:
            return None
        self._wrote(fence)
        block = HeldBlock(bref, fence, exp.retries, todo, attempts, failures,
                          unfinished=set(todo), slot=slot)
        self.held[bref] = block
        lost = f"; {len(left)} attempts of its last holder lost" if left else ""
        agent.decide(f"claimed block {bref} ({len(todo)} tasks to run){lost}")
        return block

    def choose_offered(self, held_back: Collection[tuple[str, str]] = ()) -> BlockRef | None:
        """The first block of this node's offer (``offer/<node>``) it may claim: not held
        here, not given back or passed since the view the offer was planned from, of live
        work whose image is here."""
        view = self.agent.view
        offered, revision = view.offers.get(self.agent.cfg.name, ((), 0))
        self._passed = {b: r for b, r in self._passed.items() if b in offered}
        for bref in offered:
            if bref in self.held or self._passed.get(bref, 0) >= revision:
                continue
            if (bref.workflow, bref.experiment) in held_back:
                continue
            if bref.workflow not in view.workflows or (
                view.workflow_state(bref.workflow) in TERMINAL
                or view.experiment_cancelled(bref.workflow, bref.experiment)
            ):
                continue
            if self.offered_slot(bref) is None and view.workers(
                bref.workflow, view.workflows[bref.workflow].recipe.experiment(bref.experiment)
            ) is not None:
                continue  # capped: claimed only with the slot an offer gives it
            return bref
        return None

    def offered_slot(self, bref: BlockRef) -> int | None:
        """The slot of its experiment's ``workers`` cap this node's offer gives ``bref``."""
        return self.agent.view.offered_slots.get((bref.workflow, bref.experiment), {}).get(bref)

    async def claim_offered(self, bref: BlockRef) -> HeldBlock | None:
        """Claim ``bref``, then read its block and batches from etcd (``--watch own``:
        the view has neither); the attempts its last holder left running are closed as
        lost in the first flush."""
        agent = self.agent

        def refused(revision: int) -> None:
            self._passed[bref] = revision

        slot = self.offered_slot(bref)
        try:
            fence = await claim_open_block(agent.etcd, agent.ks, bref, agent.cfg.name,
                                           agent.lease, refused, slot)
            if fence is None:
                return None
            kvs = await read_block(agent.etcd, agent.ks, bref)
        except EtcdUnavailable:
            agent.unsure.block(bref, slot)  # held or not: read back, given back when etcd is back
            raise
        exp = agent.view.workflows[bref.workflow].recipe.experiment(bref.experiment)
        scratch = block_view(agent.ks, kvs)
        attempts, failures, left, todo = _block_state(scratch, bref)
        params = [scratch.tasks.get(bref.task(i), {}).get("params", {})
                  for i in range(len(attempts))]
        block = HeldBlock(bref, fence, exp.retries, todo, attempts, failures,
                          unfinished=set(todo), params=params, slot=slot)
        block.recovering = {index for index, *_ in left} | {
            index for index in todo if _last_reason(scratch, bref.task(index)) in LOST_REASONS}
        for entry in lost_entries(left, time.time()):
            block.pending[(entry.index, entry.attempt)] = entry
        self.held[bref] = block
        lost = f"; {len(left)} attempts of its last holder lost" if left else ""
        agent.decide(f"claimed block {bref} ({len(todo)} tasks to run){lost}")
        if left or not todo:
            self._kick(len(block.pending), urgent=not todo)
        return block

    def next_start(
        self, book: Callable[[TaskRef], list[int] | None] | None = None
    ) -> tuple[HeldBlock, TaskRef, int, float, list[int]] | None:
        """The next task to start in a free slot, its attempt number, start time and the
        GPUs ``book`` booked for it. A block whose next task ``book`` cannot place now
        (None: its GPUs are taken) waits, and the next block is looked at."""
        for block in self.held.values():
            if block.releasing:
                continue
            if self.agent.view.workflow_state(block.ref.workflow) in TERMINAL or (
                self.agent.view.experiment_cancelled(block.ref.workflow, block.ref.experiment)
            ):
                self.release(block)
                continue
            if block.todo:
                ref = TaskRef(block.ref.workflow, block.ref.experiment, block.todo[0])
                devices = book(ref) if book is not None else []
                if devices is None:
                    continue
                index = block.todo.popleft()
                if index in block.recovering:
                    block.recovering.discard(index)
                    self.recoveries += 1
                block.attempts[index] += 1
                n = block.attempts[index]
                block.running.add(index)
                now = time.time()
                block.pending[(index, n)] = AttemptEntry(index, n, "running", started_at=now)
                self._kick(len(block.pending))
                return block, ref, n, now, devices
        return None

    # ------------------------------------------------------------------ ending
    def ended(
        self, bref: BlockRef, fence: int, index: int, n: int, state: str, exit_code: int | None,
        reason: str, started_at: float, ended_at: float,
    ) -> str | None:
        """Record an attempt's end; the task's final state, or None if it runs again (or
        the block is no longer held here, in which case nothing is recorded)."""
        block = self.held.get(bref)
        if block is None or block.fence != fence:
            return None
        block.running.discard(index)
        final: str | None = state
        if state == "failed":
            if reason in COUNTED_REASONS:
                block.failures[index] += 1
                final = "failed" if block.failures[index] > block.retries else None
            else:
                final = None  # preempted or lost: runs again, not counted
        block.pending[(index, n)] = AttemptEntry(index, n, state, exit_code, reason,
                                                 started_at, ended_at)
        if final is not None:
            block.unfinished.discard(index)
            block.results.append(ResultEntry(index, final, n, exit_code, ended_at))
        elif not block.releasing:
            block.todo.append(index)
        self._kick(len(block.pending) + len(block.results), urgent=block.may_release)
        return final

    def release(self, block: HeldBlock) -> None:
        """Start nothing more of ``block``; it is given back once its attempts ended."""
        if not block.releasing:
            block.releasing = True
            block.todo.clear()
            self._kick(0, urgent=True)

    def release_all(self) -> None:
        for block in list(self.held.values()):
            self.release(block)

    def drop_all(self) -> None:
        """The lease is gone: every claim with it; nothing held can be written."""
        self.held.clear()

    def busy(self) -> bool:
        return bool(self.held)

    # ------------------------------------------------------------------ flushing
    def _kick(self, waiting: int, urgent: bool = False) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="block flushes")
        if urgent or waiting >= FLUSH_AT:
            self._flush_now.set()

    async def _flush_loop(self) -> None:
        while self.held:
            if not any(b.pending or b.results or b.may_release for b in self.held.values()):
                self._flush_now.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._flush_now.wait()
                continue
            view = self.agent.view
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(flush_window(len(view.nodes),
                                                        view.settings.flush_rate)):
                    await self._flush_now.wait()
            self._flush_now.clear()
            for block in list(self.held.values()):
                if block.pending or block.results or block.may_release:
                    await self._flush(block)

    async def _flush(self, block: HeldBlock) -> None:
        agent = self.agent
        flushed = dict(block.pending)
        results = tuple(block.results)
        release = block.may_release
        batch = Batch(agent.cfg.name, tuple(flushed.values()), results)
        delay = 0.1
        while True:
            try:
                written = await flush_block(agent.etcd, agent.ks, block.ref, block.fence,
                                           self.batch_key(block.ref), batch, release,
                                           block.slot)
                break
            except EtcdUnavailable as exc:
                if agent.lease_is_lost or not agent.lease_fresh():
                    return
                log.warning("flushing block %s: %s", block.ref, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
        if self.held.get(block.ref) is not block:
            return  # dropped meanwhile (the lease was lost)
        if written is None:
            self.held.pop(block.ref, None)
            agent.decide(f"block {block.ref}: claim no longer ours; its results rejected")
            self._stop_attempts(block.ref, [block.ref.task(i - block.ref.first)
                                            for i in block.running])
            return
        self._wrote(written)
        self.ended_attempts.update((e.state, e.reason or "") for e in flushed.values()
                                   if e.node is None and e.state != "running")
        for key, entry in flushed.items():
            if block.pending.get(key) is entry:  # not replaced by a later record meanwhile
                del block.pending[key]
        del block.results[: len(results)]
        if release:
            self.held.pop(block.ref, None)
            self._passed[block.ref] = written
            done = "done" if block.complete else "released"
            agent.decide(f"block {block.ref} {done}")
            agent.wake()

    def own_attempts(self) -> Counter[tuple[str, str]]:
        """This node's attempts of blocks by (state, reason): those its flushes recorded
        as ended, and those running now."""
        running = sum(len(b.running) for b in self.held.values())
        return self.ended_attempts + Counter({("running", ""): running})

    def _stop_attempts(self, bref: BlockRef, refs: list[TaskRef]) -> None:
        """A held block's claim is gone: its attempts here stop now (their results
        would be rejected, and a peer may be running them already)."""
        running = self.agent.running
        for ref in refs:
            r = running.get(ref)
            if r is not None and r.block == bref and r.process is not None:
                r.process.stop("node-lost", grace=0)


def flush_window(members: int, flush_rate: int) -> float:
    """Seconds a node's ended attempts wait to share a flush in a mesh of ``members``
    nodes that write ``flush_rate`` batches a second at most, all together
    (``MeshSettings.flush_rate``): ``FLUSH_S`` in a small mesh, longer in proportion to
    the members past that, so that the writes etcd takes and the events the leader
    receives stay within the budget however many nodes end tasks at once, up to
    ``FLUSH_MAX_S``. Nomad spaces its clients' heartbeats the same way (a rate the
    servers take, divided among the clients)."""
    return min(FLUSH_MAX_S, max(FLUSH_S, members / max(1, flush_rate)))


def _last_reason(view: MeshView, ref: TaskRef) -> str | None:
    """Why the last recorded attempt of ``ref`` ended, if it has one."""
    attempts = view.attempts.get(ref)
    return attempts[max(attempts)].reason if attempts else None
