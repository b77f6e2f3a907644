"""``hypermesh best``: the best trials of a workflow by its experiments' objectives (or by
a metric named with ``--metric``); and the ``best`` entry ``status`` adds to an experiment
that declares an objective."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from hypermesh.cli.common import Mesh, load_view, mesh_options, print_json, run_async
from hypermesh.errors import UsageError
from hypermesh.recipe.ml import GOALS, Objective
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.search import ranked, trials_of
from hypermesh.state.view import MeshView


def best_rows(view: MeshView, wid: str, exp: Experiment, n: int) -> list[dict[str, Any]]:
    """The ``n`` best completed trials of ``exp``, best first, as ``best --json`` prints them."""
    assert exp.objective is not None
    rows = []
    for rank, t in enumerate(ranked(exp.objective, trials_of(view, wid, exp))[:n], start=1):
        rows.append(
            {
                "rank": rank,
                "task": f"{wid}.{exp.name}.{t.index}",
                "experiment": exp.name,
                "metric": exp.objective.metric,
                "goal": exp.objective.goal,
                "value": t.value,
                "params": t.params,
            }
        )
    return rows


def add_best(view: MeshView, summaries: list[dict[str, Any]]) -> None:
    """Add ``best`` ({task, value, params}, or None before any trial completed) to each
    experiment with an ``objective`` in ``status`` summaries."""
    for s in summaries:
        wf = view.workflows[s["id"]]
        for exp in wf.recipe.experiments:
            if exp.objective is not None:
                top = best_rows(view, wf.id, exp, 1)
                s["experiments"][exp.name]["best"] = (
                    {k: top[0][k] for k in ("task", "metric", "value", "params")} if top else None
                )


def print_best_line(name: str, e: dict[str, Any]) -> None:
    if e.get("best"):
        b = e["best"]
        params = " ".join(f"{k}={v}" for k, v in b["params"].items())
        click.echo(f"    best {b['metric']}={b['value']:.6g}  {b['task']}  {params}")


def _no_objective(view: MeshView, wid: str, experiment: str | None) -> UsageError:
    """Why ``best`` cannot rank without ``--metric``, and the two ways out: the metrics
    the tasks reported, or an objective in the recipe."""
    what = f"experiment {experiment!r}" if experiment else f"workflow {wid}"
    has = "has no objective" if experiment else "has no experiment with an objective"
    reported = sorted({k for ref in view.task_refs(wid, experiment)
                       for k in view.task_metrics(ref)})
    if reported:
        seen = f"its tasks reported: {', '.join(reported)}"
    else:
        seen = ('its tasks reported no metrics yet; a task reports one with a line '
                'HM_METRIC {"NAME": VALUE}')
    return UsageError(
        f"{what} {has}: rank by a metric with --metric NAME [--goal maximize] ({seen}), "
        "or declare one in the recipe: objective: {metric: NAME, goal: minimize|maximize}"
    )


def best_command(
    view: MeshView, wid: str, experiment: str | None, n: int, as_json: bool,
    by: Objective | None = None,
) -> None:
    """Print the best trials; ``by``: rank by this metric instead of the objectives."""
    wf = view.workflows[wid]
    chosen = [wf.recipe.experiment(experiment)] if experiment else list(wf.recipe.experiments)
    if by is not None:
        exps = [replace(e, objective=by) for e in chosen]
    else:
        exps = [e for e in chosen if e.objective is not None]
        if not exps:
            raise _no_objective(view, wid, experiment)
    rows = [row for exp in exps for row in best_rows(view, wid, exp, n)]
    if as_json:
        print_json(rows)
        return
    if not rows:
        click.echo("no completed trials yet")
    for r in rows:
        params = " ".join(f"{k}={v}" for k, v in r["params"].items())
        click.echo(f"{r['rank']:>3}  {r['metric']}={r['value']:<12.6g} {r['task']:<40} {params}")


@click.command()
@click.argument("workflow")
@click.option("--experiment", default=None, help="Only this experiment [default: each with "
              "an objective].")
@click.option("-n", "count", type=click.IntRange(min=1), default=5, show_default=True,
              help="How many trials per experiment.")
@click.option("--metric", default=None, metavar="NAME",
              help="Rank by this metric the tasks reported [default: each experiment's "
              "objective].")
@click.option("--goal", type=click.Choice(GOALS), default=None,
              help="With --metric: which way is better [default: minimize].")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def best(
    mesh: Mesh, workflow: str, experiment: str | None, count: int, metric: str | None,
    goal: str | None, as_json: bool,
) -> None:
    """Print the best trials of a workflow by its experiments' objectives, or by a metric
    the tasks reported (--metric)."""
    if goal is not None and metric is None:
        raise UsageError("--goal needs --metric NAME")
    by = Objective(metric, goal or "minimize") if metric else None  # type: ignore[arg-type]
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow)
    best_command(view, workflow, experiment, count, as_json, by)
