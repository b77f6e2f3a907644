"""What the dashboard's trials view shows of an experiment: its trials with their
parameters, last metric values and state (pruned and failed included), ranked by the
objective, and the objective's curve per trial.

The rows are ``hypermesh best --json --incomplete`` rows (``trial_row`` over
``trials_of`` and ``ranked``, the same functions), so the page and the CLI agree on
every value, rank and curve; each row adds the trial's ``index`` and the last value of
every metric it reported. An experiment without an ``objective`` is ranked by a metric
its tasks reported (``best --metric``), the first by name unless the page names one.

Bounded whatever the experiment's size: at most ``MAX_ROWS`` trials (the ranked ones
first), curves for the first ``MAX_CURVES`` of them, each at most ``CURVE_POINTS``
points. Pure: reads a ``MeshView``; no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypermesh.recipe.ml import GOALS, Objective
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.search import ranked, trial_row, trials_of
from hypermesh.state.view import MeshView

MAX_ROWS = 1000  # trials listed: about 200 bytes each, the page asks every few seconds
MAX_CURVES = 50  # trials whose curves come along (the best first): what one chart can show
CURVE_POINTS = 100  # points per curve; a task keeps at most 100 per metric (MAX_HISTORY)


class TrialsError(ValueError):
    """A request with a goal that is neither ``minimize`` nor ``maximize``."""


def downsample(curve: list[list[float]], points: int = CURVE_POINTS) -> list[list[float]]:
    """At most ``points`` (at least 2) of ``curve``'s ``[step, value]`` points, evenly
    spaced by position, the first and the last always kept."""
    n = len(curve)
    if n <= points:
        return curve
    return [curve[round(i * (n - 1) / (points - 1))] for i in range(points)]


def reported_metrics(view: MeshView, refs: list[TaskRef]) -> list[str]:
    """The names of the metrics these tasks reported, sorted."""
    return sorted({name for ref in refs for name in view.task_metrics(ref)})


def experiments_with_metrics(view: MeshView, wid: str) -> list[dict[str, Any]]:
    """The workflow's experiments that declare an objective or whose tasks reported a
    metric: ``{"name", "objective": {"metric", "goal"} | None, "metrics": [...]}``."""
    out = []
    for exp in view.workflows[wid].recipe.experiments:
        names = reported_metrics(view, view.task_refs(wid, exp.name))
        if names or exp.objective is not None:
            objective = exp.objective
            out.append({
                "name": exp.name,
                "objective": ({"metric": objective.metric, "goal": objective.goal}
                              if objective else None),
                "metrics": names,
            })
    return out


def _objective(exp: Experiment, metrics: list[str], metric: str | None,
               goal: str | None) -> Objective | None:
    """What ranks the trials: the named metric (``goal`` or minimize), else the declared
    objective, else the first reported metric; None when there is nothing to rank by."""
    if goal is not None and goal not in GOALS:
        raise TrialsError(f"goal must be one of {', '.join(GOALS)}, got {goal!r}")
    if metric:
        declared = exp.objective if exp.objective and exp.objective.metric == metric else None
        return Objective(metric, goal or (declared.goal if declared else "minimize"))  # type: ignore[arg-type]
    if exp.objective is not None:
        return exp.objective
    if metrics:
        return Objective(metrics[0], goal or "minimize")  # type: ignore[arg-type]
    return None


def experiment_trials(
    view: MeshView, wid: str, name: str | None = None, metric: str | None = None,
    goal: str | None = None,
) -> dict[str, Any]:
    """The trials view of experiment ``name`` of workflow ``wid`` (default: the first
    with an objective, else the first with metrics): the experiments to choose from, the
    objective it is ranked by, the parameter and metric names, and the trials' rows."""
    wf = view.workflows[wid]
    choices = experiments_with_metrics(view, wid)
    out: dict[str, Any] = {"workflow": wid, "experiments": choices, "experiment": None,
                           "trials": []}
    if name is None:
        declared = [c["name"] for c in choices if c["objective"]]
        name = (declared or [c["name"] for c in choices] or [None])[0]
        if name is None:
            return out
    exp = wf.recipe.experiment(name)  # NotFound for an experiment it does not have
    refs = view.task_refs(wid, exp.name)
    metrics = reported_metrics(view, refs)
    objective = _objective(exp, metrics, metric, goal)
    params = [p.name for p in exp.parameters]
    out |= {"experiment": exp.name, "metrics": metrics, "params": params,
            "objective": None, "declared": exp.objective is not None}
    if objective is None:
        return out
    exp = replace(exp, objective=objective)
    trials = trials_of(view, wid, exp)
    order = ranked(objective, trials)
    rank = {t.index: n for n, t in enumerate(order, start=1)}
    shown = order + [t for t in trials if t.index not in rank]
    rows = []
    for n, t in enumerate(shown[:MAX_ROWS]):
        row = trial_row(wid, exp, t, rank.get(t.index))
        row["index"] = t.index
        row["metrics"] = view.task_metrics(TaskRef(wid, exp.name, t.index))
        row["curve"] = downsample(row["curve"]) if n < MAX_CURVES else None
        for extra in row["params"]:
            if extra not in params:
                params.append(extra)  # a parameter set live, outside the recipe's space
        rows.append(row)
    out |= {"objective": {"metric": objective.metric, "goal": objective.goal},
            "total": len(trials), "trials": rows,
            "states": {s: sum(t.state == s for t in trials)
                       for s in ("complete", "pruned", "failed", "running")}}
    return out
