"""``hypermesh best``: the best trials of a workflow by its experiments' objectives (or by
a metric named with ``--metric``), each with the curve of that metric over the steps it
reported; and the ``best`` entry ``status`` adds to an experiment that declares an
objective.

On a terminal the trials print as a rich table per experiment, the curve a sparkline
(``sparkline``); otherwise one plain line per trial, without escape codes, for ``grep``.
rich is imported only for the table.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from itertools import groupby
from typing import Any

import click

from hypermesh.cli.common import Mesh, aligned, load_view, mesh_options, print_json, run_async
from hypermesh.errors import UsageError
from hypermesh.recipe.ml import GOALS, Objective
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.search import curve_summary, ranked, trial_row, trials_of
from hypermesh.state.view import MeshView

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
CURVE_WIDTH = 24
"""Most blocks in a sparkline: a longer curve is averaged into this many."""


def sparkline(values: Sequence[float], width: int = CURVE_WIDTH) -> str:
    """``values`` as unicode blocks, the lowest ``▁`` and the highest ``█``: one block per
    value, or past ``width`` values one per run of about equal length, averaged. A flat
    curve is a row of ``▄``; no values, an empty string."""
    if len(values) > width:
        n = len(values)
        values = [statistics.fmean(values[i * n // width:(i + 1) * n // width])
                  for i in range(width)]
    if not values:
        return ""
    low, high = min(values), max(values)
    if high == low:
        return SPARK_BLOCKS[3] * len(values)
    top = len(SPARK_BLOCKS) - 1
    return "".join(SPARK_BLOCKS[round((v - low) / (high - low) * top)] for v in values)


def best_rows(
    view: MeshView, wid: str, exp: Experiment, n: int, incomplete: bool = False
) -> list[dict[str, Any]]:
    """The ``n`` best completed trials of ``exp``, best first, as ``best --json`` prints
    them; with ``incomplete``, then every trial that did not complete (pruned, failed,
    running), by index."""
    assert exp.objective is not None
    trials = trials_of(view, wid, exp)
    top = ranked(exp.objective, trials)[:n]
    rows = [trial_row(wid, exp, t, rank) for rank, t in enumerate(top, start=1)]
    if incomplete:
        rows += [trial_row(wid, exp, t, None) for t in trials if t.state != "complete"]
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


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def plain_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``best``'s lines off a terminal: rank (or the state of a trial that did not
    complete), metric=value, task, curve, first/best/last values, steps and parameters,
    in columns as wide as their widest cell."""
    cells = []
    for r in rows:
        s = curve_summary(r["curve"], r["goal"])
        cells.append([
            str(r["rank"]) if r["rank"] is not None else r["state"],
            f"{r['metric']}={_number(r['value'])}",
            r["task"],
            sparkline([v for _, v in r["curve"]]) or "-",
            f"first={_number(s['first'])}",
            f"best={_number(s['best'])}",
            f"last={_number(s['last'])}",
            f"steps={s['steps']}",
            " ".join(f"{k}={v}" for k, v in r["params"].items()),
        ])
    return aligned(cells, right={0})


STATE_STYLES = {"pruned": "yellow", "failed": "red", "running": "cyan"}


def print_table(rows: list[dict[str, Any]]) -> None:
    """``best``'s rich table on a terminal: one per experiment, the curve a sparkline,
    trials that did not complete marked with their state."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    for (wid, name, metric, goal), group in groupby(
        rows, key=lambda r: (r["task"].rsplit(".", 2)[0], r["experiment"], r["metric"], r["goal"])
    ):
        table = Table(title=f"{wid} {name}: {metric} ({goal})", title_justify="left")
        for header in ("#", "TASK", metric, "CURVE", "FIRST", "BEST", "LAST", "STEPS", "PARAMS"):
            table.add_column(header, justify="right" if header in ("#", "STEPS") else "left")
        for r in group:
            s = curve_summary(r["curve"], goal)
            rank = (Text(str(r["rank"])) if r["rank"] is not None
                    else Text(r["state"], style=STATE_STYLES.get(r["state"], "")))
            table.add_row(
                rank, r["task"], _number(r["value"]),
                Text(sparkline([v for _, v in r["curve"]]), style="green"),
                _number(s["first"]), _number(s["best"]), _number(s["last"]), str(s["steps"]),
                " ".join(f"{k}={v}" for k, v in r["params"].items()),
            )
        console.print(table)


def best_command(
    view: MeshView, wid: str, experiment: str | None, n: int, as_json: bool,
    by: Objective | None = None, incomplete: bool = False,
) -> None:
    """Print the best trials; ``by``: rank by this metric instead of the objectives;
    ``incomplete``: then the trials that did not complete."""
    wf = view.workflows[wid]
    chosen = [wf.recipe.experiment(experiment)] if experiment else list(wf.recipe.experiments)
    if by is not None:
        exps = [replace(e, objective=by) for e in chosen]
    else:
        exps = [e for e in chosen if e.objective is not None]
        if not exps:
            raise _no_objective(view, wid, experiment)
    rows = [row for exp in exps for row in best_rows(view, wid, exp, n, incomplete)]
    if as_json:
        print_json(rows)
    elif not rows:
        click.echo("no completed trials yet")
    elif sys.stdout.isatty():
        print_table(rows)
    else:
        for line in plain_lines(rows):
            click.echo(line)


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
@click.option("--incomplete", is_flag=True,
              help="Then the trials that did not complete: pruned, failed, running.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def best(
    mesh: Mesh, workflow: str, experiment: str | None, count: int, metric: str | None,
    goal: str | None, incomplete: bool, as_json: bool,
) -> None:
    """Print the best trials of a workflow by its experiments' objectives, or by a metric
    the tasks reported (--metric), each with its curve over the reported steps."""
    if goal is not None and metric is None:
        raise UsageError("--goal needs --metric NAME")
    by = Objective(metric, goal or "minimize") if metric else None  # type: ignore[arg-type]
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow)
    best_command(view, workflow, experiment, count, as_json, by, incomplete)
