"""The web dashboard every agent serves (``agent start --http-listen``).

One static page (``static/index.html`` and ``static/app.js``, no build step,
nothing fetched from elsewhere) and a few JSON endpoints, served by aiohttp on the
agent's own event loop. The endpoints answer from what the agent already holds:
its mirror of the namespace (the same ``MeshView`` functions the CLI uses for
``status`` and ``tasks``), its gossip table (``nodes``) and the attempt log reader
that ``hypermesh logs`` uses. The page polls them once a second while it is open;
the server does no work of its own when nobody looks.

- ``GET /api/workflows``: ``status --json`` of every workflow, newest first.
- ``GET /api/workflows/WID``: its status, its DAG (experiments with ``after``, live
  changes and the names of the variables their tasks get: ``env`` values show as ``***``)
  and ``tasks --json``.
- ``GET /api/nodes``: ``nodes --all --json`` as this agent sees the mesh, plus each
  node's dashboard address and its latest telemetry with per-task usage (asked of
  every node at once, each for at most ``TELEMETRY_WAIT_S``; one that does not
  answer shows none).
- ``GET /api/logs/TASK_ID?attempt=N&offset=K``: the attempt's log from byte K on
  (at most ``LOG_PAGE`` bytes), and whether the attempt still runs.
- ``GET /api/workflows/WID/trials?experiment=E&metric=M&goal=G``: the trials view of an
  experiment (``trials.py``): its trials ranked by the objective (or metric ``M``), with
  parameters, last metric values, states and the objective's curves, bounded in size.

The charts are drawn by Apache ECharts, vendored as its built ``echarts.min.js`` with
its licences under ``static/vendor/`` and served from the agent like the page.

Every route is GET (``/login``'s form post aside); every request passes the Host
check and, with a dashboard token, the login first (``dashboard_auth.py``). With the
agent's TLS files the dashboard is served over HTTPS when it needs a login or
listens beyond loopback (``hypermesh.exposure.dashboard_https``).
"""

from __future__ import annotations

import json
import socket
import ssl
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from hypermesh.agent.ops.dashboard_auth import HostCheck, Login, add_login_routes, guard
from hypermesh.agent.ops.notebook_proxy import add_notebook_routes
from hypermesh.agent.ops.telemetry_client import fetch_telemetry, message_json
from hypermesh.agent.ops.trials import TrialsError, experiment_trials
from hypermesh.agent.tasks.logs import stream_log
from hypermesh.errors import HypermeshError, NotFound
from hypermesh.exposure import dashboard_https
from hypermesh.recipe.redact import shown_task_env
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.node_rows import gossip_table, node_rows
from hypermesh.state.pools import parse_pools, usage_cost

if TYPE_CHECKING:
    from hypermesh.agent.gossip.duty import Gossip
    from hypermesh.agent.ops.telemetry import Telemetry
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

LOG_PAGE = 1 << 20  # most bytes of a log one request returns
TELEMETRY_WAIT_S = 1.0  # how long /api/nodes waits for a node's telemetry (page polls at 1 s)
STATIC = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
          "/trials.js": ("trials.js", "text/javascript"),
          "/vendor/echarts.min.js": ("vendor/echarts.min.js", "text/javascript")}
VENDOR_MAX_AGE_S = 24 * 3600  # browsers keep the vendored library a day (1.1 MB, 370 KB gzip)


def _static(name: str) -> bytes:
    return resources.files("hypermesh.agent.ops").joinpath("static", *name.split("/")).read_bytes()


class DashboardAgent(Protocol):
    """What the dashboard reads of the agent (it changes none of it)."""

    cfg: AgentConfig
    ks: Keyspace
    etcd: Etcd
    view: MeshView
    gossip: Gossip
    telemetry: Telemetry
    metrics_address: str

    async def read_view(self) -> MeshView: ...


