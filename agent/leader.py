"""The leader's decisions. Pure: reads a view, returns actions for the I/O layer.

The leader expands an experiment into tasks once every experiment it comes
``after`` has succeeded, moves a workflow to ``running`` when its first
experiment is expanded, and records a workflow's final state when every
experiment has ended. All of it is recomputed from etcd's state, so a new leader
picks up exactly where the last one stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypermesh.model import TERMINAL, MeshView
from hypermesh.search import is_adaptive, next_indices


@dataclass(frozen=True)
class Expand:
    workflow: str
    experiment: str


@dataclass(frozen=True)
class SetState:
    workflow: str
    expected: str
    state: str


@dataclass(frozen=True)
class Suggest:
    """Create the next trials (``indices``) of an adaptive search from the results so far."""

    workflow: str
    experiment: str
    indices: tuple[int, ...]


Action = Expand | SetState | Suggest


def plan(view: MeshView) -> list[Action]:
    actions: list[Action] = []
    for wid, wf in sorted(view.workflows.items(), key=lambda kv: kv[1].submitted_at):
        stored = view.workflow_state(wid)
        if stored in TERMINAL:
            continue
        summaries = {e.name: view.experiment_summary(wf, e) for e in wf.recipe.experiments}
        expanding = False
        for exp in wf.recipe.experiments:
            if (wid, exp.name) in view.expanded:
                if is_adaptive(exp) and stored != "cancelled":
                    counts = view.counts.get((wid, exp.name))
                    created = sum(counts.values()) if counts else 0
                    finished = sum(counts[s] for s in TERMINAL) if counts else 0
                    todo = next_indices(exp, created, finished)
                    if todo:
                        actions.append(Suggest(wid, exp.name, tuple(todo)))
                continue
            if all(summaries[dep].state == "succeeded" for dep in exp.after):
                actions.append(Expand(wid, exp.name))
                expanding = True
        final = view.derived_final_state(wid)
        if final is not None:
            actions.append(SetState(wid, stored, final))
        elif stored == "pending" and (
            expanding or any((wid, e.name) in view.expanded for e in wf.recipe.experiments)
        ):
            actions.append(SetState(wid, "pending", "running"))
    return actions
