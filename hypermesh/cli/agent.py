"""``hypermesh agent start``: run the agent on this machine.

The command turns its options into an ``AgentConfig`` (a preset, ``lan`` or ``local``,
with the options given overriding its fields) and runs the agent until it has
drained; see ``hypermesh/config.py`` for what each field means. The agent itself is
imported on use, so that no other command pays for loading it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from hypermesh.cli.common import Mesh, dump_profile, err, mesh_options, run_async
from hypermesh.config import CONTAINER_RUNTIMES, AgentConfig, parse_locality_delay
from hypermesh.errors import UsageError
from hypermesh.exposure import dashboard_token


@click.group()
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
    "--advertise",
    default=None,
    metavar="HOST:PORT",
    help="Where peers and the CLI reach this agent, an IP address or a DNS name: behind "
    "NAT, in a container, or required with --listen 0.0.0.0:PORT "
    "[default: the --listen address; env HYPERMESH_ADVERTISE].",
)
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
    "--image-budget",
    default="20GiB",
    show_default=True,
    help="Most bytes the container images this agent pulled may take; past it the least "
    "recently used unused ones are removed (never images it did not pull).",
)
@click.option(
    "--image-pull-deadline",
    default=None,
    metavar="DURATION",
    help="How long one image pull may take, retries included [lan: 5m, local: 20s].",
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
    "--watch",
    type=click.Choice(["auto", "all", "own"]),
    default="auto",
    show_default=True,
    help="all: watch the whole namespace. own: skip the blocks of batched experiments "
    "and claim those the leader offers this node (for large meshes). auto: all while "
    "one of the mesh's watch-all seats is free (hypermesh settings), else own.",
)
@click.option(
    "--task-env",
    "task_env",
    multiple=True,
    metavar="NAME",
    help="An agent environment variable every task gets besides the built-in allow-list "
    "(PATH, HOME, locale...); NAME* for a prefix (repeatable). Never a credential: "
    "recipes ask for those with pass_env.",
)
@click.option(
    "--container-runtime",
    type=click.Choice(CONTAINER_RUNTIMES),
    default="auto",
    show_default=True,
    help="What runs tasks with an image: auto asks docker, then podman, whether it answers; "
    "none runs them as plain processes (as when no runtime answers; their logs say so).",
)
@click.option(
    "--health-listen",
    default=None,
    metavar="HOST:PORT",
    help="Also serve gRPC health alone, without TLS, here: for Kubernetes grpc probes "
    "when --tls-* makes the agent's port mutual TLS.",
)
@click.option(
    "--dashboard-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="File whose first line is the dashboard's login token (16+ characters); "
    "required for a dashboard beyond loopback [env HYPERMESH_DASHBOARD_TOKEN].",
)
@click.option(
    "--dashboard-host",
    "dashboard_hosts",
    multiple=True,
    metavar="NAME[:PORT]",
    help="A host name browsers use for the dashboard, besides IP addresses, localhost "
    "and this machine's name (repeatable) [env HYPERMESH_DASHBOARD_HOSTS, comma-separated].",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Allow plaintext listeners beyond loopback: gRPC without --tls-*, the dashboard, "
    "metrics. Warned about at every start.",
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
    advertise: str | None,
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
    image_budget: str,
    image_pull_deadline: str | None,
    metrics_listen: str,
    telemetry_period: float | None,
    http_listen: str | None,
    locality_delay: str,
    pool_delay: float | None,
    peer_sharing: str,
    watch: str,
    task_env: tuple[str, ...],
    container_runtime: str,
    insecure: bool,
    health_listen: str | None,
    dashboard_token_file: Path | None,
    dashboard_hosts: tuple[str, ...],
) -> None:
    """Start the agent: register, lead when elected, claim and run tasks.

    SIGTERM drains: no new claims; running tasks get SIGTERM, then SIGKILL after
    the grace period, and go back to the mesh to run elsewhere.
    """
    from hypermesh.agent.daemon import Agent

    overrides: dict[str, Any] = {
        "listen": listen,
        "advertise": advertise or os.environ.get("HYPERMESH_ADVERTISE") or None,
        "work_dir": work_dir,
        "slots": slots,
        "pool": pool,
        "spot": spot,
        "gpus": gpus,
        "gpu_type": gpu_type,
        "labels": _parse_labels(labels),
        "store": store or os.environ.get("HYPERMESH_STORE") or None,
        "cache_size": cache_size,
        "image_budget": image_budget,
        "image_pull_deadline": image_pull_deadline,
        "metrics_listen": None if metrics_listen == "off" else metrics_listen,
        "task_env": task_env,
        "container_runtime": container_runtime,
        "tls": mesh.tls,
        "etcd_security": mesh.etcd_security,
        "insecure": insecure,
        "health_listen": health_listen,
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
        overrides["watch"] = watch
        overrides["dashboard_token"] = dashboard_token(dashboard_token_file)
        env_hosts = os.environ.get("HYPERMESH_DASHBOARD_HOSTS", "").split(",")
        overrides["dashboard_hosts"] = (
            *dashboard_hosts, *(h.strip() for h in env_hosts if h.strip())
        )
        cfg = AgentConfig.local(**overrides) if preset == "local" else AgentConfig.lan(**overrides)
    except UsageError as exc:
        err(f"error: {exc}")
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
        dump_profile()
        os._exit(0)

    run_async(run_then_exit, agent_loop=True)()
