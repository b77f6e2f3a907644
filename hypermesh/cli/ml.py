"""``hypermesh best``: the best trials of a workflow by its experiments' objectives; and
the ``best`` entry ``status`` adds to an experiment that declares an objective."""

from __future__ import annotations

from typing import Any

import click

from hypermesh.cli.common import Mesh, load_view, mesh_options, print_json, run_async
from hypermesh.errors import UsageError
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


def best_command(view: MeshView, wid: str, experiment: str | None, n: int, as_json: bool) -> None:
    wf = view.workflows[wid]
    if experiment is not None:
        exps = [wf.recipe.experiment(experiment)]
        if exps[0].objective is None:
            raise UsageError(
                f"experiment {experiment!r} has no objective; declare one in the recipe: "
                "objective: {metric: NAME, goal: minimize|maximize}"
            )
    else:
        exps = [e for e in wf.recipe.experiments if e.objective is not None]
        if not exps:
            raise UsageError(f"workflow {wid} has no experiment with an objective")
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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def best(
    mesh: Mesh, workflow: str, experiment: str | None, count: int, as_json: bool
) -> None:
    """Print the best trials of a workflow by its experiments' objectives."""
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow)
    best_command(view, workflow, experiment, count, as_json)
