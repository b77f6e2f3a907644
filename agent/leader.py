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


@dataclass(frozen=True)
class Expand:
    workflow: str
    experiment: str


@dataclass(frozen=True)
class SetState:
    workflow: str
    expected: str
    state: str


Action = Expand | SetState


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
