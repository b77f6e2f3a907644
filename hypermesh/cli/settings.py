"""``hypermesh settings``: show or change the mesh-wide settings.

They live in one etcd key (``hypermesh/state/settings.py``): the most tasks one
workflow may plan (``submit`` refuses more, exit 2) and how long the leader keeps a
finished workflow before deleting it.
"""

from __future__ import annotations

import click

from hypermesh.cli.common import Mesh, mesh_options, print_json, run_async
from hypermesh.recipe.units import format_duration
from hypermesh.state.settings import change_settings, load_settings


@click.command()
@click.argument("assignments", nargs=-1, metavar="[NAME=VALUE]...")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def settings(mesh: Mesh, assignments: tuple[str, ...], as_json: bool) -> None:
    """Show the mesh's settings, or change some: NAME=VALUE, with NAME one of

    \b
      max-workflow-tasks  tasks one workflow may plan (default 1000000)
      retention           how long a finished workflow is kept, e.g. 7d;
                          0 keeps it until `hypermesh delete` (default 7d)
      flush-rate          batches of results the mesh's nodes write a second,
                          all together (default 200): each node writes its
                          results at most every NODES/flush-rate seconds
                          (0.05 s to 10 s)
      watch-all           agents started with --watch auto that watch the
                          whole namespace; the others watch their own part
                          (default 4)
    """
    async with mesh.connect() as etcd:
        if assignments:
            current = await change_settings(etcd, mesh.ks, list(assignments))
        else:
            current, _ = await load_settings(etcd, mesh.ks)
    if as_json:
        print_json(current.to_json())
        return
    click.echo(f"max-workflow-tasks  {current.max_workflow_tasks}")
    keep = format_duration(current.retention) if current.retention else "0 (kept)"
    click.echo(f"retention           {keep}")
    click.echo(f"flush-rate          {current.flush_rate}")
    click.echo(f"watch-all           {current.watch_all}")
