"""Which tasks this node should claim next. Pure: reads a view, returns plans.

Order: oldest workflow first, experiments in dependency order, tasks by index,
so work drains in the order it was submitted. A task is a candidate when it has
no claim and no result, its workflow is live, its hardware fits this node, the
node has a free slot (and enough free GPUs), the node's pool is one the
experiment allows (``pools``) and no preferred pool's node should take it first
(``prefer_pools``, for a bounded delay), its experiment was not cancelled, and its
experiment's ``workers`` cap (the recipe's, or one changed live with
``hypermesh scale``) has a free slot key and room above the tasks running now.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Collection
from dataclasses import dataclass, field

from hypermesh.agent.claims.placement import Placement
from hypermesh.agent.claims.pool_preference import PoolPreference
from hypermesh.agent.tasks.gpu_pool import GpuInfo, GpuPool
from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import TERMINAL, NodeRecord
from hypermesh.state.txns import ClaimPlan
from hypermesh.state.view import MeshView


@dataclass
class LocalLoad:
    """What this node is already running, including claims the view has not seen yet."""

    running: set[TaskRef] = field(default_factory=set)
    slots_held: set[tuple[str, str, int]] = field(default_factory=set)
    gpus_used: float = 0.0
    # This node's GPU bookings (a copy the planner books into) and devices, when it has
    # GPUs: a task is claimed only if ``GpuPool.book`` places it, so none overcommits.
    gpu_pool: GpuPool | None = None
    gpu_devices: list[GpuInfo] = field(default_factory=list)


def choose_claims(
    view: MeshView,
    node: NodeRecord,
    load: LocalLoad,
    limit: int,
    rng: random.Random | None = None,
    placement: Placement | None = None,
    preference: PoolPreference | None = None,
    held_back: Collection[tuple[str, str]] = (),
) -> list[ClaimPlan]:
    """Up to ``limit`` tasks this node can start now, with attempt numbers and slots.

    With ``rng`` and several live nodes, each node picks at random among the
    lowest open indices (a window as wide as the nodes' combined batch), so
    agents racing for the same experiment rarely collide on the same tasks
    while work still drains roughly in index order. With ``placement``, tasks whose
    data this node holds come first and tasks a holder should take are skipped for a
    while (``agent/claims/placement.py``). With ``preference``, tasks of experiments that prefer
    other pools are left a while to those pools' live nodes with room
    (``agent/claims/pool_preference.py``). Experiments in ``held_back`` (workflow,
    experiment) are left alone: this node is pulling their image (``agent/tasks/images.py``).
    """
    spread = max(1, len(view.nodes)) if rng is not None else 1
    free = node.slots - len(load.running)
    limit = min(limit, free)
    if limit <= 0:
        return []
    gpus_free = node.gpus - load.gpus_used
    plans: list[ClaimPlan] = []
    workflows = sorted(view.workflows.values(), key=lambda w: (w.submitted_at, w.id))
    for wf in workflows:
        if view.workflow_state(wf.id) in TERMINAL:
            continue
        for name in wf.recipe.topological_order():
            if (wf.id, name) not in view.expanded or view.experiment_cancelled(wf.id, name):
                continue
            if held_back and (wf.id, name) in held_back:
                continue
            open_indices = view.open.get((wf.id, name))
            if not open_indices or view.batched(wf.id, name):
                continue  # none, or claimed block by block (agent/tasks/blocks.py)
            exp = wf.recipe.experiment(name)
            if exp.nodes > 1:
                continue  # a gang: claimed seat by seat (agent/gang/policy.py)
            if not allowed_on(exp, node):
                continue
            if preference is not None:
                open_indices = preference.split(wf.id, exp, open_indices)
                if not open_indices:
                    continue
            workers = view.workers(wf.id, exp)
            free_slots: list[int] = []
            if workers is not None:
                taken = view.slots.get((wf.id, name), set())
                held = {k for (w, e, k) in load.slots_held if (w, e) == (wf.id, name)}
                free_slots = [k for k in range(workers) if k not in taken and k not in held]
                # A cap lowered (or set) live: tasks still running on slots above it,
                # or on no slot, count too, so the mesh converges to the new cap.
                running = max(len(taken | held), view.counts[(wf.id, name)]["running"])
                free_slots = free_slots[: max(0, workers - running)]
                if not free_slots:
                    continue
            want = limit - len(plans)
            if workers is not None:
                want = min(want, len(free_slots))
            first: list[int] = []
            if placement is not None:
                first, open_indices = placement.split(wf.id, exp, open_indices)
            window = heapq.nsmallest(want * spread + len(load.running), open_indices)
            if rng is not None and spread > 1:
                window = sorted(rng.sample(window, min(len(window), want + len(load.running))))
            window = first + window
            for index in window:
                ref = TaskRef(wf.id, name, index)
                if ref in load.running:
                    continue
                if load.gpu_pool is not None:
                    if load.gpu_pool.book(ref, exp.hardware, load.gpu_devices) is None:
                        break
                elif exp.hardware.gpus > gpus_free:
                    break
                gpus_free -= exp.hardware.gpus
                attempts = view.attempts.get(ref, {})
                last = attempts[max(attempts)] if attempts else None
                lost = last if last is not None and last.state == "running" else None
                slot = free_slots.pop(0) if workers is not None else None
                plans.append(ClaimPlan(ref, (last.attempt if last else 0) + 1, slot, lost))
                if len(plans) >= limit or (workers is not None and not free_slots):
                    break
            if len(plans) >= limit:
                return plans
    return plans
