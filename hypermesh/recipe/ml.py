"""The machine-learning fields of an experiment: ``objective``, ``sampling`` and ``pruning``.

``objective: {metric: val_loss, goal: minimize}`` names the metric (reported by the tasks,
see ``hypermesh.state.task_metrics``) that ranks trials; ``sampling: tpe`` lets Optuna's TPE sampler
choose each new trial's parameters from the results so far (``random``, the default, draws
them all up front); ``pruning: median`` stops a trial whose intermediate value is worse than
the median of earlier trials at the same step. ``MLChecker`` validates them with a field
path and line like every other recipe field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hypermesh.recipe.located import _describe, _Entry, _Node, _NodeChecker

GOALS = ("minimize", "maximize")
EXPERIMENT_SAMPLINGS = ("random", "tpe")
PRUNERS = ("median",)
OBJECTIVE_FIELDS = ("metric", "goal")


@dataclass(frozen=True)
class Objective:
    """The metric that ranks the trials of an experiment, and which way is better."""

    metric: str
    goal: Literal["minimize", "maximize"] = "minimize"

    def better(self, a: float, b: float) -> bool:
        """Whether value ``a`` is strictly better than ``b``."""
        return a < b if self.goal == "minimize" else a > b


def objective_from_json(data: dict[str, Any] | None) -> Objective | None:
    return None if data is None else Objective(**data)


class MLChecker(_NodeChecker):
    """Reads the ML fields of one experiment; each returns None for an absent or bad value."""

    def objective(self, node: _Node, path: str) -> Objective | None:
        spec = self.mapping(node, path, "a mapping {metric: NAME, goal: minimize|maximize}")
        if spec is None:
            return None
        self.known_fields(spec, OBJECTIVE_FIELDS, path)
        metric_entry = spec.get("metric")
        if metric_entry is None or metric_entry.node.value is None:
            self.report(node.line, f"{path}.metric", "missing required field 'metric'")
            return None
        metric = self.string(metric_entry.node, f"{path}.metric")
        goal = self.choice(spec.get("goal"), f"{path}.goal", GOALS) or "minimize"
        if metric is None:
            return None
        return Objective(metric, goal)  # type: ignore[arg-type]

    def choice(
        self, entry: _Entry | _Node | None, path: str, allowed: tuple[str, ...]
    ) -> str | None:
        node = entry.node if isinstance(entry, _Entry) else entry
        if node is None or node.value is None:
            return None
        if node.value in allowed:
            return str(node.value)
        hint = self.suggest(str(node.value), allowed) if isinstance(node.value, str) else ""
        self.at(node, path, f"must be one of {', '.join(allowed)}, got "
                f"{_describe(node.value)}{hint}")
        return None

    def search_rules(
        self,
        line: int | None,
        path: str,
        sampling: str | None,
        pruning: str | None,
        objective: Objective | None,
        samples: int | None,
        has_parameters: bool,
    ) -> None:
        """Cross-field rules: adaptive search and pruning need an objective to rank by."""
        if sampling == "tpe":
            if objective is None:
                self.report(line, f"{path}.objective", "'sampling: tpe' needs an 'objective' "
                            "(the metric it optimises)")
            if samples is None:
                self.report(line, f"{path}.samples", "'sampling: tpe' needs 'samples' "
                            "(the trial budget)")
            if not has_parameters:
                self.report(line, f"{path}.parameters", "'sampling: tpe' needs parameters "
                            "to search")
        if pruning is not None and objective is None:
            self.report(line, f"{path}.objective", "'pruning' needs an 'objective' (the metric "
                        "whose intermediate values it compares)")
