"""The workflow commands: ``submit``, ``status``, ``tasks``, ``logs`` and ``cancel``.

``submit`` writes a recipe's workflow into etcd; the others read a workflow's records
back (``status`` and ``tasks``), its tasks' output (``logs``), or stop it (``cancel``).
``submit --wait`` and ``status --watch`` follow a workflow through the summary its
leader publishes (``_follow``). Changing a running workflow (``retry``, ``scale``,
``extend``) is in ``ops.py``; its best trials (``best``) in ``ml.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import click

from hypermesh.cli.burst import unknown_pools, workflow_costs
from hypermesh.cli.cleanup import note_quota, quota_warning_of
from hypermesh.cli.common import (
    Mesh,
    aligned,
    err,
    listed_total,
    load_view,
    mesh_options,
    override_option,
    print_json,
    run_async,
    task_rows,
)
from hypermesh.cli.ml import add_best, print_best_line
from hypermesh.errors import NotFound, UsageError
from hypermesh.recipe.recipe import Recipe
from hypermesh.state.etcd import Etcd
from hypermesh.state.fit import unmet_needs
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import TERMINAL, WorkflowRecord
from hypermesh.state.view import MeshView


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--name", default=None, help="Workflow name [default: recipe's name or file stem].")
@override_option
@click.option("--seed", type=int, default=None, help="Seed for parameter sampling.")
@click.option("--wait", is_flag=True, help="Show progress; exit 0 if all tasks succeed, else 1.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print {"workflow", "name", "seed", "experiments", "state"} instead of the id.',
)
@mesh_options
@run_async
async def submit(
    mesh: Mesh,
    recipe: Path,
    name: str | None,
    overrides: tuple[str, ...],
    seed: int | None,
    wait: bool,
    as_json: bool,
) -> None:
    """Submit a recipe; print the workflow id as the last word on stdout."""
    from hypermesh.recipe.recipe import load_recipe
    from hypermesh.state.txns import new_workflow_id, submit_workflow

    parsed = load_recipe(recipe, overrides)
    base = recipe.resolve().parent
    workdir = (base / parsed.workdir).resolve() if parsed.workdir else base
    seed = seed if seed is not None else parsed.seed
    if seed is None:
        seed = secrets.randbelow(2**31)
    wf_name = name or parsed.name or recipe.stem
    wf = WorkflowRecord(
        id=new_workflow_id(wf_name),
        name=wf_name,
        recipe=parsed,
        seed=seed,
        submitted_at=time.time(),
        workdir=str(workdir),
        source=str(recipe),
    )
    async with mesh.connect() as etcd:
        for warning in await _submit_warnings(etcd, mesh.ks, parsed):
            err(f"warning: {warning}")
        await submit_workflow(etcd, mesh.ks, wf)
        err(f"submitted {wf.id}: {len(parsed.experiments)} experiment(s), seed {seed}")
        if not wait:
            _submitted(wf, "pending", as_json)
            return
        state = await _follow(etcd, mesh.ks, wf.id)
    _submitted(wf, state, as_json)
    sys.exit(0 if state == "succeeded" else 1)


async def _submit_warnings(etcd: Etcd, ks: Keyspace, recipe: Recipe) -> list[str]:
    """What ``submit`` warns of (the workflow is submitted all the same: nodes may join,
    a pool's bursting may start them): pools nobody declared or is in, and experiments
    that no live node may run, with the need none meets."""
    warnings = await unknown_pools(etcd, ks, recipe)
    view = MeshView(ks)
    for kv in (await etcd.get_prefix(ks.nodes))[0]:
        view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    for exp in recipe.experiments:
        said = f"experiment {exp.name!r}:"
        reason = unmet_needs(exp, view.nodes.values())
        if reason is not None and not any(w.startswith(said) for w in warnings):
            warnings.append(f"{said} {reason}; its tasks wait until such a node joins")
    return warnings


def _submitted(wf: WorkflowRecord, state: str, as_json: bool) -> None:
    """What ``submit`` prints on stdout: the workflow id, or with ``--json`` an object."""
    if not as_json:
        click.echo(wf.id)
        return
    experiments = [e.name for e in wf.recipe.experiments]
    print_json(
        {"workflow": wf.id, "name": wf.name, "seed": wf.seed, "experiments": experiments,
         "state": state}
    )


async def _follow(etcd: Etcd, ks: Keyspace, wid: str, as_json: bool = False) -> str:
    """Show a workflow's progress until it ends; return its final state. On stderr
    (bars or lines), or with ``as_json`` as one status object per change on stdout.

    What is shown is the summary the leader publishes (``progress/<wid>``, about once
    a second while the workflow runs, and with its final state), so following a
    workflow costs the same whatever its size: the CLI watches three keys, not every
    task's records. A workflow that ended without a final summary (cancelled from the
    CLI, or run by an older leader) is summarized from its records once, at the end."""
    from hypermesh.cli.progress import ProgressDisplay

    view = MeshView(ks)
    changed = asyncio.Event()

    def on_batch(revision: int) -> None:
        changed.set()

    keys = [ks.workflow(wid), ks.workflow_state(wid), ks.progress(wid)]
    ranges = [(key, key + "\0") for key in keys]  # these keys alone: etcd sends no other
    mirrors = [asyncio.create_task(etcd.mirror(ks.root, view.apply, on_batch, ranges=ranges))]
    display = None if as_json else ProgressDisplay(wid)
    last: dict[str, Any] | None = None
    try:
        while True:
            await changed.wait()
            changed.clear()
            if wid not in view.workflows:  # it was there when following began
                raise NotFound(f"workflow {wid} was deleted (hypermesh delete, or retention)")
            summary = _followed_summary(view, wid)
            final = view.progress.get(wid, {}).get("state")
            if summary["state"] in TERMINAL and summary["state"] != final:
                # Ended without the leader's final summary: summarize the records once.
                summary = (await load_view(etcd, ks, wid, fold=True)).workflow_summary(wid)
            if display is not None:
                display.update(summary)
            elif summary != last:
                click.echo(json.dumps(summary, separators=(",", ":")))
                last = summary
            if summary["state"] in TERMINAL:
                if display is not None:
                    display.close(summary)
                return str(summary["state"])
            await asyncio.sleep(0.1)
    finally:
        for mirror in mirrors:
            mirror.cancel()
        if display is not None:
            display.close(None)


def _followed_summary(view: MeshView, wid: str) -> dict[str, Any]:
    """The leader's last published summary of ``wid``, with the state as the state key
    says now; before the first one, the summary of the workflow record alone."""
    published = view.progress.get(wid)
    if published is None:
        return view.workflow_summary(wid)
    state = view.workflow_state(wid)
    return published if state not in TERMINAL else published | {"state": state}


@click.command()
@click.argument("workflow", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--watch",
    is_flag=True,
    help="Live progress until the workflow ends (with --json: one object per change); "
    "exit 0 if it succeeded, else 1.",
)
@mesh_options
@run_async
async def status(mesh: Mesh, workflow: str | None, as_json: bool, watch: bool) -> None:
    """Show a workflow's state per experiment and its cost so far (all workflows if none
    is named)."""
    if watch:
        if not workflow:
            raise UsageError("status --watch needs a WORKFLOW")
        async with mesh.connect() as etcd:
            await load_view(etcd, mesh.ks, workflow, fold=True)  # NotFound for a wrong id
            state = await _follow(etcd, mesh.ks, workflow, as_json)
        sys.exit(0 if state == "succeeded" else 1)
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow, fold=True)
        ids = (
            [workflow]
            if workflow
            else sorted(view.workflows, key=lambda w: view.workflows[w].submitted_at)
        )
        costs = await workflow_costs(etcd, mesh.ks, ids)
        near_quota = await quota_warning_of(etcd)
    summaries = [view.workflow_summary(w) | {"cost": costs[w]} for w in ids]
    add_best(view, summaries)
    note_quota(near_quota, summaries, as_json)
    if as_json:
        print_json(summaries[0] if workflow else summaries)
        return
    if not summaries:
        click.echo("no workflows")
    for s in summaries:
        click.echo(f"{s['id']}  {s['name']}  {s['state']}")
        if "reason" in s:  # the leader failed it itself: its planning raised
            click.echo(f"  reason: {s['reason']}")
        counts = ("total", "pending", "running", "succeeded", "failed", "cancelled")
        header, *lines = aligned(
            [["EXPERIMENT", "STATE", "TOTAL", "PEND", "RUN", "OK", "FAIL", "CANC"]]
            + [[name, e["state"], *(str(e[k]) for k in counts)]
               for name, e in s["experiments"].items()],
            right=range(2, 8),
        )
        click.echo(f"  {header}")
        for line, (name, e) in zip(lines, s["experiments"].items(), strict=True):
            click.echo(f"  {line}")
            print_best_line(name, e)
            if "waiting" in e:
                click.echo(f"    {e['waiting']}")
        c = s["cost"]
        if not c["pools"]:  # nothing recorded: "cost 0 for 0 node-s" would read as a fact
            click.echo("  cost: none recorded (the leader records node-seconds while pools "
                       "are declared, see 'hypermesh pool set')")
        else:
            click.echo(f"  cost {c['cost']:.4f} for {c['node_seconds']:.0f} node-s "
                       f"(on-demand: {c['on_demand_cost']:.4f})")


@click.command()
@click.argument("workflow")
@click.option("--experiment", default=None, help="Only tasks of this experiment.")
@click.option(
    "--state",
    "state_filter",
    default=None,
    type=click.Choice(["pending", "running", "succeeded", "failed", "cancelled"]),
    help="Only tasks in this state.",
)
@click.option("--limit", type=click.IntRange(min=0), default=0, metavar="N",
              help="List at most N tasks, the first in id order (0: all) [default: 0].")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def tasks(
    mesh: Mesh, workflow: str, experiment: str | None, state_filter: str | None, limit: int,
    as_json: bool,
) -> None:
    """List a workflow's tasks with their parameters and attempts.

    A pending task that cannot start says why on the line below it (no live node has
    gpu k80, ...).
    """
    shown, more = 0, False
    async with mesh.connect() as etcd:
        async with contextlib.aclosing(task_rows(etcd, mesh.ks, workflow, experiment)) as rows:
            async for r in rows:
                if state_filter and r["state"] != state_filter:
                    continue
                if limit and shown == limit:
                    more = True  # read no further
                    break
                _print_task(r, as_json, shown == 0)
                shown += 1
        if more and not state_filter:
            left = await listed_total(etcd, mesh.ks, workflow, experiment) - limit
            err(f"note: {max(left, 1)} more task(s) not listed (--limit {limit})")
        elif more:
            err(f"note: more {state_filter} tasks not listed (--limit {limit})")
    if as_json:
        click.echo("\n]" if shown else "[]")


def _print_task(r: dict[str, Any], as_json: bool, first: bool) -> None:
    """One row of ``tasks``: a line (and the reason a pending task waits), or with
    ``as_json`` an element of the array, printed as ``print_json`` prints the whole."""
    out = sys.stdout  # written, not echoed: click.echo flushes each line (a quarter slower)
    if as_json:
        element = json.dumps(r, indent=2).replace("\n", "\n  ")
        out.write(("[\n  " if first else ",\n  ") + element)
        return
    last = r["attempts"][-1] if r["attempts"] else {}
    params = " ".join(f"{k}={v}" for k, v in r["params"].items())
    out.write(
        f"{r['id']:<40} {r['state']:<10} {r['node'] or '-':<14} "
        f"attempts={len(r['attempts'])} exit={last.get('exit_code', '-')} {params}".rstrip()
        + "\n"
    )
    if "waiting" in r:
        out.write(f"  {r['waiting']}\n")


@click.command()
@click.argument("task_id")
@click.option("--attempt", type=int, default=0, help="Attempt number [default: the latest].")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the attempt ends.")
@click.option(
    "--store",
    default=None,
    metavar="URL",
    help="Object store holding copies of logs, read when the node is gone [env HYPERMESH_STORE].",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One {"task", "attempt", "text"} object (per chunk with --follow, one per line).',
)
@mesh_options
@run_async
async def logs(
    mesh: Mesh, task_id: str, attempt: int, follow: bool, store: str | None, as_json: bool
) -> None:
    """Print a task attempt's output (stdout and stderr), from its node or the stored copy."""
    from hypermesh.agent.tasks.logs import locate_attempt, stream_log

    try:
        ref = TaskRef.parse(task_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    async with mesh.connect() as etcd:
        n = (await locate_attempt(etcd, mesh.ks, ref, attempt))[0]
        chunks = stream_log(etcd, mesh.ks, ref, n, follow, store, lambda m: err(f"note: {m}"),
                            tls=mesh.tls)
        if not as_json:
            async for data in chunks:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            return
        text = []
        async for data in chunks:
            text.append(data.decode("utf-8", errors="replace"))
            if follow:
                click.echo(json.dumps({"task": ref.id, "attempt": n, "text": text.pop()}))
        if not follow:
            print_json({"task": ref.id, "attempt": n, "text": "".join(text)})


@click.command()
@click.argument("workflow")
@click.option(
    "--experiment", default=None, help="Cancel only this experiment (and what comes after it)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def cancel(mesh: Mesh, workflow: str, experiment: str | None, as_json: bool) -> None:
    """Cancel a workflow: nothing new starts and running tasks are stopped."""
    from hypermesh.state.live import cancel_experiment
    from hypermesh.state.txns import cancel_workflow

    async with mesh.connect() as etcd:
        if experiment is None:
            state, changed = await cancel_workflow(etcd, mesh.ks, workflow)
        else:
            changed = await cancel_experiment(etcd, mesh.ks, workflow, experiment)
            state = "cancelled"
    what = f"{workflow} experiment {experiment}" if experiment else workflow
    if as_json:
        print_json(
            {"workflow": workflow, "experiment": experiment, "state": state, "changed": changed}
        )
    elif changed:
        err(f"{what} cancelled; running tasks are being stopped")
    else:
        err(f"{what} had already ended: {state}")
