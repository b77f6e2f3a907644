"""``hypermesh notebook``: JupyterLab as a task, next to the data, one command away.

The command submits a one-task workflow (experiment ``notebook``) whose recipe it writes
from its options: ``pools``, ``hardware`` and ``data`` as any recipe says them, so the task
runs on a node that fits, with its data sets mounted (``$HM_DATA_ALIAS``). The task runs
``agent/ops/notebook_task.py``, which starts ``jupyter lab`` on the node's loopback and
reports its port as the attempt's metric ``notebook_port`` once Jupyter answers. The command
waits for that report, then prints the URL and the token, once:

- the node serves a dashboard: through it, ``SCHEME://DASHBOARD/notebook/TASK_ID/lab``
  (``agent/ops/notebook_proxy.py``: behind the dashboard's login, over HTTPS where the
  dashboard is);
- else: the loopback URL on that node, ``http://127.0.0.1:PORT/notebook/TASK_ID/lab``.

The token is random, passed to Jupyter in the recipe's ``env`` (``JUPYTER_TOKEN``), whose
values ``status``, ``tasks`` and the dashboard never show. ``hypermesh cancel WF`` stops the
notebook like any task.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex
import ssl
import sys
import time
from pathlib import Path

import click
import yaml

from hypermesh.cli.common import Mesh, err, load_view, mesh_options, print_json, run_async
from hypermesh.errors import UsageError
from hypermesh.recipe.recipe import Recipe, parse_recipe
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import TERMINAL, WorkflowRecord

EXPERIMENT = "notebook"
METRIC = "notebook_port"  # what agent/ops/notebook_task.py reports (METRIC there)
TASK_MODULE = "hypermesh.agent.ops.notebook_task"
POLL_S = 0.3  # how often the command reads the task's records while it waits
PROBE_S = 2.0  # how long the HTTPS probe of a node's dashboard waits


def notebook_recipe(
    name: str, python: str | None, pools: tuple[str, ...], data: tuple[str, ...],
    hardware: dict[str, object], timeout: str | None, token: str, workdir: Path,
) -> Recipe:
    """The notebook's recipe, checked as any submitted recipe is."""
    # Without --python: the node's agent's own interpreter ($HM_PYTHON), which has
    # hypermesh (and, with the notebook extra, jupyterlab) installed.
    interpreter = shlex.quote(python) if python else '"${HM_PYTHON:-python3}"'
    exp: dict[str, object] = {
        "command": [f"{interpreter} -m {TASK_MODULE}"],
        "env": {"JUPYTER_TOKEN": token},
    }
    if pools:
        exp["pools"] = list(pools)
    if data:
        sets = {}
        for item in data:
            alias, sep, dataset = item.partition("=")
            if not sep or not alias or not dataset:
                raise UsageError(f"--data {item!r}: give ALIAS=DATASET[@VERSION]")
            sets[alias] = dataset
        exp["data"] = sets
    if hardware:
        exp["hardware"] = hardware
    if timeout:
        exp["timeout"] = timeout
    text = yaml.safe_dump(
        {"name": name, "workdir": str(workdir), "experiments": {EXPERIMENT: exp}},
        sort_keys=False,
    )
    return parse_recipe(text, "<notebook>")


