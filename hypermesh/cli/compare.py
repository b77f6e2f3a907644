"""``hypermesh compare``: the experiments of several workflows side by side.

A person who modified some hyperparameters and started another experiment asks what
changed and whether it helped: for each workflow and experiment, its state and task
counts, the best value of its objective (or of ``--metric``) with that trial's
parameters and curve, and the settings that differ between the recipes
(``hypermesh.recipe.diff``). Each workflow is read on its own (``load_view``), so the
rest of the namespace is never read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from hypermesh.cli.common import Mesh, aligned, load_view, mesh_options, print_json, run_async
from hypermesh.cli.ml import sparkline
from hypermesh.errors import UsageError
from hypermesh.recipe.diff import describe, differences, search_settings
from hypermesh.recipe.ml import GOALS, Objective
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.search import curve_summary, ranked, trial_row, trials_of
from hypermesh.state.view import MeshView


def compared_experiments(
    views: dict[str, MeshView], experiment: str | None
) -> list[tuple[str, Experiment]]:
    """(workflow, experiment) pairs to compare, by experiment in the order the workflows
    first name them, then by workflow in the order given: ``experiment`` of every
    workflow (a UsageError naming the workflow that has none), else each of them."""
    recipes = {wid: view.workflows[wid].recipe for wid, view in views.items()}
    own = {wid: [e.name for e in recipe.experiments] for wid, recipe in recipes.items()}
    names: list[str] = []
    for wid, mine in own.items():
        if experiment is not None and experiment not in mine:
            raise UsageError(f"workflow {wid} has no experiment {experiment!r} "
                             f"(its experiments: {', '.join(mine)})")
        names += [n for n in mine if n not in names and experiment in (None, n)]
    return [(wid, recipes[wid].experiment(name))
            for name in names for wid in recipes if name in own[wid]]


def comparison_entry(
    view: MeshView, wid: str, exp: Experiment, by: Objective | None
) -> dict[str, Any]:
    """One entry of ``compare --json``'s ``experiments``: the experiment's ``status``
    counts, the metric it is judged by (``by``, else its objective, else None) and its
    best completed trial (``{"task", "value", "params", "curve"}``, None before one)."""
    wf = view.workflows[wid]
    entry: dict[str, Any] = {"workflow": wid, "name": wf.name, "experiment": exp.name}
    entry |= view.experiment_summary(wf, exp).to_json()
    objective = by or exp.objective
    entry |= {"metric": objective.metric if objective else None,
              "goal": objective.goal if objective else None, "best": None}
    if objective is not None:
        judged = replace(exp, objective=objective)
        top = ranked(objective, trials_of(view, wid, judged))[:1]
        if top:
            row = trial_row(wid, judged, top[0], 1)
            entry["best"] = {k: row[k] for k in ("task", "value", "params", "curve")}
    return entry


def _reported(views: dict[str, MeshView], pairs: list[tuple[str, Experiment]]) -> set[str]:
    return {name for wid, exp in pairs for ref in views[wid].task_refs(wid, exp.name)
            for name in views[wid].task_metrics(ref)}


def comparison(
    views: dict[str, MeshView], experiment: str | None, by: Objective | None
) -> dict[str, Any]:
    """What ``compare --json`` prints: ``{"experiments": [entry, ...], "differences":
    [{"experiment", "field", "values": {WORKFLOW: value}}, ...]}``, the differences
    between the recipes of each experiment that several workflows have. A UsageError
    when ``by`` names a metric no compared task reported."""
    pairs = compared_experiments(views, experiment)
    if by is not None:
        reported = _reported(views, pairs)
        if by.metric not in reported:
            seen = ", ".join(sorted(reported)) or "none"
            raise UsageError(f"no task of {', '.join(views)} reported metric {by.metric!r} "
                             f"(they reported: {seen})")
    entries = [comparison_entry(views[wid], wid, exp, by) for wid, exp in pairs]
    changed = []
    for name in dict.fromkeys(exp.name for _, exp in pairs):
        settings = {wid: search_settings(exp, views[wid].workflows[wid].seed)
                    for wid, exp in pairs if exp.name == name}
        if len(settings) > 1:
            changed += [{"experiment": name, "field": field, "values": values}
                        for field, values in differences(settings).items()]
    return {"experiments": entries, "differences": changed}


def _best_cells(entry: dict[str, Any], winner: bool) -> list[str]:
    b = entry["best"]
    if entry["metric"] is None:
        return ["-", "", "", "", ""]
    if b is None:
        return [f"{entry['metric']}=-", "", "", "", ""]
    values = [v for _, v in b["curve"]]
    s = curve_summary(b["curve"], entry["goal"])
    return [f"{entry['metric']}={b['value']:.6g}" + (" *" if winner else ""), b["task"],
            sparkline(values) or "-", str(s["steps"]),
            " ".join(f"{k}={v}" for k, v in b["params"].items())]


def _winners(entries: list[dict[str, Any]]) -> set[int]:
    """Indices of the entries with the best value of their experiment, where more than one
    workflow judges it by the same metric and goal."""
    winners = set()
    for name in {e["experiment"] for e in entries}:
        judged = [(i, e) for i, e in enumerate(entries)
                  if e["experiment"] == name and e["best"] is not None]
        if len(judged) < 2 or len({(e["metric"], e["goal"]) for _, e in judged}) > 1:
            continue
        sign = -1.0 if judged[0][1]["goal"] == "maximize" else 1.0
        winners.add(min(judged, key=lambda ie: sign * ie[1]["best"]["value"])[0])
    return winners


def comparison_lines(result: dict[str, Any]) -> list[str]:
    """``compare``'s table (one line per workflow and experiment, ``*`` marking the best
    value of an experiment), then what changed between the recipes, a line per field."""
    entries = result["experiments"]
    winners = _winners(entries)
    rows = [["EXPERIMENT", "WORKFLOW", "STATE", "TOTAL", "OK", "FAIL", "CANC", "BEST", "TASK",
             "CURVE", "STEPS", "PARAMS"]]
    for i, e in enumerate(entries):
        rows.append([e["experiment"], e["workflow"], e["state"], str(e["total"]),
                     str(e["succeeded"]), str(e["failed"]), str(e["cancelled"]),
                     *_best_cells(e, i in winners)])
    lines = aligned(rows, right={3, 4, 5, 6, 10})
    if not result["differences"]:
        lines.append("the recipes differ in none of their experiments' settings")
        return lines
    lines.append("changed between the recipes:")
    changes = [[f"  {d['experiment']}.{d['field']}",
                *(f"{wid}: {describe(d['field'], v)}" for wid, v in d["values"].items())]
               for d in result["differences"]]
    width = max(len(c) for c in changes)
    return lines + aligned([c + [""] * (width - len(c)) for c in changes])


@click.command()
@click.argument("workflows", nargs=-1, required=True, metavar="WORKFLOW [WORKFLOW...]")
@click.option("--experiment", default=None, help="Only this experiment, which every "
              "workflow must have [default: each experiment of any of them].")
@click.option("--metric", default=None, metavar="NAME",
              help="Judge by this metric the tasks reported [default: each experiment's "
              "objective].")
@click.option("--goal", type=click.Choice(GOALS), default=None,
              help="With --metric: which way is better [default: minimize].")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def compare(
    mesh: Mesh, workflows: tuple[str, ...], experiment: str | None, metric: str | None,
    goal: str | None, as_json: bool,
) -> None:
    """Put the experiments of several workflows side by side: states, the best trial by
    the objective (or --metric), and the settings their recipes changed."""
    if goal is not None and metric is None:
        raise UsageError("--goal needs --metric NAME")
    twice = sorted({w for w in workflows if workflows.count(w) > 1})
    if twice:
        raise UsageError(f"workflow {', '.join(twice)} given more than once")
    by = Objective(metric, goal or "minimize") if metric else None  # type: ignore[arg-type]
    views = {}
    async with mesh.connect() as etcd:
        for wid in workflows:
            views[wid] = await load_view(etcd, mesh.ks, wid)  # NotFound: exit 1
    result = comparison(views, experiment, by)
    if as_json:
        print_json(result)
    else:
        for line in comparison_lines(result):
            click.echo(line)
