"""The leader's decisions. Pure: reads a view, returns actions for the I/O layer
(``agent/leader/duty.py``).

The leader expands an experiment into tasks once every experiment it comes
``after`` has succeeded -- a page at a time: it keeps a backlog of tasks written and
not yet finished (``backlog``) and writes the next page when fewer remain, so a
million-task experiment is never written, drawn or held at once -- writes the tasks
of samples added to a running experiment (``hypermesh extend``) the same way, moves a
workflow to ``running`` when its first experiment is expanded, and records a
workflow's final state when every experiment has ended. A workflow whose planning
raises is failed alone, with the error as its reason. All of it is recomputed from
etcd's state, so a new leader picks up exactly where the last one stopped.

Every action carries the mod revision of the workflow's state key as the leader
saw it, and the I/O layer writes only while it is unchanged: a live change
(cancel of an experiment, retry, added samples, a new cap) rewrites that key, so
a decision taken on the state before the change is never written after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypermesh.recipe.recipe import Experiment
from hypermesh.state.blocks import block_size
from hypermesh.state.records import TERMINAL, WorkflowRecord
from hypermesh.state.search import DEFAULT_PARALLELISM, is_adaptive, next_indices
from hypermesh.state.view import MeshView


@dataclass(frozen=True)
class Expand:
    """Write the first ``count`` tasks of an experiment (its first page, ``backlog``)
    and its ``expanded`` marker; an adaptive search's marker holds its budget."""

    workflow: str
    experiment: str
    state_revision: int | None = field(default=None, compare=False)
    count: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Extend:
    """Write tasks ``start .. start+count-1`` of an expanded experiment: its next page,
    once the tasks written and not yet finished run low (``backlog``), or samples
    added live."""

    workflow: str
    experiment: str
    start: int
    count: int
    state_revision: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SetState:
    """Move a workflow from ``expected`` to ``state``; ``reason`` says why the leader
    failed it itself (its planning raised), shown by ``hypermesh status``."""

    workflow: str
    expected: str
    state: str
    state_revision: int | None = field(default=None, compare=False)
    reason: str | None = None


@dataclass(frozen=True)
class Suggest:
    """Create the next trials (``indices``) of an adaptive search from the results so far."""

    workflow: str
    experiment: str
    indices: tuple[int, ...]
    state_revision: int | None = field(default=None, compare=False)


Action = Expand | Extend | SetState | Suggest


BACKLOG_MIN_TASKS = 4096
"""Fewest tasks of an experiment the leader keeps written and not yet finished while it
has more to write: the page it writes at a time when the mesh is small."""

BACKLOG_BLOCKS_PER_SLOT = 4
"""Blocks (or tasks, for per-task keys) per slot of the mesh in the backlog: a node that
finishes a block finds others unclaimed while the next page is written."""


def block_of(view: MeshView, wid: str, exp: Experiment) -> int | None:
    """Tasks per block of the experiment's expansion: the size of its blocks written so
    far (by this leader or one before it), else one chosen for its whole planned count
    and the mesh (``hypermesh.state.blocks.block_size``); None means per-task keys."""
    written = view.blocks.get((wid, exp.name))
    if written:
        return written[min(written)]
    if sum(view.counts.get((wid, exp.name), {}).values()):
        return None  # written task by task already
    workers = view.workers(wid, exp)
    if workers != exp.workers:  # capped live before its expansion (hypermesh scale)
        exp = replace(exp, workers=workers)
    mesh_slots = sum(n.slots for n in view.nodes.values())
    return block_size(exp, view.target_count(wid, exp), mesh_slots)


