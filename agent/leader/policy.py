"""The leader's decisions. Pure: reads a view, returns actions for the I/O layer
(``agent/leader/duty.py``).

The leader expands an experiment into tasks once every experiment it comes
``after`` has succeeded, writes the tasks of samples added to a running
experiment (``hypermesh extend``), moves a workflow to ``running`` when its first
experiment is expanded, and records a workflow's final state when every
experiment has ended. All of it is recomputed from etcd's state, so a new leader
picks up exactly where the last one stopped.

Every action carries the mod revision of the workflow's state key as the leader
saw it, and the I/O layer writes only while it is unchanged: a live change
(cancel of an experiment, retry, added samples, a new cap) rewrites that key, so
a decision taken on the state before the change is never written after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypermesh.state.records import TERMINAL
from hypermesh.state.search import DEFAULT_PARALLELISM, is_adaptive, next_indices
from hypermesh.state.view import MeshView


@dataclass(frozen=True)
class Expand:
    workflow: str
    experiment: str
    state_revision: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Extend:
    """Write tasks ``start .. start+count-1`` of an expanded experiment (samples added live)."""

    workflow: str
    experiment: str
    start: int
    count: int
    state_revision: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SetState:
    workflow: str
    expected: str
    state: str
    state_revision: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Suggest:
    """Create the next trials (``indices``) of an adaptive search from the results so far."""

    workflow: str
    experiment: str
    indices: tuple[int, ...]
    state_revision: int | None = field(default=None, compare=False)


Action = Expand | Extend | SetState | Suggest


def plan(view: MeshView) -> list[Action]:
    actions: list[Action] = []
    for wid, wf in sorted(view.workflows.items(), key=lambda kv: kv[1].submitted_at):
        stored = view.workflow_state(wid)
        if stored in TERMINAL:
            continue
        revision = view.workflow_state_revisions.get(wid)
        summaries = {e.name: view.experiment_summary(wf, e) for e in wf.recipe.experiments}
        expanding = False
        for exp in wf.recipe.experiments:
            if view.experiment_cancelled(wid, exp.name):
                continue
            count = view.expanded.get((wid, exp.name))
            if count is not None:
                target = view.target_count(wid, exp)
                if count < target:
                    actions.append(Extend(wid, exp.name, count, target - count, revision))
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
                actions.append(Expand(wid, exp.name, revision))
                expanding = True
        final = view.derived_final_state(wid)
        if final is not None:
            actions.append(SetState(wid, stored, final, revision))
        elif stored == "pending" and (
            expanding or any((wid, e.name) in view.expanded for e in wf.recipe.experiments)
        ):
            actions.append(SetState(wid, "pending", "running", revision))
    return actions