class Dashboard:
    """Request handlers; they read the agent's state and never change it."""

    def __init__(self, agent: DashboardAgent) -> None:
        self.agent = agent

    async def page(self, request: web.Request) -> web.Response:
        name, kind = STATIC[request.path]
        vendored = name.startswith("vendor/")
        cache = f"max-age={VENDOR_MAX_AGE_S}" if vendored else "no-cache"
        response = web.Response(body=_static(name), content_type=kind,
                                headers={"Cache-Control": cache})
        if vendored:
            response.enable_compression()  # gzip when the browser takes it
        return response

    @staticmethod
    def _summaries(view: MeshView, wids: list[str]) -> list[dict[str, Any]]:
        """``status --json`` of these workflows, cost included, from the agent's view."""
        pools = parse_pools(view.pools)
        return [
            view.workflow_summary(w)
            | {"cost": usage_cost(view.workflow_usage.get(w, ({}, 0))[0], pools)}
            for w in wids
        ]

    async def workflows(self, request: web.Request) -> web.Response:
        view = await self.agent.read_view()
        ids = sorted(view.workflows, key=lambda w: view.workflows[w].submitted_at, reverse=True)
        return web.json_response(
            {
                "node": self.agent.cfg.name,
                "leader": view.leader(),
                "namespace": self.agent.ks.namespace,
                "workflows": self._summaries(view, ids),
            }
        )

    async def workflow(self, request: web.Request) -> web.Response:
        view = await self.agent.read_view()
        wid = request.match_info["wid"]
        wf = view.workflows.get(wid)
        if wf is None:
            raise _error(web.HTTPNotFound, f"no workflow {wid!r}")
        dag = []
        for exp in wf.recipe.experiments:
            control = view.control(wid, exp.name)
            dag.append(
                {
                    "name": exp.name,
                    "after": list(exp.after),
                    "workers": view.workers(wid, exp),
                    "cancelled": control.cancelled,
                    "extra_samples": control.extra_samples,
                }
                | shown_task_env(exp)  # env values never leave the agent: recipe/redact.py
            )
        return web.json_response(
            {
                "status": self._summaries(view, [wid])[0],
                "dag": dag,
                "tasks": view.task_rows(wid),
            }
        )

    async def trials(self, request: web.Request) -> web.Response:
        view = await self.agent.read_view()
        wid = request.match_info["wid"]
        if wid not in view.workflows:
            raise _error(web.HTTPNotFound, f"no workflow {wid!r}")
        q = request.query
        try:
            body = experiment_trials(view, wid, q.get("experiment") or None,
                                     q.get("metric") or None, q.get("goal") or None)
        except NotFound as exc:
            raise _error(web.HTTPNotFound, str(exc)) from exc
        except TrialsError as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from exc
        return web.json_response(body)

    async def nodes(self, request: web.Request) -> web.Response:
        a = self.agent
        view = await a.read_view()
        rows = node_rows(view, gossip_table(a.gossip.members()), a.cfg.name, True)
        telemetry = await self._telemetry([r["name"] for r in rows if r["address"]])
        for row in rows:
            node = view.nodes.get(row["name"])
            row["http"] = node.http_address if node else None
            t = telemetry.get(row["name"])
            row["telemetry"] = t["latest"] if t else None
            row["nvml"] = t["nvml"] if t else None
            row["task_usage"] = t["tasks"] if t else []
            row["caches"] = t["caches"] if t else []
        return web.json_response({"node": a.cfg.name, "nodes": rows})

    async def _telemetry(self, names: list[str]) -> dict[str, dict[str, Any] | None]:
        """Each live node's telemetry: this node's from memory, the others' over gRPC
        on the agent's gossip channels, all at once, each within ``TELEMETRY_WAIT_S``."""
        a = self.agent
        peers = {
            n: a.view.nodes[n].address for n in names if n != a.cfg.name and n in a.view.nodes
        }
        out = await fetch_telemetry(peers, 0, TELEMETRY_WAIT_S, a.gossip.channel)
        if a.cfg.name in names:
            out[a.cfg.name] = message_json(
                a.telemetry.message(a.cfg.name, 0, a.metrics_address, a.gossip.caches)
            )
        return out

    async def logs(self, request: web.Request) -> web.Response:
        try:
            ref = TaskRef.parse(request.match_info["task"])
            attempt = int(request.query.get("attempt", "0"))
            offset = max(0, int(request.query.get("offset", "0")))
        except ValueError as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from exc
        a = self.agent
        attempts = (await a.read_view()).attempts.get(ref, {})
        n = attempt or (max(attempts) if attempts else 0)
        chunks: list[bytes] = []
        notes: list[str] = []
        size = 0
        try:
            async for data in stream_log(
                a.etcd, a.ks, ref, n, False, a.cfg.store, notes.append, offset, a.cfg.tls
            ):
                chunks.append(data)
                size += len(data)
                if size >= LOG_PAGE:
                    break
        except NotFound as exc:
            raise _error(web.HTTPNotFound, str(exc)) from exc
        except HypermeshError as exc:
            raise _error(web.HTTPBadGateway, str(exc)) from exc
        data = b"".join(chunks)[:LOG_PAGE]
        record = attempts.get(n)
        return web.json_response(
            {
                "task": ref.id,
                "attempt": n,
                "offset": offset + len(data),
                "text": data.decode("utf-8", errors="replace"),
                "running": record is not None and record.state == "running",
                "note": "; ".join(notes),
            }
        )


def _error(kind: type[web.HTTPError], message: str) -> web.HTTPError:
    return kind(text=json.dumps({"error": message}), content_type="application/json")


def make_app(agent: DashboardAgent, port: int, https: bool) -> web.Application:
    """The dashboard's routes behind the Host check and (with a token) the login."""
    cfg = agent.cfg
    d = Dashboard(agent)
    login = Login(cfg.dashboard_token, port, https)
    app = web.Application(middlewares=[guard(HostCheck(cfg.dashboard_hosts), login)],
                          client_max_size=64 * 1024)
    add_login_routes(app, login)
    for path in STATIC:
        app.router.add_get(path, d.page)
    app.router.add_get("/api/workflows", d.workflows)
    app.router.add_get("/api/workflows/{wid}", d.workflow)
    app.router.add_get("/api/workflows/{wid}/trials", d.trials)
    app.router.add_get("/api/nodes", d.nodes)
    app.router.add_get("/api/logs/{task}", d.logs)
    add_notebook_routes(app, agent)  # /notebook/TASK_ID/...: notebook_proxy.py
    return app


def https_context(agent: DashboardAgent) -> ssl.SSLContext | None:
    """The server side of HTTPS with the agent's mesh certificate (no client
    certificate asked: browsers have none), or None where the dashboard is plain HTTP."""
    cfg = agent.cfg
    if cfg.tls is None or not dashboard_https(cfg.http_listen, True,
                                              cfg.dashboard_token is not None):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cfg.tls.cert, cfg.tls.key)
    return context


async def serve(agent: DashboardAgent, sock: socket.socket) -> web.AppRunner:
    """Serve the dashboard on the bound ``sock``; ``cleanup()`` of the runner stops it."""
    context = https_context(agent)
    app = make_app(agent, sock.getsockname()[1], context is not None)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=context).start()
    return runner
