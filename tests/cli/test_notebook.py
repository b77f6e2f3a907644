"""``hypermesh notebook`` end to end: a real agent (mutual-TLS files, a dashboard with a
login over HTTPS), a real JupyterLab started as a task, reached through the agent's proxy
(HTTP and a kernel's websocket), stopped by ``cancel``; and the proxy's refusal of a port
that is not the task's own; a notebook with ``--pool`` and ``--data`` on a two-pool mesh with
a real store, its kernel reading the mounted data set; and the recipe the options make."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from pathlib import Path

import aiohttp
import psutil
import pytest

from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.cli.notebook import TASK_MODULE, notebook_recipe
from hypermesh.errors import UsageError
from hypermesh.local.agents import AgentProcess
from hypermesh.local.pki import LocalPki
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone

DASHBOARD_TOKEN = "notebook-dashboard-token-0123456789"


def guarded_agent(
    mesh: Mesh, tmp_path: Path, name: str = "nb1", extra: tuple[str, ...] = ()
) -> tuple[AgentProcess, ssl.SSLContext, tuple[str, ...]]:
    """An agent with its mesh TLS files (one CA per test) and a dashboard token: its
    dashboard is HTTPS behind a login. Returns it, a client context that trusts the mesh
    CA, and the CLI's ``--tls-*`` options (a user's certificate) for commands that reach
    the agent. ``extra``: more agent options."""
    pki = LocalPki(tmp_path / "pki")
    files, user = pki.member(name, agent=True), pki.member("user")
    (tmp_path / "token").write_text(DASHBOARD_TOKEN + "\n")
    agent = mesh.agent(name, extra=(
        "--dashboard-token-file", str(tmp_path / "token"), "--tls-ca", str(files.ca),
        "--tls-cert", str(files.cert), "--tls-key", str(files.key), *extra))
    cli = ("--tls-ca", str(user.ca), "--tls-cert", str(user.cert), "--tls-key", str(user.key))
    return agent, ssl.create_default_context(cafile=str(files.ca)), cli


def listener(port: int) -> psutil.Process:
    """The process listening on ``port``, and that it listens on loopback only."""
    found = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
             and c.laddr and c.laddr.port == port]
    assert found and all(c.laddr.ip == "127.0.0.1" for c in found), found
    assert found[0].pid is not None
    return psutil.Process(found[0].pid)


async def through_proxy(
    base: str, task: str, token: str, tls: ssl.SSLContext,
    code: str = "print(6 * 7)", expect: str = "42",
) -> None:
    """Log in to the dashboard, then use Jupyter through it: REST and a kernel, which
    runs ``code`` and must print ``expect``."""
    jar = aiohttp.CookieJar(unsafe=True)  # cookies of an IP address
    async with aiohttp.ClientSession(cookie_jar=jar,
                                     connector=aiohttp.TCPConnector(ssl=tls)) as http:
        api = f"{base}/notebook/{task}/api"
        async with http.get(f"{api}/status", allow_redirects=False,
                            headers={"Authorization": f"token {token}"}) as r:
            assert r.status == 303 and r.headers["Location"] == "/login"  # no dashboard login
        async with http.post(f"{base}/login", data={"token": DASHBOARD_TOKEN},
                             allow_redirects=False) as r:
            assert r.status == 303
        async with http.get(f"{api}/status", headers={"Authorization": "token wrong"}) as r:
            assert r.status == 403  # Jupyter's own token is the second check
        auth = {"Authorization": f"token {token}"}
        async with http.get(f"{api}/status", headers=auth) as r:
            assert r.status == 200, await r.text()
            assert "kernels" in await r.json()
        async with http.get(f"{base}/notebook/{task}/lab?token={token}") as r:
            assert r.status == 200 and "JupyterLab" in await r.text()
        async with http.post(f"{api}/kernels", headers=auth, json={"name": "python3"}) as r:
            assert r.status == 201, await r.text()
            kernel = (await r.json())["id"]
        ws_url = f"{base.replace('https', 'wss')}/notebook/{task}/api/kernels/{kernel}/channels"
        async with http.ws_connect(ws_url, headers=auth) as ws:
            msg_id = uuid.uuid4().hex
            await ws.send_json({
                "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex,
                           "msg_type": "execute_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": code, "silent": False, "store_history": False,
                            "user_expressions": {}, "allow_stdin": False},
            })
            # The reply (shell) and the output (iopub) come on different channels, in no
            # set order; the kernel's "idle" status (iopub) comes after the request's output.
            printed, reply, idle = "", None, False
            async with asyncio.timeout(20):
                while reply is None or not idle:
                    msg = await ws.receive_json()
                    if msg["parent_header"].get("msg_id") != msg_id:
                        continue
                    if msg["msg_type"] == "stream":
                        printed += msg["content"]["text"]
                    elif msg["msg_type"] == "execute_reply":
                        reply = msg["content"]["status"]
                    elif msg["msg_type"] == "status":
                        idle = msg["content"]["execution_state"] == "idle"
            assert (printed.strip(), reply) == (expect, "ok")


def test_a_notebook_runs_as_a_task_behind_the_dashboard_and_stops_with_cancel(
    mesh: Mesh, tmp_path: Path
) -> None:
    agent, tls, cli_tls = guarded_agent(mesh, tmp_path)
    # No --python: the task runs in its agent's own interpreter ($HM_PYTHON).
    result = mesh.hm("notebook", "--workdir", str(tmp_path), "--wait", "40", "--json",
                     timeout=60)
    assert result.returncode == 0, result.stderr + mesh.logs()
    out = json.loads(result.stdout)
    wid, task, token = out["workflow"], out["task"], out["token"]
    assert (out["node"], out["via"]) == ("nb1", "dashboard")
    assert out["url"] == f"https://{agent.http_address}/notebook/{task}/lab?token={token}"

    # The token is told once: not in status, tasks, the dashboard's API or the task's log.
    shown = [mesh.hm("status", wid, "--json").stdout, mesh.hm("tasks", wid, "--json").stdout,
             mesh.hm("logs", task, *cli_tls, check=True).stdout]
    assert all(token not in text for text in shown)
    assert "/lab?token=..." in shown[2]  # Jupyter's log line, the token left out
    rows = json.loads(shown[1])
    jupyter = listener(int(rows[0]["attempts"][-1]["metrics"]["notebook_port"]))

    asyncio.run(through_proxy(f"https://{agent.http_address}", task, token, tls))
    kernels = [p for p in jupyter.children(recursive=True) if "ipykernel" in " ".join(p.cmdline())]
    assert kernels

    mesh.hm("cancel", wid, check=True)
    mesh.wait_state(wid, {"cancelled"}, timeout=20)
    for proc in [jupyter, *kernels]:
        wait_for(lambda p=proc: process_gone(p.pid), 15, f"{proc.pid} to exit")


def test_the_proxy_refuses_a_port_the_task_does_not_listen_on(mesh: Mesh) -> None:
    """A task that reports another service's port (here its agent's gRPC port) as its
    notebook gets no way to it through the dashboard."""
    agent = mesh.agent("nb2")
    grpc_port = agent.address.rpartition(":")[2]
    report = f"echo '{{\"notebook_port\": {grpc_port}}}' >> \"$HM_METRICS_FILE\"; sleep 60"
    recipe = mesh.write_recipe(json.dumps({"experiments": {"notebook": {"command": [report]}}}))
    wid = mesh.submit(recipe)
    task = f"{wid}.notebook.0"

    async def ask() -> tuple[int, str]:
        async with aiohttp.ClientSession() as http, http.get(
            f"http://{agent.http_address}/notebook/{task}/api"
        ) as r:
            return r.status, await r.text()

    def refused() -> tuple[int, str] | None:
        status, text = asyncio.run(ask())
        return (status, text) if status != 503 else None  # 503: no port reported yet

    status, text = wait_for(refused, 20, "the proxy to answer")  # type: ignore[misc]
    assert status == 502 and "listens on no port it reported" in text, text
    mesh.hm("cancel", wid, check=True)


def test_the_notebook_recipe_says_pools_data_and_hardware_as_a_recipe_does(
    tmp_path: Path,
) -> None:
    recipe = notebook_recipe(
        "nb", None, ("lab", "gpu"), ("raw=pipeline-raw@3", "ckpt=models"),
        {"gpus": 0.5, "gpu": "a100"}, "8h", "secret-token", tmp_path)
    exp = recipe.experiment("notebook")
    assert exp.pools == ("lab", "gpu")
    assert dict(exp.data) == {"raw": "pipeline-raw@3", "ckpt": "models"}
    assert (exp.hardware.gpus, exp.hardware.gpu) == (0.5, "a100")
    assert exp.timeout == 8 * 3600
    assert exp.env["JUPYTER_TOKEN"] == "secret-token"
    assert exp.command == (f'"${{HM_PYTHON:-python3}}" -m {TASK_MODULE}',)
    assert recipe.workdir == str(tmp_path)

    # Without options: any pool, no data, no hardware beyond a task's default.
    bare = notebook_recipe("nb", "/opt/my env/python", (), (), {}, None, "t", tmp_path)
    exp = bare.experiment("notebook")
    assert (exp.pools, dict(exp.data), exp.hardware.gpus, exp.timeout) == ((), {}, 0.0, None)
    assert exp.command == (f"'/opt/my env/python' -m {TASK_MODULE}",)


@pytest.mark.parametrize("item", ["raw", "=pipeline-raw", "raw=", "raw:pipeline-raw"])
def test_a_data_option_without_alias_and_data_set_is_a_usage_error(
    item: str, tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match=r"give ALIAS=DATASET\[@VERSION\]"):
        notebook_recipe("nb", None, (), ("ok=set", item), {}, None, "t", tmp_path)


def test_a_notebook_with_pool_and_data_runs_in_its_pool_and_reads_the_data_set(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    """Two pools of agents sharing one store: ``--pool lab`` puts the notebook on the lab
    node, and its kernel reads the data set ``--data raw=...`` mounted there."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "rows.csv").write_text("x,y\n1,2\n")
    put_dataset(store, src, "nb-raw", chunk_size=4 << 20)
    with_store = ("--store", store_url, "--cache-size", "64MiB")
    guarded_agent(mesh, tmp_path, "plain1", (*with_store, "--pool", "default"))
    agent, tls, _ = guarded_agent(mesh, tmp_path, "lab1", (*with_store, "--pool", "lab"))

    bad = mesh.hm("notebook", "--data", "raw", "--wait", "5")
    assert bad.returncode == 2 and "give ALIAS=DATASET[@VERSION]" in bad.stderr, bad.stderr
    assert mesh.hm_json("status") == []  # nothing submitted

    result = mesh.hm("notebook", "--pool", "lab", "--data", "raw=nb-raw", "--workdir",
                     str(tmp_path), "--wait", "40", "--json", timeout=60)
    assert result.returncode == 0, result.stderr + mesh.logs()
    out = json.loads(result.stdout)
    wid, task, token = out["workflow"], out["task"], out["token"]
    assert (out["node"], out["via"]) == ("lab1", "dashboard")

    code = ("import os; d = os.environ['HM_DATA_RAW']; "
            "print(sorted(n for n in os.listdir(d) if not n.startswith('.')), "
            "open(os.path.join(d, 'rows.csv')).read().split(), os.environ['HM_DATA'] == d)")
    asyncio.run(through_proxy(f"https://{agent.http_address}", task, token, tls, code,
                              "['rows.csv'] ['x,y', '1,2'] True"))

    mesh.hm("cancel", wid, check=True)
    mesh.wait_state(wid, {"cancelled"}, timeout=20)
