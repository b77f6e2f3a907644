"""``hypermesh pool`` and ``hypermesh events``: the mesh's pools and the leader's
burst decisions, plus the cost figures that ``hypermesh status`` shows.

Pools are declared in etcd (``pool/<name>``); the leader reads them on every
tick, so a change applies within a tick. Exit codes as for the rest of the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from hypermesh.cli.common import Mesh, mesh_options, print_json, run_async
from hypermesh.errors import HypermeshError, NotFound, UsageError
from hypermesh.recipe.recipe import Recipe
from hypermesh.recipe.units import UnitError, parse_duration
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.pools import KINDS, Pool, parse_pools, usage_cost
from hypermesh.state.records import dumps
from hypermesh.state.view import MeshView


@click.group()
def pool() -> None:
    """Declare and list the mesh's pools (static machines and provisioners)."""


def _options(items: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--option {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


@pool.command("set")
@click.argument("name")
@click.option("--kind", default="static", show_default=True,
              help=f"Where nodes come from: {' | '.join(KINDS)}.")
@click.option("--price", type=float, default=0.0, show_default=True,
              help="On-demand price of one node per hour.")
@click.option("--spot-price", type=float, default=None,
              help="Price of one spot node per hour [default: --price].")
@click.option("--spot/--on-demand", default=False, show_default=True,
              help="Ask for spot nodes first (on-demand is the fallback).")
@click.option("--min", "min_nodes", type=int, default=0, show_default=True,
              help="Never release below this many nodes.")
@click.option("--max", "max_nodes", type=int, default=0, show_default=True,
              help="Never run more nodes (running plus starting) than this.")
@click.option("--idle-timeout", default="5m", show_default=True,
              help="Release a provisioned node idle this long (e.g. 90s, 5m).")
@click.option("--slots", type=int, default=1, show_default=True,
              help="Tasks each provisioned node runs at once.")
@click.option("--gpus", type=int, default=0, show_default=True,
              help="GPUs of each provisioned node.")
@click.option("--gpu-type", default="", help="GPU type of each provisioned node.")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Provisioner setting (repeatable), e.g. region=eu-west-1.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the declaration written, with whether it replaced one.")
@mesh_options
@run_async
async def pool_set(mesh: Mesh, name: str, kind: str, price: float, spot_price: float | None,
                   spot: bool, min_nodes: int, max_nodes: int, idle_timeout: str, slots: int,
                   gpus: int, gpu_type: str, options: tuple[str, ...], as_json: bool) -> None:
    """Declare pool NAME (replacing its previous declaration)."""
    try:
        idle = parse_duration(idle_timeout)
    except UnitError as exc:
        raise UsageError(f"--idle-timeout {idle_timeout!r}: {exc}") from exc
    declared = Pool(
        name=name, kind=kind, price=price, spot_price=spot_price, spot=spot,
        min_nodes=min_nodes, max_nodes=max_nodes, idle_timeout=idle, slots=slots, gpus=gpus,
        gpu_type=gpu_type, options=_options(options),
    )
    if declared.kind == "ec2" and not (
        declared.options.get("launch_template") or declared.options.get("image_id")
    ):
        raise UsageError("an ec2 pool needs --option launch_template=ID or --option image_id=AMI")
    ca_dir = declared.options.get("ca_dir")
    if ca_dir and not all((Path(ca_dir) / f).is_file() for f in ("ca.pem", "ca-key.pem")):
        raise UsageError(f"--option ca_dir={ca_dir}: no ca.pem and ca-key.pem there (the "
                         f"local pool's nodes run on this machine); `hypermesh tls init "
                         f"{ca_dir}` makes them")
    async with mesh.connect() as etcd:
        replaced = await etcd.get(mesh.ks.pool(name)) is not None
        await etcd.put(mesh.ks.pool(name), dumps(declared.to_json()))
    if as_json:
        print_json(declared.to_json() | {"replaced": replaced})
    else:
        click.echo(f"hypermesh: pool {name} set ({kind})", err=True)


@pool.command("rm")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"name", "declaration"}: the declaration removed.')
@mesh_options
@run_async
async def pool_rm(mesh: Mesh, name: str, as_json: bool) -> None:
    """Remove pool NAME's declaration (its running nodes are not stopped)."""
    async with mesh.connect() as etcd:
        found = await etcd.get(mesh.ks.pool(name))
        if found is None:
            raise NotFound(f"no pool {name!r} in namespace {mesh.ks.namespace!r}")
        # Remove what was read: a declaration replaced meanwhile stays (and says so).
        done = await etcd.txn(
            [etcd.mod_revision_is(mesh.ks.pool(name), found[1])],
            [etcd.op_delete(mesh.ks.pool(name))],
        )
        if not done.succeeded:
            raise HypermeshError(f"pool {name!r} changed while being removed; nothing removed")
    if as_json:
        print_json({"name": name, "declaration": json.loads(found[0])})
    else:
        click.echo(f"hypermesh: pool {name} removed", err=True)


async def _load(etcd: Etcd, ks: Keyspace, kinds: tuple[str, ...]) -> MeshView:
    view = MeshView(ks)
    for kind in kinds:
        kvs, _ = await etcd.get_prefix(ks.kind_prefix(kind))
        for kv in kvs:
            view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    return view


def declared_pools(view: MeshView) -> dict[str, Pool]:
    """The pools declared in ``view`` (a malformed declaration is skipped)."""
    return parse_pools(view.pools)


@pool.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def pool_ls(mesh: Mesh, as_json: bool) -> None:
    """List pools with their nodes, node-seconds and cost so far."""
    async with mesh.connect() as etcd:
        view = await _load(etcd, mesh.ks, ("pool", "node", "inst", "usage"))
    pools = declared_pools(view)
    rows = []
    for name in sorted(set(pools) | {n.pool for n in view.nodes.values()}):
        p = pools.get(name)
        used = {name: view.usage[name][0]} if name in view.usage else {}
        spent = usage_cost(used, pools)
        row: dict[str, Any] = p.to_json() if p else {"name": name, "kind": None}
        row.update(
            declared=p is not None,
            nodes=sorted(n.name for n in view.nodes.values() if n.pool == name),
            starting=sorted(
                k for k, i in view.instances.items()
                if i.get("pool") == name and k not in view.nodes
            ),
            node_seconds=spent["node_seconds"],
            cost=spent["cost"],
            on_demand_cost=spent["on_demand_cost"],
        )
        rows.append(row)
    if as_json:
        print_json(rows)
        return
    click.echo(f"{'POOL':<16}{'KIND':<8}{'MARKET':<10}{'NODES':>6}{'START':>6}{'MIN':>5}"
               f"{'MAX':>5}{'PRICE/H':>9}{'NODE-S':>10}{'COST':>10}")
    for r in rows:
        market = "-" if r["kind"] in (None, "static") else ("spot" if r["spot"] else "on-demand")
        click.echo(
            f"{r['name']:<16}{r['kind'] or '(none)':<8}{market:<10}{len(r['nodes']):>6}"
            f"{len(r['starting']):>6}{r.get('min_nodes', 0):>5}{r.get('max_nodes', 0):>5}"
            f"{r.get('price', 0):>9.3f}{r['node_seconds']:>10.0f}{r['cost']:>10.4f}"
        )


# ---------------------------------------------------------------------- events
def _event_line(e: dict[str, Any]) -> str:
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("at", 0)))
    what = e.get("action", "?")
    count = f" x{e['count']}" if e.get("count") else ""
    market = "" if e.get("spot") is None else (" spot" if e["spot"] else " on-demand")
    node = f" {e['node']}" if e.get("node") else ""
    return f"{when}  {what:<9}{e.get('pool', ''):<12}{count}{market}{node}  {e.get('reason', '')}"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events.")
