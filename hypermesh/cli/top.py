"""``hypermesh top``: every live node's telemetry and what its running tasks use.

The figures come from each agent's ``GetTelemetry`` RPC (the agent samples every
``--telemetry-period`` seconds); the list of nodes from etcd. A node that does not
answer within the timeout is shown with ``telemetry: null``. ``fetch_telemetry``
(``agent/ops/telemetry_client.py``) is also what ``hypermesh nodes --json`` uses for its
``telemetry`` field, and the dashboard for its nodes.
"""

from __future__ import annotations

from typing import Any

import click

from hypermesh.agent.ops.telemetry_client import fetch_telemetry
from hypermesh.cli.common import Mesh, human_size, mesh_options, print_json, run_async
from hypermesh.errors import NotFound
from hypermesh.state.records import NodeRecord
from hypermesh.state.view import MeshView


async def live_nodes(mesh: Mesh) -> dict[str, NodeRecord]:
    view = MeshView(mesh.ks)
    async with mesh.connect() as etcd:
        kvs, _ = await etcd.get_prefix(mesh.ks.nodes)
    for kv in kvs:
        view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    return view.nodes


def _print_table(rows: list[dict[str, Any]]) -> None:
    click.echo(
        f"{'NODE':<16}{'CPU%':>6}{'LOAD':>6}{'MEM':>21}{'DISK':>21}"
        f"{'NET RX/s':>11}{'NET TX/s':>11}  GPUS (util% mem temp)"
    )
    for r in rows:
        t = r["telemetry"]
        s = t["latest"] if t else None
        if s is None:
            why = "no answer" if t is None else "no sample yet"
            click.echo(f"{r['name']:<16}  ({why})")
            continue
        gpus = " ".join(
            f"[{g['index']}: {g['utilization_percent']:.0f}% "
            f"{human_size(g['memory_used_bytes'])} {g['temperature_c']:.0f}C]"
            for g in s["gpus"]
        ) or ("-" if t["nvml"] else "no NVML")
        click.echo(
            f"{r['name']:<16}{s['cpu_percent']:>6.1f}{s['load1']:>6.2f}"
            f"{human_size(s['memory_used_bytes']) + '/' + human_size(s['memory_total_bytes']):>21}"
            f"{human_size(s['disk_used_bytes']) + '/' + human_size(s['disk_total_bytes']):>21}"
            f"{human_size(s['net_recv_bytes_per_s']):>11}"
            f"{human_size(s['net_sent_bytes_per_s']):>11}"
            f"  {gpus}"
        )
    tasks = [(r["name"], u) for r in rows if r["telemetry"] for u in r["telemetry"]["tasks"]]
    if tasks:
        click.echo()
        click.echo(f"{'TASK':<40}{'ATT':>4} {'NODE':<16}{'PROCS':>6}{'CPU%':>8}{'RSS':>11}"
                   f"{'GPU MEM':>11}")
        for node, u in tasks:
            click.echo(
                f"{u['task_id']:<40}{u['attempt']:>4} {node:<16}{u['processes']:>6}"
                f"{u['cpu_percent']:>8.1f}{human_size(u['rss_bytes']):>11}"
                f"{human_size(u['gpu_memory_bytes']):>11}"
            )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--node", "only", default=None, metavar="NAME", help="Only this node.")
@click.option(
    "--history",
    type=click.IntRange(0, 100_000),
    default=0,
    show_default=True,
    help="Also this many past samples per node (--json only).",
)
@mesh_options
@run_async
async def top(mesh: Mesh, as_json: bool, only: str | None, history: int) -> None:
    """Show each node's CPU, memory, disk, network and GPUs, and what each running
    task uses (CPU, memory, GPU memory of its processes)."""
    nodes = await live_nodes(mesh)
    if only is not None:
        if only not in nodes:
            raise NotFound(f"no live node {only!r} in namespace {mesh.ks.namespace!r}")
        nodes = {only: nodes[only]}
    telemetry = await fetch_telemetry(
        {n: r.address for n, r in nodes.items()}, history, tls=mesh.tls
    )
    rows = [
        {"name": name, "address": nodes[name].address, "telemetry": telemetry[name]}
        for name in sorted(nodes)
    ]
    if as_json:
        print_json(rows)
        return
    if not rows:
        click.echo("no live nodes")
        return
    _print_table(rows)
