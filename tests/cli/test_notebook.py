"""``hypermesh notebook`` end to end: a real agent (mutual-TLS files, a dashboard with a
login over HTTPS), a real JupyterLab started as a task, reached through the agent's proxy
(HTTP and a kernel's websocket), stopped by ``cancel``; and the proxy's refusal of a port
that is not the task's own."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from pathlib import Path

import aiohttp
import psutil

from hypermesh.local.agents import AgentProcess
from hypermesh.local.pki import LocalPki
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone

DASHBOARD_TOKEN = "notebook-dashboard-token-0123456789"


def guarded_agent(
    mesh: Mesh, tmp_path: Path
) -> tuple[AgentProcess, ssl.SSLContext, tuple[str, ...]]:
    """An agent with its mesh TLS files and a dashboard token: its dashboard is HTTPS
    behind a login. Returns it, a client context that trusts the mesh CA, and the CLI's
    ``--tls-*`` options (a user's certificate) for commands that reach the agent."""
    pki = LocalPki(tmp_path / "pki")
    files, user = pki.member("nb1", agent=True), pki.member("user")
    (tmp_path / "token").write_text(DASHBOARD_TOKEN + "\n")
    agent = mesh.agent("nb1", extra=(
        "--dashboard-token-file", str(tmp_path / "token"), "--tls-ca", str(files.ca),
        "--tls-cert", str(files.cert), "--tls-key", str(files.key)))
    cli = ("--tls-ca", str(user.ca), "--tls-cert", str(user.cert), "--tls-key", str(user.key))
    return agent, ssl.create_default_context(cafile=str(files.ca)), cli


def listener(port: int) -> psutil.Process:
    """The process listening on ``port``, and that it listens on loopback only."""
    found = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
             and c.laddr and c.laddr.port == port]
    assert found and all(c.laddr.ip == "127.0.0.1" for c in found), found
    assert found[0].pid is not None
    return psutil.Process(found[0].pid)


async def through_proxy(base: str, task: str, token: str, tls: ssl.SSLContext) -> None:
    """Log in to the dashboard, then use Jupyter through it: REST and a kernel."""
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
                "content": {"code": "print(6 * 7)", "silent": False, "store_history": False,
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
            assert (printed.strip(), reply) == ("42", "ok")


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
