"""One claim round of an agent: fill its free slots with work that fits.

First from the blocks it holds (claiming another block when they have nothing left to
start, ``agent/tasks/blocks.py``), then task by task: ``choose_claims`` picks what fits
this node's free slots and GPUs (with the locality and pool preferences' say), and one
transaction claims the lot on the node lease (``claim_tasks``). What it won starts at once
(:meth:`~hypermesh.agent.tasks.attempts.Attempts.start`); what it lost, another node won,
and the watch brings the change. A claim whose transaction may or may not have been
written (etcd went away during it) is read back later (``agent/claims/unsure.py``).

Read-your-writes: no task or block is claimed before the mirrored view has caught up
with the newest revision this node wrote, so a task it just finished is never mistaken for
an open one; nor, after a claim it lost, before the view has reached the revision etcd
answered that claim at, so that a node whose view lags does not claim the same taken work
again at every wake-up (each a transaction etcd must refuse).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Protocol

from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.agent.tasks.blocks import choose_block
from hypermesh.agent.tasks.images import images_wanted
from hypermesh.agent.tasks.running import Running
from hypermesh.errors import EtcdUnavailable
from hypermesh.state.records import TERMINAL
from hypermesh.state.txns import ClaimPlan, claim_tasks

if TYPE_CHECKING:
    from hypermesh.agent.claims.locality import Locality
    from hypermesh.agent.claims.placement import Placement
    from hypermesh.agent.claims.pool_preference import PoolPreference
    from hypermesh.agent.claims.pool_wait import PoolWait
    from hypermesh.agent.claims.unsure import UnsureClaims
    from hypermesh.agent.gang.duty import GangDuty
    from hypermesh.agent.ops.telemetry import Machine
    from hypermesh.agent.tasks.attempts import Attempts
    from hypermesh.agent.tasks.blocks import BlockDuty
    from hypermesh.agent.tasks.gpu_pool import DeviceSource, GpuInfo, GpuPool
    from hypermesh.agent.tasks.images import ImageCache
    from hypermesh.config import AgentConfig
    from hypermesh.recipe.recipe import Hardware
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace, TaskRef
    from hypermesh.state.records import NodeRecord
    from hypermesh.state.view import MeshView


class ClaimerHost(Protocol):
    """What :class:`Claimer` uses of its agent. It writes ``claiming`` (the tasks of the
    claim transaction in flight, empty between rounds) and ``written_revision`` (never
    lowers it)."""

    cfg: AgentConfig
    view: MeshView
    etcd: Etcd
    ks: Keyspace
    lease: int
    machine: Machine
    gpu_source: DeviceSource
    gpu_pool: GpuPool
    locality: Locality | None
    pool_wait: PoolWait
    unsure: UnsureClaims
    gangs: GangDuty
    blocks: BlockDuty
    attempts: Attempts
    images: ImageCache
    claiming: set[TaskRef]
    written_revision: int
    stopping: asyncio.Event
    lease_lost: asyncio.Event

    def record(self) -> NodeRecord: ...

    def decide(self, message: str) -> None: ...


class Claimer:
    """The agent's claim rounds; the scheduling loop runs one at a time on the agent's
    event loop. Every attempt it claims or starts is in the agent's ``running`` from the
    moment its claim is won."""

    def __init__(self, agent: ClaimerHost) -> None:
        self.agent = agent
        self.rng = random.Random()

    async def claim(self) -> None:
        """Claim and start what fits now, until nothing more does."""
        a = self.agent
        # Experiments whose image this node is still pulling wait (agent/tasks/images.py).
        held = a.images.hold(images_wanted(a.view, a.record()))
        await self._start_block_tasks(held)
        while not a.stopping.is_set() and not a.lease_lost.is_set():
            batch = min(a.cfg.claim_batch, 100 // ClaimPlan.OPS)
            if a.view.revision < a.written_revision:
                return  # the watch will bring our own writes and wake us
            if not a.view.open_task_by_task():
                return  # all open work is in blocks, started above
            load = self._load()
            me = a.record()
            placement = a.locality.placement(a.view) if a.locality else None
            preference = a.pool_wait.round(a.view, me)
            plans = choose_claims(a.view, me, load, batch, self.rng, placement, preference,
                                  held)
            if a.locality is not None and placement is not None:
                a.locality.after_round(placement, a.view)
            a.pool_wait.after_round(preference)
            if not plans:
                return
            # Until the claim is decided its slots and GPUs are taken here, so that a
            # gang seat joined meanwhile (agent/gang/duty.py) cannot take them too.
            a.claiming = {plan.ref for plan in plans}
            if load.gpu_pool is not None:
                for plan in plans:
                    a.gpu_pool.adopt(load.gpu_pool, plan.ref)
            revision = None
            now = time.time()
            try:
                revision = await claim_tasks(a.etcd, a.ks, plans, a.cfg.name, a.lease, now,
                                             refused=self._refused)
            except EtcdUnavailable:
                a.unsure.tasks(plans, now)  # written or not: read back when etcd is back
                raise
            finally:
                a.claiming = set()
                if revision is None:
                    for plan in plans:
                        a.gpu_pool.release(plan.ref)
            if revision is None:
                # Someone else got there first; the watch will bring the change.
                return
            a.written_revision = max(a.written_revision, revision)
            for plan in plans:
                exp = a.view.workflows[plan.ref.workflow].recipe.experiment(plan.ref.experiment)
                r = Running(plan, revision, exp.hardware.gpus)
                if load.gpu_pool is not None:
                    r.devices = a.gpu_pool.adopt(load.gpu_pool, plan.ref)
                if plan.lost is not None:
                    a.decide(f"{plan.ref} attempt {plan.lost.attempt} on {plan.lost.node} lost")
                a.attempts.start(r)
            a.decide(f"claimed {', '.join(str(p.ref) for p in plans)}")

    async def _start_block_tasks(self, held_back: set[tuple[str, str]]) -> None:
        """Fill free slots from the blocks held here, claiming another block when
        they have nothing left to start (agent/tasks/blocks.py)."""
        a = self.agent
        me = a.record()
        running, blocks = a.attempts.running, a.blocks
        while not a.stopping.is_set() and not a.lease_lost.is_set():
            if me.slots - len(running) - len(a.gangs.held()) - len(a.claiming) <= 0:
                return
            start = blocks.next_start(self._book)
            if start is None:
                if not blocks.wants_block():
                    return
                held_back = held_back | self._no_gpu_free()
                if blocks.own:  # chosen from this node's offer; read from etcd once won
                    bref = blocks.choose_offered(held_back)
                    if bref is None or await blocks.claim_offered(bref) is None:
                        return
                    continue
                if a.view.revision < a.written_revision:
                    return  # the watch will bring what we wrote, or what beat our claim
                placement, preference = self._block_placement(me)
                bref = choose_block(a.view, me, set(blocks.held), self.rng, held_back,
                                    blocks.cursors(), placement, preference)
                if placement is not None:
                    assert a.locality is not None
                    a.locality.after_round(placement, a.view)
                if preference is not None:
                    a.pool_wait.after_round(preference)
                if bref is None or await blocks.claim(bref, self._refused) is None:
                    return
                continue
            block, ref, n, started_at, devices = start
            params = block.params[ref.index - block.ref.first] if block.params else None
            gpus = self._hardware(ref.workflow, ref.experiment).gpus if devices else 0.0
            a.attempts.start(Running(ClaimPlan(ref, n), block.fence, gpus, devices,
                                     block=block.ref, started_at=started_at, params=params))

    def _block_placement(self, me: NodeRecord) -> tuple[Placement | None,
                                                       PoolPreference | None]:
        """Where the data of blocks' tasks is, when a live experiment with ``inputs``
        runs in blocks (on a large mesh) and this node places by locality; and the
        preferred pools' room, when one with ``prefer_pools`` does."""
        a = self.agent
        view = a.view
        inputs = prefer = False
        for wf in view.workflows.values():
            if view.workflow_state(wf.id) in TERMINAL:
                continue
            for exp in wf.recipe.experiments:
                if (exp.inputs or exp.prefer_pools) and view.batched(wf.id, exp.name):
                    inputs, prefer = inputs or bool(exp.inputs), prefer or bool(exp.prefer_pools)
        placement = a.locality.placement(view) if inputs and a.locality is not None else None
        return placement, a.pool_wait.round(view, me) if prefer else None

    def _hardware(self, wid: str, experiment: str) -> Hardware:
        return self.agent.view.workflows[wid].recipe.experiment(experiment).hardware

    def _book(self, ref: TaskRef) -> list[int] | None:
        """Book the GPUs a block's task asks for as it starts (one-task blocks of GPU
        experiments on a large mesh, ``hypermesh.state.blocks.block_size``): their
        indices, none for a task that asks for none, None if they are taken now."""
        a = self.agent
        hw = self._hardware(ref.workflow, ref.experiment)
        if not hw.gpus:
            return []
        if not a.machine.gpus:
            return None
        return a.gpu_pool.book(ref, hw, a.gpu_source.devices())

    def _no_gpu_free(self) -> set[tuple[str, str]]:
        """The live experiments (workflow, name) asking for GPUs that no GPU of this
        node has room for now: no block of theirs is claimed until one has."""
        a = self.agent
        view = a.view
        out: set[tuple[str, str]] = set()
        if not a.machine.gpus:  # its record says so: no GPU work is offered or fits here
            return out
        pool: GpuPool | None = None
        devices: list[GpuInfo] = []
        for wf in view.workflows.values():
            if view.workflow_state(wf.id) in TERMINAL:
                continue
            for exp in wf.recipe.experiments:
                if not exp.hardware.gpus:
                    continue
                if pool is None:
                    pool, devices = a.gpu_pool.copy(), a.gpu_source.devices()
                if pool.place(exp.hardware, devices) is None:
                    out.add((wf.id, exp.name))
        return out

    def _refused(self, revision: int) -> None:
        """A claim (of tasks or a block) lost at ``revision``: our view is older than
        that, so the next waits for the view to reach it (``written_revision`` gates
        both kinds of claim)."""
        self.agent.written_revision = max(self.agent.written_revision, revision)

    def _load(self) -> LocalLoad:
        """What this node's attempts, gang seats and claim in flight take now."""
        a = self.agent
        load = LocalLoad()
        for ref, r in a.attempts.running.items():
            load.running.add(ref)
            if r.plan.slot is not None:
                load.slots_held.add((ref.workflow, ref.experiment, r.plan.slot))
            load.gpus_used += r.gpus
        load.running |= a.gangs.held()  # a seat in a gang takes a slot
        load.running |= a.claiming
        if a.machine.gpus:
            load.gpu_pool = a.gpu_pool.copy()
            load.gpu_devices = a.gpu_source.devices()
        return load
