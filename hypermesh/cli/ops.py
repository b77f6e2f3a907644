"""Commands that change a running workflow: ``retry``, ``scale``, ``extend``.

Each is one guarded etcd transaction (see ``hypermesh/state/live.py``); the leader and
the claimers pick the change up through their watch. ``cancel --experiment``
lives with ``cancel`` in ``workflows.py``.
"""

from __future__ import annotations

import click

from hypermesh.cli.common import Mesh, err, mesh_options, print_json, run_async
from hypermesh.errors import UsageError


def _parse_workers(value: str) -> int | None:
    if value.lower() in ("none", "unlimited"):
        return None
    try:
        workers = int(value)
    except ValueError:
        workers = -1
    if workers < 0:
        raise UsageError(f"--workers: expected a count of 0 or more or 'none', not {value!r}")
    return workers


@click.command()
@click.argument("workflow")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def retry(mesh: Mesh, workflow: str, as_json: bool) -> None:
    """Run a workflow's failed tasks again (new attempts; the failed ones stay in history)."""
    from hypermesh.state.live import retry_failed

    async with mesh.connect() as etcd:
        retried = await retry_failed(etcd, mesh.ks, workflow)
    if as_json:
        print_json({"workflow": workflow, "retried": retried})
    elif retried:
        err(f"{workflow}: {len(retried)} failed task(s) will run again")
        for task_id in retried:
            click.echo(task_id)
    else:
        err(f"{workflow}: no failed tasks")


@click.command()
@click.argument("workflow")
@click.argument("experiment")
@click.option(
    "--workers",
    required=True,
    metavar="N|none",
    help="New cap on the experiment's tasks running at once (0: start no more; none: no cap).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def scale(mesh: Mesh, workflow: str, experiment: str, workers: str, as_json: bool) -> None:
    """Change a running experiment's workers cap (its most tasks running at once)."""
    from hypermesh.state.live import scale_experiment

    cap = _parse_workers(workers)
    async with mesh.connect() as etcd:
        before = await scale_experiment(etcd, mesh.ks, workflow, experiment, cap)
    if as_json:
        print_json(
            {"workflow": workflow, "experiment": experiment, "workers": cap, "previous": before}
        )
    else:
        err(f"{workflow} {experiment}: workers {before} -> {cap}")


@click.command()
@click.argument("workflow")
@click.argument("experiment")
@click.option("--samples", type=int, required=True, help="How many tasks to add (1 or more).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def extend(mesh: Mesh, workflow: str, experiment: str, samples: int, as_json: bool) -> None:
    """Add samples (tasks) to an experiment that has not been followed by its dependents."""
    from hypermesh.state.live import extend_experiment

    async with mesh.connect() as etcd:
        total = await extend_experiment(etcd, mesh.ks, workflow, experiment, samples)
    if as_json:
        print_json(
            {"workflow": workflow, "experiment": experiment, "added": samples, "total": total}
        )
    else:
        err(f"{workflow} {experiment}: {samples} task(s) added, {total} in all")


OPS_COMMANDS: list[click.Command] = [retry, scale, extend]