async def _is_https(address: str) -> bool:
    """Whether the dashboard at HOST:PORT speaks TLS (only to choose the URL's scheme:
    the browser checks the certificate)."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), ssl=context), PROBE_S)
    except (TimeoutError, OSError, ssl.SSLError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()
    return True


async def _wait_ready(mesh: Mesh, wid: str, deadline: float) -> tuple[str, int, str]:
    """Wait until the notebook task reports its port: (node, port, dashboard address or
    ""). Exits 1 when the workflow ends first, or (cancelling it) when time runs out."""
    ref = TaskRef(wid, EXPERIMENT, 0)
    async with mesh.connect() as etcd:
        while True:
            view = await load_view(etcd, mesh.ks, wid)
            claim = view.claims.get(ref)
            if claim is not None:
                reported = view.metrics.get(ref, {}).get(claim.attempt)
                port = reported.last.get(METRIC) if reported else None
                if port:
                    node = view.nodes.get(claim.node)
                    return claim.node, int(port), node.http_address if node else ""
            state = view.workflow_summary(wid)["state"]
            if state in TERMINAL:
                err(f"error: the notebook ended ({state}) before Jupyter answered; "
                    f"see `hypermesh logs {ref.id}`")
                sys.exit(1)
            if time.monotonic() > deadline:
                from hypermesh.state.txns import cancel_workflow

                await cancel_workflow(etcd, mesh.ks, wid)
                row = view.task_json(ref)
                why = f": {row['waiting']}" if row.get("waiting") else ""
                err(f"error: Jupyter did not answer in time (task {row['state']}{why}); "
                    f"{wid} cancelled")
                sys.exit(1)
            await asyncio.sleep(POLL_S)


@click.command()
@click.option("--pool", "pools", multiple=True, metavar="POOL",
              help="Run on a node of this pool (repeatable).")
@click.option("--data", "data", multiple=True, metavar="ALIAS=DATASET[@VERSION]",
              help="Mount a data set at $HM_DATA_ALIAS, as a recipe's data (repeatable).")
@click.option("--gpus", type=float, default=None, help="GPUs to book (a share below 1).")
@click.option("--gpu", "gpu_type", default=None, metavar="TYPE", help="GPU type, e.g. a100.")
@click.option("--cpus", type=float, default=None, help="CPUs the node must have.")
@click.option("--memory", default=None, metavar="SIZE", help="Memory the node must have.")
@click.option("--timeout", default=None, metavar="DURATION",
              help="Stop the notebook after this long (e.g. 8h) [default: never].")
@click.option("--python", default=None, metavar="PATH",
              help="The node's interpreter with jupyterlab and hypermesh installed "
              "[default: the node's agent's own, $HM_PYTHON].")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Jupyter's root folder on the node [default: the current folder].")
@click.option("--name", default="notebook", show_default=True, help="Workflow name.")
@click.option("--wait", "wait_s", type=float, default=300, show_default=True,
              metavar="SECONDS", help="How long to wait for Jupyter; then it is cancelled.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"workflow", "task", "node", "url", "token", "via"}.')
@mesh_options
@run_async
async def notebook(
    mesh: Mesh, pools: tuple[str, ...], data: tuple[str, ...], gpus: float | None,
    gpu_type: str | None, cpus: float | None, memory: str | None, timeout: str | None,
    python: str | None, workdir: Path | None, name: str, wait_s: float, as_json: bool,
) -> None:
    """Run JupyterLab as a task on a node that fits; print its URL and token.

    Stop it with `hypermesh cancel WORKFLOW`."""
    from hypermesh.state.txns import new_workflow_id, submit_workflow

    hardware: dict[str, object] = {
        k: v for k, v in (("gpus", gpus), ("gpu", gpu_type), ("cpus", cpus),
                          ("memory", memory)) if v is not None
    }
    token = secrets.token_urlsafe(32)
    folder = (workdir or Path.cwd()).resolve()
    recipe = notebook_recipe(name, python, pools, data, hardware, timeout, token, folder)
    wf = WorkflowRecord(id=new_workflow_id(name), name=name, recipe=recipe, seed=0,
                        submitted_at=time.time(), workdir=str(folder), source="<notebook>")
    async with mesh.connect() as etcd:
        await submit_workflow(etcd, mesh.ks, wf)
    err(f"submitted {wf.id}: waiting for Jupyter (stop it with `hypermesh cancel {wf.id}`)")
    node, port, dashboard = await _wait_ready(mesh, wf.id, time.monotonic() + wait_s)
    task = TaskRef(wf.id, EXPERIMENT, 0).id
    path = f"/notebook/{task}/lab?token={token}"
    if dashboard:
        scheme = "https" if await _is_https(dashboard) else "http"
        url, via = f"{scheme}://{dashboard}{path}", "dashboard"
    else:
        url, via = f"http://127.0.0.1:{port}{path}", "loopback"
    if as_json:
        print_json({"workflow": wf.id, "task": task, "node": node, "url": url,
                    "token": token, "via": via})
        return
    click.echo(url)
    click.echo(f"token: {token}")
    where = ("through its dashboard (log in there first if it asks)" if dashboard
             else f"on {node}'s loopback only (e.g. ssh -L {port}:127.0.0.1:{port} {node})")
    err(f"Jupyter runs on {node}, reached {where}; stop it with `hypermesh cancel {wf.id}`")
