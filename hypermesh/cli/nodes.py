"""``hypermesh nodes``: the live nodes of the mesh, as etcd lists them and gossip sees them.

The list of nodes, the leader and the running claims come from etcd; the gossip
columns (state, incarnation, load) from one agent's ``GetMembers`` RPC (the
leader's, or ``--via NODE``); the ``telemetry`` of ``--json`` from each node's
``GetTelemetry`` (as ``hypermesh top`` shows it). The rows themselves are built by
``hypermesh/state/node_rows.py``.
"""

from __future__ import annotations

from typing import Any

import click
import grpc

from hypermesh.agent.ops.telemetry_client import fetch_telemetry
from hypermesh.channels import agent_channel
from hypermesh.cli.cleanup import note_quota, quota_warning_of
from hypermesh.cli.common import Mesh, mesh_options, print_json, run_async
from hypermesh.errors import NotFound
from hypermesh.state.view import MeshView
from hypermesh.tls import TlsFiles


async def gossip_view(address: str, tls: TlsFiles | None = None) -> dict[str, dict[str, Any]]:
    """The gossip member table as the agent at ``address`` sees it ({} if it does not answer)."""
    from hypermesh._proto import agent_pb2, agent_pb2_grpc
    from hypermesh.state.node_rows import gossip_table

    async with agent_channel(address, tls) as channel:
        try:
            reply = await agent_pb2_grpc.AgentStub(channel).GetMembers(
                agent_pb2.GetMembersRequest(), timeout=3
            )
        except grpc.aio.AioRpcError:
            return {}
    return gossip_table(reply)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--via", default=None, metavar="NODE",
              help="Whose gossip view to show [default: the leader's].")
@click.option("--all", "show_all", is_flag=True,
              help="Also members that gossip knows but etcd no longer lists (dead, left).")
@mesh_options
@run_async
async def nodes(mesh: Mesh, as_json: bool, via: str | None, show_all: bool) -> None:
    """List the live nodes of the mesh; the leader is marked.

    Gossip columns (state, incarnation, load) are as one agent sees them: the
    leader, or the node named by --via.

    HITS C/P/S % is where the node's data mounts got the blocks they read, in whole
    percent: its own chunk cache (C), a peer's cache (P), the object store (S);
    - before any read.
    """
    from hypermesh.state.node_rows import node_rows

    ks = mesh.ks
    view = MeshView(ks)
    async with mesh.connect() as etcd:
        for prefix in (ks.nodes, ks.election, ks.kind_prefix("claim")):
            kvs, _ = await etcd.get_prefix(prefix)
            for kv in kvs:
                view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
        near_quota = await quota_warning_of(etcd)
    leader = view.leader()
    asked = via or leader or (min(view.nodes) if view.nodes else None)
    if via and via not in view.nodes:
        raise NotFound(f"no live node {via!r} in namespace {ks.namespace!r}")
    gossip = await gossip_view(view.nodes[asked].address, mesh.tls) if asked else {}
    telemetry = await fetch_telemetry(
        {n.name: n.address for n in view.nodes.values()}, tls=mesh.tls
    )
    rows = node_rows(view, gossip, asked, show_all)
    for row in rows:
        sample = telemetry.get(row["name"]) if row["address"] else None
        row["telemetry"] = (sample or {}).get("latest")
    note_quota(near_quota, rows, as_json)
    if as_json:
        print_json(rows)
        return
    click.echo(
        f"{'NAME':<16}{'ADDRESS':<22}{'STATE':<10}{'GOSSIP':<9}{'INC':>4}{'POOL':>10}"
        f"{'SLOTS':>6}{'RUN':>5}{'GPUS':>5}{'HITS C/P/S %':>14}  LEADER"
    )
    for r in rows:
        click.echo(
            f"{r['name']:<16}{r['address'] or '-':<22}{r['state']:<10}{r['gossip'] or '-':<9}"
            f"{r['incarnation'] if r['incarnation'] is not None else '-':>4}"
            f"{r['pool'] or '-':>10}{r['slots'] if r['slots'] is not None else '-':>6}"
            f"{r['running']:>5}{r['gpus'] if r['gpus'] is not None else '-':>5}"
            f"{_hits(r['hit_rates']):>14}  {'*' if r['leader'] else ''}"
        )
    if rows and gossip:
        click.echo(f"(gossip as seen by {asked})")


def _hits(rates: dict[str, float] | None) -> str:
    """Hit rates as ``cache/peer/store`` whole percentages, ``-`` before any read."""
    if not rates:
        return "-"
    return "/".join(f"{100 * rates.get(s, 0.0):.0f}" for s in ("cache", "peer", "store"))
