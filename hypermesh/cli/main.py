"""The ``hypermesh`` command line: the stable contract users' scripts drive.

Exit codes: 0 success; 1 a failure at run time (a workflow failed, etcd did not
answer, an object does not exist); 2 bad input (a usage error or an invalid
recipe — nothing was submitted). Machine-readable output (``--json``, the
workflow id of ``submit``) goes to stdout; progress and errors to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Coroutine
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click
import grpc

from hypermesh.cli.data import data
from hypermesh.cli.ml import add_best, best_command, print_best_line
from hypermesh.config import (
    ENV_ETCD,
    ENV_NAMESPACE,
    AgentConfig,
    default_etcd,
    default_namespace,
    parse_locality_delay,
)
from hypermesh.errors import HypermeshError, NotFound, RecipeError, UsageError
from hypermesh.state.etcd import Etcd, parse_endpoints
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.model import TERMINAL, MeshView, WorkflowRecord

T = TypeVar("T")


def _err(message: str) -> None:
    click.echo(f"hypermesh: {message}", err=True)


_profile: Any = None


def _profiled(run: Callable[..., T], *args: Any) -> T:
    """``run(*args)``, under cProfile when ``HYPERMESH_PROFILE_DIR`` names a directory:
    the profile goes to ``DIR/<pid>.prof`` when it returns (a developer's tool)."""
    global _profile
    if not os.environ.get("HYPERMESH_PROFILE_DIR"):
        return run(*args)
    import cProfile

    _profile = cProfile.Profile()
    try:
        return _profile.runcall(run, *args)  # type: ignore[no-any-return]
    finally:
        _dump_profile()


def _dump_profile() -> None:
    """Write the profile ``_profiled`` is taking, if any (also before ``os._exit``)."""
    out = os.environ.get("HYPERMESH_PROFILE_DIR")
    if _profile is not None and out:
        _profile.disable()
        _profile.dump_stats(os.path.join(out, f"{os.getpid()}.prof"))


def run_async(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """Run an async command; turn hypermesh errors into messages and exit codes."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return _profiled(asyncio.run, fn(*args, **kwargs))
        except RecipeError as exc:
            for problem in exc.problems:
                click.echo(f"error: {problem}", err=True)
            _err(f"recipe rejected with {len(exc.problems)} problem(s); nothing was submitted")
            sys.exit(2)
        except UsageError as exc:
            _err(f"error: {exc}")
            sys.exit(2)
        except HypermeshError as exc:
            _err(f"error: {exc}")
            sys.exit(1)

    return wrapper


class Mesh:
    """Where the CLI finds the mesh: etcd endpoints and namespace."""

    def __init__(self, etcd: str, namespace: str) -> None:
        self.endpoints = parse_endpoints(etcd)
        try:
            self.ks = Keyspace(namespace)
        except ValueError as exc:
            raise UsageError(f"--namespace: {exc}") from exc

    def connect(self) -> Etcd:
        return Etcd(self.endpoints)


def mesh_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--etcd`` and ``--namespace`` on every command (also accepted before it)."""
    fn = click.option(
        "--namespace",
        "namespace",
        default=None,
        metavar="NAME",
        help=f"Mesh namespace in etcd [env {ENV_NAMESPACE}; default 'default'].",
    )(fn)
    fn = click.option(
        "--etcd",
        "etcd",
        default=None,
        metavar="URL[,URL...]",
        help=f"etcd endpoints [env {ENV_ETCD}; default http://127.0.0.1:2379].",
    )(fn)

    @wraps(fn)
    def wrapper(*args: Any, etcd: str | None, namespace: str | None, **kwargs: Any) -> Any:
        root = click.get_current_context().find_root().params
        etcd = etcd or root.get("etcd") or default_etcd()
        namespace = namespace or root.get("namespace") or default_namespace()
        try:
            mesh = Mesh(etcd, namespace)
        except UsageError as exc:
            _err(f"error: {exc}")
            sys.exit(2)
        return fn(*args, mesh=mesh, **kwargs)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--etcd", default=None, metavar="URL[,URL...]", help="etcd endpoints.")
@click.option("--namespace", default=None, metavar="NAME", help="Mesh namespace in etcd.")
@click.option("-v", "--verbose", count=True, help="More log output on stderr.")
@click.version_option(package_name="hypermesh")
def main(etcd: str | None, namespace: str | None, verbose: int) -> None:
    """Run batch deep-learning work on a mesh of on-prem and spot machines."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---------------------------------------------------------------------- agent
@main.group()
def agent() -> None:
    """Run the agent on this machine."""


def _parse_labels(labels: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--label")
        out[key] = value
    return out


@agent.command("start")
@click.option("--name", default=None, help="Node name, unique in the mesh [default: host name].")
@click.option("--listen", default="127.0.0.1:7070", show_default=True, help="gRPC HOST:PORT.")
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
    default=Path("hypermesh-work"),
    show_default=True,
    help="Attempt logs and scratch space.",
)
@click.option("--slots", type=int, default=1, show_default=True, help="Tasks run at once.")
@click.option("--pool", default="default", show_default=True, help="Pool this node belongs to.")
@click.option("--spot", is_flag=True, help="This is a preemptible (spot) machine.")
@click.option("--gpus", type=int, default=None, help="GPU count [default: from NVML].")
@click.option("--gpu-type", default=None, help="GPU type, e.g. a100 [default: from NVML].")
@click.option("--label", "labels", multiple=True, metavar="K=V", help="Node label (repeatable).")
@click.option(
    "--lease-ttl",
    type=int,
    default=None,
    help="Seconds until etcd drops a silent node [lan: 10, local: 3].",
)
@click.option(
    "--grace",
    type=float,
    default=None,
    help="Seconds between SIGTERM and SIGKILL for stopped tasks [lan: 10, local: 2].",
)
@click.option(
    "--leader-ttl",
    type=int,
    default=None,
    help="Seconds until a silent leader is replaced, at most [default: 5].",
)
@click.option(
    "--spot-notice-url",
    default=None,
    help="Where --spot polls for the interruption notice [default: EC2 instance metadata].",
)
@click.option(
    "--spot-poll", type=float, default=None, help="Seconds between notice polls [lan: 2]."
)
@click.option(
    "--store",
    default=None,
    metavar="URL",
    help="Object store of data sets: s3://BUCKET[/PREFIX] or file:///PATH [env HYPERMESH_STORE].",
)
@click.option(
    "--cache-size",
    default="20GiB",
    show_default=True,
    help="Most bytes the chunk cache of each mounted data set holds.",
)
@click.option(
    "--metrics-listen",
    default="127.0.0.1:0",
    show_default=True,
    metavar="HOST:PORT|off",
    help="Where to serve Prometheus /metrics (port 0: a free one; 'off': nowhere).",
)
@click.option(
    "--telemetry-period",
    type=float,
    default=None,
    help="Seconds between telemetry samples [default: 5].",
)
@click.option(
    "--http-listen",
    default=None,
    metavar="HOST:PORT|off",
    help="Web dashboard address; port 0 picks a free one "
    "[lan: 127.0.0.1:7071, local: 127.0.0.1:0].",
)
@click.option(
    "--locality-delay",
    default="3",
    show_default=True,
    metavar="SECONDS|off",
    help="How long to leave a task to a node holding more of its input data; "
    "'off': ignore where data is.",
)
@click.option(
    "--pool-delay",
    type=float,
    default=None,
    metavar="SECONDS",
    help="How long to leave a task to a node of a pool its experiment prefers "
    "(prefer_pools) that has room [lan: 5, local: 2].",
)
@click.option(
    "--peer-sharing",
    type=click.Choice(["on", "off"]),
    default="on",
    show_default=True,
    help="Whether mounts fetch chunks from peers (and share cold reads) before the store.",
)
@click.option(
    "--preset",
    type=click.Choice(["lan", "local"]),
    default="lan",
    show_default=True,
    help="Timing preset; 'local' is for tests and the local mesh.",
)
@mesh_options
def agent_start(
    mesh: Mesh,
    name: str | None,
    listen: str,
    work_dir: Path,
    slots: int,
    pool: str,
    spot: bool,
    gpus: int | None,
    gpu_type: str | None,
    labels: tuple[str, ...],
    lease_ttl: int | None,
    grace: float | None,
    preset: str,
    leader_ttl: int | None,
    spot_notice_url: str | None,
    spot_poll: float | None,
    store: str | None,
    cache_size: str,
    metrics_listen: str,
    telemetry_period: float | None,
    http_listen: str | None,
    locality_delay: str,
    pool_delay: float | None,
    peer_sharing: str,
) -> None:
    """Start the agent: register, lead when elected, claim and run tasks.

    SIGTERM drains: no new claims; running tasks get SIGTERM, then SIGKILL after
    the grace period, and go back to the mesh to run elsewhere.
    """
    from hypermesh.agent.daemon import Agent

    overrides: dict[str, Any] = {
        "listen": listen,
        "work_dir": work_dir,
        "slots": slots,
        "pool": pool,
        "spot": spot,
        "gpus": gpus,
        "gpu_type": gpu_type,
        "labels": _parse_labels(labels),
        "store": store or os.environ.get("HYPERMESH_STORE") or None,
        "cache_size": cache_size,
        "metrics_listen": None if metrics_listen == "off" else metrics_listen,
    }
    if telemetry_period is not None:
        overrides["telemetry_period"] = telemetry_period
    if name:
        overrides["name"] = name
    if lease_ttl is not None:
        overrides["lease_ttl"] = lease_ttl
    if grace is not None:
        overrides["kill_grace"] = grace
    if leader_ttl is not None:
        overrides["leader_ttl"] = leader_ttl
    if spot_notice_url is not None:
        overrides["spot_notice_url"] = spot_notice_url
    if spot_poll is not None:
        overrides["spot_poll"] = spot_poll
    if pool_delay is not None:
        overrides["pool_delay"] = pool_delay
    if http_listen is not None:
        overrides["http_listen"] = None if http_listen == "off" else http_listen
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger().setLevel(logging.INFO)
    try:
        overrides["locality_delay"] = parse_locality_delay(locality_delay)
        overrides["peer_sharing"] = peer_sharing == "on"
        cfg = AgentConfig.local(**overrides) if preset == "local" else AgentConfig.lan(**overrides)
    except UsageError as exc:
        _err(f"error: {exc}")
        sys.exit(2)
    agent_ = Agent(cfg, mesh.endpoints, mesh.ks.namespace)

    async def run_then_exit() -> None:
        await agent_.run()
        # Drained: leases revoked, claims released, state in etcd. Exit now rather than
        # wait for asyncio to unwind grpc's internals, which can stall a stopping
        # process (and keep a spot machine from going) for no benefit.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        _dump_profile()
        os._exit(0)

    run_async(run_then_exit)()


# ---------------------------------------------------------------------- submit
@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--name", default=None, help="Workflow name [default: recipe's name or file stem].")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="EXP.FIELD=VALUE",
    help="Override a recipe field (repeatable), e.g. mnist.samples=10.",
)
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
        from hypermesh.cli.burst import unknown_pools

        for warning in await unknown_pools(etcd, mesh.ks, parsed):
            _err(f"warning: {warning}")
        await submit_workflow(etcd, mesh.ks, wf)
        _err(f"submitted {wf.id}: {len(parsed.experiments)} experiment(s), seed {seed}")
        if not wait:
            _submitted(wf, "pending", as_json)
            return
        state = await _follow(etcd, mesh.ks, wf.id)
    _submitted(wf, state, as_json)
    sys.exit(0 if state == "succeeded" else 1)


def _submitted(wf: WorkflowRecord, state: str, as_json: bool) -> None:
    """What ``submit`` prints on stdout: the workflow id, or with ``--json`` an object."""
    if not as_json:
        click.echo(wf.id)
        return
    experiments = [e.name for e in wf.recipe.experiments]
    _print_json(
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
    mirrors = [asyncio.create_task(etcd.mirror(ks.root, view.apply, on_batch, only=keys))]
    display = None if as_json else ProgressDisplay(wid)
    last: dict[str, Any] | None = None
    try:
        while True:
            await changed.wait()
            changed.clear()
            if wid not in view.workflows:
                continue
            summary = _followed_summary(view, wid)
            final = view.progress.get(wid, {}).get("state")
            if summary["state"] in TERMINAL and summary["state"] != final:
                # Ended without the leader's final summary: summarize the records once.
                summary = (await load_view(etcd, ks, wid)).workflow_summary(wid)
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


# ---------------------------------------------------------------------- reading
async def load_view(etcd: Etcd, ks: Keyspace, wid: str | None = None) -> MeshView:
    """A view of the whole namespace, or of one workflow (raises NotFound)."""
    view = MeshView(ks)
    if wid is None:
        prefixes = [ks.root]
    else:
        prefixes = [p for p in ks.workflow_prefixes(wid) if p.endswith("/")]
        prefixes.append(ks.nodes)  # how many nodes could run a waiting gang
    for prefix in prefixes:
        kvs, _ = await etcd.get_prefix(prefix)
        for kv in kvs:
            view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    if wid is not None:
        for key in (ks.workflow(wid), ks.workflow_state(wid)):
            found = await etcd.get(key)
            if found is not None:
                view.apply(key, found[0], 0, found[1])
        if wid not in view.workflows:
            raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
    return view


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


@main.command()
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
    from hypermesh.cli.burst import workflow_costs

    if watch:
        if not workflow:
            raise UsageError("status --watch needs a WORKFLOW")
        async with mesh.connect() as etcd:
            await load_view(etcd, mesh.ks, workflow)  # NotFound for a wrong id
            state = await _follow(etcd, mesh.ks, workflow, as_json)
        sys.exit(0 if state == "succeeded" else 1)
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow)
        ids = (
            [workflow]
            if workflow
            else sorted(view.workflows, key=lambda w: view.workflows[w].submitted_at)
        )
        costs = await workflow_costs(etcd, mesh.ks, ids)
    summaries = [view.workflow_summary(w) | {"cost": costs[w]} for w in ids]
    add_best(view, summaries)
    if as_json:
        _print_json(summaries[0] if workflow else summaries)
        return
    if not summaries:
        click.echo("no workflows")
    for s in summaries:
        click.echo(f"{s['id']}  {s['name']}  {s['state']}")
        click.echo(
            f"  {'EXPERIMENT':<20}{'STATE':<11}{'TOTAL':>6}{'PEND':>6}{'RUN':>6}"
            f"{'OK':>6}{'FAIL':>6}{'CANC':>6}"
        )
        for name, e in s["experiments"].items():
            click.echo(
                f"  {name:<20}{e['state']:<11}{e['total']:>6}{e['pending']:>6}"
                f"{e['running']:>6}{e['succeeded']:>6}{e['failed']:>6}{e['cancelled']:>6}"
            )
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


@main.command()
@click.argument("workflow")
@click.option("--experiment", default=None, help="Only tasks of this experiment.")
@click.option(
    "--state",
    "state_filter",
    default=None,
    type=click.Choice(["pending", "running", "succeeded", "failed", "cancelled"]),
    help="Only tasks in this state.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@mesh_options
@run_async
async def tasks(
    mesh: Mesh, workflow: str, experiment: str | None, state_filter: str | None, as_json: bool
) -> None:
    """List a workflow's tasks with their parameters and attempts."""
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow)
    rows = [view.task_json(ref) for ref in view.task_refs(workflow, experiment)]
    if state_filter:
        rows = [r for r in rows if r["state"] == state_filter]
    if as_json:
        _print_json(rows)
        return
    for r in rows:
        last = r["attempts"][-1] if r["attempts"] else {}
        params = " ".join(f"{k}={v}" for k, v in r["params"].items())
        click.echo(
            f"{r['id']:<40} {r['state']:<10} {r['node'] or '-':<14} "
            f"attempts={len(r['attempts'])} exit={last.get('exit_code', '-')} {params}"
        )


async def gossip_view(address: str) -> dict[str, dict[str, Any]]:
    """The gossip member table as the agent at ``address`` sees it ({} if it does not answer)."""
    from hypermesh._proto import agent_pb2, agent_pb2_grpc
    from hypermesh.state.node_rows import gossip_table

    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await agent_pb2_grpc.AgentStub(channel).GetMembers(
                agent_pb2.GetMembersRequest(), timeout=3
            )
        except grpc.aio.AioRpcError:
            return {}
    return gossip_table(reply)


@main.command()
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
    """
    from hypermesh.state.node_rows import node_rows

    ks = mesh.ks
    view = MeshView(ks)
    async with mesh.connect() as etcd:
        for prefix in (ks.nodes, ks.election, ks.kind_prefix("claim")):
            kvs, _ = await etcd.get_prefix(prefix)
            for kv in kvs:
                view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    leader = view.leader()
    asked = via or leader or (min(view.nodes) if view.nodes else None)
    if via and via not in view.nodes:
        raise NotFound(f"no live node {via!r} in namespace {ks.namespace!r}")
    gossip = await gossip_view(view.nodes[asked].address) if asked else {}
    telemetry = await fetch_telemetry({n.name: n.address for n in view.nodes.values()})
    rows = node_rows(view, gossip, asked, show_all)
    for row in rows:
        sample = telemetry.get(row["name"]) if row["address"] else None
        row["telemetry"] = (sample or {}).get("latest")
    if as_json:
        _print_json(rows)
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


@main.command()
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
        chunks = stream_log(etcd, mesh.ks, ref, n, follow, store, lambda m: _err(f"note: {m}"))
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
            _print_json({"task": ref.id, "attempt": n, "text": "".join(text)})


@main.command()
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
        _print_json(
            {"workflow": workflow, "experiment": experiment, "state": state, "changed": changed}
        )
    elif changed:
        _err(f"{what} cancelled; running tasks are being stopped")
    else:
        _err(f"{what} had already ended: {state}")


@main.command()
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


main.add_command(data)
# `pool` and `events` register themselves on `main`; they use the helpers above.
import hypermesh.cli.burst  # noqa: E402, F401


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def mount(args: tuple[str, ...]) -> None:
    """Mount a data set with FUSE (see `hypermesh mount --help`)."""
    # Imported on use: the FUSE and S3 stack would add 0.2 s to every other command.
    from hypermesh.chunkfs.mount import mount as mount_command

    mount_command.main(args=list(args), prog_name="hypermesh mount")


from hypermesh.cli.top import fetch_telemetry, top  # noqa: E402  (it uses the helpers above)

main.add_command(top)
from hypermesh.cli.ops import OPS_COMMANDS  # noqa: E402  (they use the helpers above)

for _command in OPS_COMMANDS:
    main.add_command(_command)

if __name__ == "__main__":
    main()