def backlog(view: MeshView, wid: str, exp: Experiment) -> int:
    """How many tasks of the experiment to keep written and not finished, which is also
    the page written at a time: ``BACKLOG_BLOCKS_PER_SLOT`` blocks per slot of the mesh,
    at least ``BACKLOG_MIN_TASKS``, in whole blocks."""
    block = block_of(view, wid, exp) or 1
    mesh_slots = sum(n.slots for n in view.nodes.values())
    tasks = max(BACKLOG_MIN_TASKS, BACKLOG_BLOCKS_PER_SLOT * max(1, mesh_slots) * block)
    return -(-tasks // block) * block


def unfinished(view: MeshView, wid: str, experiment: str) -> int:
    """Tasks of the experiment written and without a result (open or running)."""
    counts = view.counts.get((wid, experiment))
    return counts["open"] + counts["running"] if counts else 0


MAX_REASON_CHARS = 500
"""Longest failure reason stored in a workflow's state key (the start of the message)."""


def failure_reason(what: str, exc: BaseException) -> str:
    """The ``reason`` of a workflow failed because ``what`` raised ``exc``."""
    text = f"{what} failed: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def plan(view: MeshView) -> list[Action]:
    """The leader's actions, oldest workflow first, each workflow's together.

    Planning one workflow never stops the planning of others: if it raises (a recipe
    that cannot be expanded, whatever got into etcd), that workflow alone is failed,
    with the error as its reason; so is a workflow record the mirror could not read."""
    actions: list[Action] = []
    for wid, wf in sorted(view.workflows.items(), key=lambda kv: kv[1].submitted_at):
        stored = view.workflow_state(wid)
        if stored in TERMINAL:
            continue
        revision = view.workflow_state_revisions.get(wid)
        try:
            actions += _plan_workflow(view, wid, wf, stored, revision)
        except Exception as exc:  # a failure stays in its workflow
            reason = failure_reason("planning", exc)
            actions.append(SetState(wid, stored, "failed", revision, reason))
    for wid, why in sorted(view.unreadable.items()):
        stored = view.workflow_state(wid)
        if wid in view.workflow_states and stored not in TERMINAL:
            revision = view.workflow_state_revisions.get(wid)
            actions.append(SetState(wid, stored, "failed", revision, why[:MAX_REASON_CHARS]))
    return actions


def _plan_workflow(
    view: MeshView, wid: str, wf: WorkflowRecord, stored: str, revision: int | None
) -> list[Action]:
    actions: list[Action] = []
    summaries = {e.name: view.experiment_summary(wf, e) for e in wf.recipe.experiments}
    expanding = False
    for exp in wf.recipe.experiments:
        if view.experiment_cancelled(wid, exp.name):
            continue
        count = view.expanded.get((wid, exp.name))
        if count is not None:
            target = view.target_count(wid, exp)
            if count < target and is_adaptive(exp):  # a budget: no task written up front
                actions.append(Extend(wid, exp.name, count, target - count, revision))
            elif count < target:  # written page by page, as the backlog runs low
                page = backlog(view, wid, exp)
                if unfinished(view, wid, exp.name) < page:
                    actions.append(Extend(wid, exp.name, count, min(page, target - count),
                                          revision))
            elif is_adaptive(exp):
                counts = view.counts.get((wid, exp.name))
                created = sum(counts.values()) if counts else 0
                finished = sum(counts[s] for s in TERMINAL) if counts else 0
                parallel = view.workers(wid, exp) or DEFAULT_PARALLELISM
                todo = next_indices(count, parallel, created, finished)
                if todo:
                    actions.append(Suggest(wid, exp.name, tuple(todo), revision))
            continue
        if all(summaries[dep].state == "succeeded" for dep in exp.after):
            target = view.target_count(wid, exp)
            first = target if is_adaptive(exp) else min(target, backlog(view, wid, exp))
            actions.append(Expand(wid, exp.name, revision, first))
            expanding = True
    final = view.derived_final_state(wid)
    if final is not None:
        actions.append(SetState(wid, stored, final, revision))
    elif stored == "pending" and (
        expanding or any((wid, e.name) in view.expanded for e in wf.recipe.experiments)
    ):
        actions.append(SetState(wid, "pending", "running", revision))
    return actions