@mesh_options
@run_async
async def events(mesh: Mesh, as_json: bool, follow: bool) -> None:
    """Show the leader's burst decisions (launch, release, forget, refused), oldest first."""

    def show(key: str, value: bytes | None, crev: int = 0, mrev: int = 0) -> None:
        if value is None:
            return  # trimmed from the log
        try:
            event = json.loads(value)
        except ValueError:
            return
        click.echo(json.dumps(event, sort_keys=True) if as_json else _event_line(event))

    prefix = mesh.ks.kind_prefix("event")
    async with mesh.connect() as etcd:
        if not follow:
            kvs, _ = await etcd.get_prefix(prefix)
            for kv in kvs:
                show(kv.key.decode(), kv.value)
            return
        await etcd.mirror(prefix, show, lambda revision: None)  # until interrupted


# ---------------------------------------------------------------------- submit
async def unknown_pools(etcd: Etcd, ks: Keyspace, recipe: Recipe) -> list[str]:
    """Warnings for experiments whose ``pools`` name no declared pool and no pool a
    live node is in (their tasks would wait until such a node joins), and whose
    ``prefer_pools`` name none (the preference does nothing until one does)."""
    named = {p for exp in recipe.experiments for p in (*exp.pools, *exp.prefer_pools)}
    if not named:
        return []
    view = await _load(etcd, ks, ("pool", "node"))
    known = set(view.pools) | {n.pool for n in view.nodes.values()}
    return [
        f"experiment {exp.name!r}: no pool {p!r} is declared and no live node is in it; "
        "its tasks wait until one is"
        for exp in recipe.experiments
        for p in exp.pools
        if p not in known and not any(q in known for q in exp.pools)
    ] + [
        f"experiment {exp.name!r}: no preferred pool ({', '.join(exp.prefer_pools)}) is "
        "declared or has a live node; the preference does nothing until one does"
        for exp in recipe.experiments
        if exp.prefer_pools and not any(q in known for q in exp.prefer_pools)
    ]


# ---------------------------------------------------------------------- cost
async def workflow_costs(etcd: Etcd, ks: Keyspace, wids: list[str]) -> dict[str, dict[str, Any]]:
    """``{wid: cost}`` for ``hypermesh status``: node-seconds its tasks used per pool,
    their cost, and what the same node-seconds would have cost on-demand."""
    kinds = ("pool", "wfusage") if len(wids) > 1 else ("pool",)
    view = await _load(etcd, ks, kinds)
    if len(wids) == 1:
        found = await etcd.get(ks.workflow_usage(wids[0]))
        if found is not None:
            view.apply(ks.workflow_usage(wids[0]), found[0], 0, found[1])
    pools = declared_pools(view)
    return {
        wid: usage_cost(view.workflow_usage.get(wid, ({}, 0))[0], pools) for wid in wids
    }
