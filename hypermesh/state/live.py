"""Live changes to a submitted workflow: cancel one experiment, change its
``workers`` cap, add samples, retry failed tasks.

Each change is one etcd transaction (or a few, for a long retry) guarded by the
mod revisions of what it read, and each also rewrites the workflow's state key.
The leader fences its own writes (expansions, final states) with that key's
revision, so a decision it took before a change is never written after it; the
claimers and the leader see the change through their watch. The invariants hold:

- a task has at most one success: ``retry`` reopens only tasks whose result is
  ``failed`` (compared by revision), and claims still require no result;
- the DAG holds: ``extend`` refuses an experiment whose dependents were expanded
  (compared in the same transaction), and a retried experiment's dependents are
  expanded only once it has succeeded, as always.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hypermesh.errors import NotFound, StateConflict, UsageError
from hypermesh.state.block_txns import claimable
from hypermesh.state.blocks import Batch
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import TERMINAL, ExperimentControl, WorkflowRecord, dumps
from hypermesh.state.txns import state_value
from hypermesh.state.view import MeshView

ATTEMPTS = 20  # reads-and-writes tried before giving up on a key others keep changing
RETRY_BATCH = 40  # tasks reopened per transaction (3 operations each)


@dataclass(frozen=True)
class Snapshot:
    """What a live change read: the workflow, its state key and one experiment's control."""

    wf: WorkflowRecord
    state: str
    state_revision: int
    control: ExperimentControl
    expanded: frozenset[str]  # experiments whose tasks were written
    extra_samples: dict[str, int]  # every experiment's samples added live (``extend``)


async def _read(etcd: Etcd, ks: Keyspace, wid: str, experiment: str | None) -> Snapshot:
    found = await etcd.get(ks.workflow(wid))
    if found is None:
        raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
    wf = WorkflowRecord.from_json(json.loads(found[0]))
    if experiment is not None and experiment not in {e.name for e in wf.recipe.experiments}:
        names = ", ".join(e.name for e in wf.recipe.experiments)
        raise NotFound(f"workflow {wid} has no experiment {experiment!r} (it has: {names})")
    current = await etcd.get(ks.workflow_state(wid))
    state, revision = (json.loads(current[0])["state"], current[1]) if current else ("pending", 0)
    # Every control write also rewrites the state key (read above), so the state
    # revision a change compares fences all of these too.
    controls: dict[str, ExperimentControl] = {}
    if experiment is not None:
        kvs, _ = await etcd.get_prefix(ks.kind_prefix("expctl", wid))
        for kv in kvs:
            name = kv.key.decode().rsplit("/", 1)[1]
            controls[name] = ExperimentControl.from_json(json.loads(kv.value), kv.mod_revision)
    control = controls.get(experiment or "", ExperimentControl())
    extra = {name: c.extra_samples for name, c in controls.items() if c.extra_samples}
    kvs, _ = await etcd.get_prefix(ks.kind_prefix("expanded", wid))
    expanded = frozenset(kv.key.decode().rsplit("/", 1)[1] for kv in kvs)
    return Snapshot(wf, state, revision, control, expanded, extra)


async def _change(
    etcd: Etcd,
    ks: Keyspace,
    wid: str,
    experiment: str,
    change: Callable[[Snapshot], ExperimentControl | None],
    extra_compares: Callable[[Snapshot], list[Any]] = lambda s: [],
) -> tuple[Snapshot, ExperimentControl | None]:
    """Read, let ``change`` compute the experiment's new control (None: nothing to
    do), write it guarded by what was read; again if someone wrote in between."""
    for _ in range(ATTEMPTS):
        snap = await _read(etcd, ks, wid, experiment)
        if snap.state in TERMINAL:
            raise StateConflict(f"workflow {wid} has ended ({snap.state}); nothing to change")
        new = change(snap)
        if new is None:
            return snap, None
        key = ks.experiment_control(wid, experiment)
        compare = [
            etcd.mod_revision_is(key, snap.control.revision),
            etcd.mod_revision_is(ks.workflow_state(wid), snap.state_revision),
            *extra_compares(snap),
        ]
        ops = [
            etcd.op_put(key, dumps(new.to_json())),
            # Rewriting the state (same value) fences the leader's pending decisions.
            etcd.op_put(ks.workflow_state(wid), state_value(snap.state)),
        ]
        if (await etcd.txn(compare, ops)).succeeded:
            return snap, new
    raise StateConflict(f"workflow {wid} kept changing; try again")


