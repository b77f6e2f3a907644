"""How many tasks a recipe plans, against the mesh's cap (``max-workflow-tasks``).

``submit`` refuses a recipe whose experiments together plan more tasks than the cap
(``hypermesh/state/txns.py``), before anything is written; ``hypermesh validate`` shows
the same counts; ``extend`` refuses samples that would take a workflow past the cap
(``hypermesh/state/live.py``, ``TaskPlan.plus``). An adaptive (``sampling: tpe``)
experiment counts its budget (``samples``) like any other. Counting stops early past the
cap, so a grid of a thousand parameters costs no product of a thousand factors: above
the cap a count is only known to be above it (``TaskPlan.exact``).

Pure: the cap is passed in (the recipe language does not know the mesh's settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hypermesh.recipe.limits import MAX_SAMPLES
from hypermesh.recipe.recipe import Recipe
from hypermesh.recipe.sampling import planned_count

__all__ = ["TaskPlan", "plan_tasks"]


@dataclass(frozen=True)
class TaskPlan:
    """Tasks per experiment (file order) and the cap they were counted against.

    Each count is exact when ``exact``; otherwise the counts that passed ``limit`` are
    lower bounds (and ``over`` holds).
    """

    counts: dict[str, int]
    limit: int
    exact: bool

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def over(self) -> bool:
        return self.total > self.limit

    def describe_total(self) -> str:
        """``"1,200 tasks"``, or ``"more than 1,000,000 tasks"`` when not counted out."""
        return f"{self.total:,} tasks" if self.exact else f"more than {self.limit:,} tasks"

    def plus(self, extra: Mapping[str, int]) -> TaskPlan:
        """This plan with ``extra`` tasks added to experiments (live ``hypermesh extend``)."""
        counts = {name: count + extra.get(name, 0) for name, count in self.counts.items()}
        return TaskPlan(counts, self.limit, self.exact)

    def refusal(self, subject: str = "the recipe plans",
                remedy: str = "lower its samples or split it") -> str:
        """Why a mesh with this cap refuses the plan, and what to do about it: ``subject``
        names what plans the tasks (``submit``: the recipe; ``extend``: the workflow
        after the change), ``remedy`` the fix short of raising the cap."""
        over = ", ".join(f"{name} {count:,}" if self.exact or count <= self.limit
                         else f"{name} more than {self.limit:,}"
                         for name, count in self.counts.items())
        if self.exact and self.total <= MAX_SAMPLES:
            fix = f"raise the cap: `hypermesh settings max-workflow-tasks={self.total}`"
        else:
            fix = f"the cap goes no higher than {MAX_SAMPLES:,}"
        return (f"{subject} {self.describe_total()} ({over}), more than the mesh's "
                f"max-workflow-tasks ({self.limit:,}); {remedy}, or {fix}")

    def to_json(self) -> dict[str, Any]:
        return {"experiments": dict(self.counts), "total": self.total, "exact": self.exact,
                "max_workflow_tasks": self.limit}


def plan_tasks(recipe: Recipe, limit: int) -> TaskPlan:
    """The tasks ``recipe`` plans, counted against the cap ``limit``."""
    counts: dict[str, int] = {}
    for exp in recipe.experiments:
        counts[exp.name] = planned_count(exp, limit)
    exact = all(exp.samples is not None or counts[exp.name] <= limit
                for exp in recipe.experiments)
    return TaskPlan(counts, limit, exact)