async def cancel_experiment(etcd: Etcd, ks: Keyspace, wid: str, experiment: str) -> bool:
    """Cancel one experiment: nothing new of it starts, its running tasks are stopped,
    its dependents are cancelled; the rest of the workflow goes on. False if it already was."""

    def change(snap: Snapshot) -> ExperimentControl | None:
        return None if snap.control.cancelled else replace(snap.control, cancelled=True)

    _, new = await _change(etcd, ks, wid, experiment, change)
    return new is not None


async def scale_experiment(
    etcd: Etcd, ks: Keyspace, wid: str, experiment: str, workers: int | None
) -> int | None:
    """Set the experiment's ``workers`` cap (None: no cap; 0: start nothing new).
    Returns the cap it had before."""
    if workers is not None and workers < 0:
        raise UsageError(f"--workers must be 0 or more (or 'none'), not {workers}")
    blocks, _ = await etcd.get_prefix(f"{ks.kind_prefix('block', wid)}{experiment}/")
    several = any(len(json.loads(kv.value).get("params", ())) != 1 for kv in blocks)
    if several:
        raise UsageError(
            f"experiment {experiment} of {wid} runs in blocks of several tasks "
            "(hypermesh/state/blocks.py), which take no workers cap; give it 'batch: 1' or a "
            "'workers' cap in the recipe to scale it live"
        )
    before: list[int | None] = []

    def change(snap: Snapshot) -> ExperimentControl | None:
        control = snap.control
        recipe_cap = snap.wf.recipe.experiment(experiment).workers
        before[:] = [control.workers if control.workers_set else recipe_cap]
        return replace(control, workers_set=True, workers=workers)

    await _change(etcd, ks, wid, experiment, change)
    return before[0]


async def extend_experiment(
    etcd: Etcd, ks: Keyspace, wid: str, experiment: str, samples: int
) -> int:
    """Add ``samples`` tasks to an experiment; the leader writes them. Returns the
    experiment's new task count. Refused once a dependent experiment was expanded
    (its inputs would change under it), if the experiment was cancelled, and
    (``UsageError``, nothing written) if the workflow would then hold more tasks than
    the mesh's ``max-workflow-tasks`` (``hypermesh/recipe/plan.py``)."""
    from hypermesh.recipe.plan import plan_tasks
    from hypermesh.recipe.sampling import planned_count
    from hypermesh.state.settings import load_settings

    if samples < 1:
        raise UsageError(f"--samples must be 1 or more, not {samples}")
    settings, _ = await load_settings(etcd, ks)

    def dependents(snap: Snapshot) -> list[str]:
        return [e.name for e in snap.wf.recipe.experiments if experiment in e.after]

    def change(snap: Snapshot) -> ExperimentControl | None:
        if snap.control.cancelled:
            raise StateConflict(f"experiment {experiment} of {wid} was cancelled")
        started = [d for d in dependents(snap) if d in snap.expanded]
        if started:
            raise StateConflict(
                f"experiment {experiment} of {wid} has dependents that already started "
                f"({', '.join(started)}); adding samples would change their inputs"
            )
        extra = dict(snap.extra_samples)
        extra[experiment] = extra.get(experiment, 0) + samples
        plan = plan_tasks(snap.wf.recipe, settings.max_workflow_tasks).plus(extra)
        if plan.over:
            raise UsageError(plan.refusal(
                f"with {samples:,} more sample(s) of {experiment}, workflow {wid} would plan",
                "add fewer samples",
            ))
        return replace(snap.control, extra_samples=snap.control.extra_samples + samples)

    def dependents_not_expanded(snap: Snapshot) -> list[Any]:
        return [etcd.absent(ks.expanded(wid, d)) for d in dependents(snap)]

    snap, new = await _change(etcd, ks, wid, experiment, change, dependents_not_expanded)
    assert new is not None  # change() returns a control or raises
    return planned_count(snap.wf.recipe.experiment(experiment)) + new.extra_samples


async def retry_failed(etcd: Etcd, ks: Keyspace, wid: str) -> list[str]:
    """Reopen every task of the workflow whose result is ``failed``: its result is
    removed (its attempts stay in history), its task key records the attempt the
    retry starts after (``retry_from``: earlier failures no longer count against
    ``retries``), and the workflow goes back to ``running``. Returns the task ids."""
    snap = await _read(etcd, ks, wid, None)
    if snap.state == "cancelled":
        raise StateConflict(f"workflow {wid} was cancelled; submit it again instead")
    results, _ = await etcd.get_prefix(ks.kind_prefix("result", wid))
    failed: list[tuple[TaskRef, int]] = []
    for kv in results:
        parts = (ks.split(kv.key.decode()) or ("", []))[1]
        if len(parts) == 3 and json.loads(kv.value).get("state") == "failed":
            failed.append((TaskRef(parts[0], parts[1], int(parts[2])), kv.mod_revision))
    failed.sort()
    retried, state_revision = await _reopen_blocks(etcd, ks, wid, snap.state_revision)
    for first in range(0, len(failed), RETRY_BATCH):
        compare = [etcd.mod_revision_is(ks.workflow_state(wid), state_revision)]
        ops = [etcd.op_put(ks.workflow_state(wid), state_value("running"))]
        for ref, result_revision in failed[first : first + RETRY_BATCH]:
            task = await etcd.get(ks.task(ref))
            attempts, _ = await etcd.get_prefix(ks.attempt(ref, 0)[:-1])
            last = max((int(kv.key.decode().rsplit("/", 1)[1]) for kv in attempts), default=0)
            value = json.loads(task[0]) if task else {"params": {}}
            value["retry_from"] = last
            compare.append(etcd.mod_revision_is(ks.result(ref), result_revision))
            ops += [etcd.op_delete(ks.result(ref)), etcd.op_put(ks.task(ref), dumps(value))]
        done = await etcd.txn(compare, ops)
        if not done.succeeded:
            raise _changed_while_retrying(wid, len(retried))
        state_revision = done.revision
        retried += [ref.id for ref, _ in failed[first : first + RETRY_BATCH]]
    return retried


def _changed_while_retrying(wid: str, reopened: int) -> StateConflict:
    return StateConflict(
        f"workflow {wid} changed while retrying ({reopened} task(s) reopened); run retry again"
    )


async def _reopen_blocks(
    etcd: Etcd, ks: Keyspace, wid: str, state_revision: int
) -> tuple[list[str], int]:
    """``retry`` for batched experiments: failed tasks of blocks nobody holds are
    reopened by a batch of their own (``hypermesh.state.blocks``), guarded like a block
    claim. Returns the task ids and the workflow state's revision after."""
    view = MeshView(ks)
    kvs, seen = await etcd.get_prefix(ks.kind_prefix("bdone", wid))
    for kv in kvs:
        view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    per_block: dict[BlockRef, list[tuple[int, int]]] = {}
    for ref, result in sorted(view.results.items()):
        bref = view.block_of(ref)
        if result.state == "failed" and bref is not None:
            per_block.setdefault(bref, []).append((ref.index, max(view.attempts[ref])))
    retried: list[str] = []
    blocks = sorted(per_block)
    for first in range(0, len(blocks), RETRY_BATCH):
        compare = [etcd.mod_revision_is(ks.workflow_state(wid), state_revision)]
        ops = [etcd.op_put(ks.workflow_state(wid), state_value("running"))]
        for bref in blocks[first : first + RETRY_BATCH]:
            compare += claimable(etcd, ks, bref, seen)
            batch = Batch("retry", reopened=tuple(per_block[bref]))
            ops.append(etcd.op_put(ks.block_batch(bref, 0, time.time_ns()),
                                   dumps(batch.to_json())))
        done = await etcd.txn(compare, ops)
        if not done.succeeded:
            raise _changed_while_retrying(wid, len(retried))
        state_revision = done.revision
        for bref in blocks[first : first + RETRY_BATCH]:
            retried += [TaskRef(wid, bref.experiment, i).id for i, _ in per_block[bref]]
    return retried, state_revision
