"""The dashboard's way to a notebook: ``/notebook/TASK_ID/...`` proxied to the Jupyter
server a notebook task runs on this node's loopback (``hypermesh notebook``).

A notebook listens on ``127.0.0.1`` only (``notebook_task.py``); a person reaches it
through the agent's dashboard, so it gets what the dashboard has: the Host check, the
login (with a dashboard token) and HTTPS with the mesh certificate (``dashboard_auth.py``,
``hypermesh.exposure``). The route is registered with the others (``dashboard.py``), behind
the same middleware. HTTP requests of any method and websockets (Jupyter's kernels, its
terminals) are passed both ways; Jupyter's own token stays the second check.

Where to: the task must hold a claim of this node, and the port is the one the task
reported for that attempt (its metric ``notebook_port`` in etcd). The port is used only
when a process listening on it on loopback belongs to that task (``HM_TASK_ID`` in its
environment): whatever a task reports, the proxy reaches no other local service (etcd,
the agent's own ports, another task's notebook). What it found is kept per task until the
process is gone.

What Jupyter does not get: the dashboard's session cookies (``hypermesh_session_*``) and
a ``Bearer`` token (the dashboard's), so the code a notebook runs never sees the
dashboard's credentials; and hop-by-hop headers. ``Host`` passes as the browser sent it,
so Jupyter's check of a websocket's ``Origin`` holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, NamedTuple, Protocol

import aiohttp
import psutil
from aiohttp import web
from yarl import URL

from hypermesh.state.keyspace import TaskRef
from hypermesh.state.mirror import Mirror

if TYPE_CHECKING:
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace

log = logging.getLogger("hypermesh.agent")

METRIC = "notebook_port"  # what notebook_task.py reports
SESSION_COOKIE = "hypermesh_session_"  # prefix of every dashboard's cookie (dashboard_auth.py)
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "content-length",
})
WS_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                        "sec-websocket-protocol", "sec-websocket-accept"})
CONNECT_S = 5.0  # how long connecting to the notebook may take
WS_MAX_MESSAGE = 64 * 1024 * 1024  # bytes: a larger kernel message closes the websocket


class NotebookAgent(Protocol):
    """What the proxy reads of the agent (the dashboard's agent; it changes none of it)."""

    cfg: AgentConfig
    ks: Keyspace
    etcd: Etcd


class Target(NamedTuple):
    """A notebook found: its loopback port and the process that listens there."""

    port: int
    process: psutil.Process


def _listener(port: int, task_id: str) -> psutil.Process | None:
    """The process listening on 127.0.0.1:``port`` when it belongs to task ``task_id``."""
    for conn in psutil.net_connections(kind="tcp4"):
        if (conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
                and conn.laddr.ip == "127.0.0.1" and conn.pid is not None):
            try:
                proc = psutil.Process(conn.pid)
                if proc.environ().get("HM_TASK_ID") == task_id:
                    return proc
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return None
    return None


def forwarded_headers(request: web.Request) -> dict[str, str]:
    """The request's headers as Jupyter gets them (see the module's docstring)."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        low = name.lower()
        if low in HOP_BY_HOP or low in WS_HEADERS:
            continue
        if low == "authorization" and value[:7].lower() == "bearer ":
            continue
        if low == "cookie":
            kept = [c for c in value.split(";") if not c.strip().startswith(SESSION_COOKIE)]
            if not any(c.strip() for c in kept):
                continue
            value = ";".join(kept).strip()
        out[name] = value
    return out


class NotebookProxy:
    """The ``/notebook/TASK_ID/...`` handler. Its cache of targets is its only state,
    changed by its own requests."""

    def __init__(self, agent: NotebookAgent) -> None:
        self.agent = agent
        self.targets: dict[str, Target] = {}
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
            )
        return self._session

    async def close(self, _app: web.Application | None = None) -> None:
        if self._session is not None:
            await self._session.close()

    async def target(self, task_id: str) -> Target:
        """The notebook of ``task_id`` on this node, or an HTTP error saying why not."""
        found = self.targets.get(task_id)
        if found is not None and found.process.is_running():
            return found
        self.targets.pop(task_id, None)
        try:
            ref = TaskRef.parse(task_id)
        except ValueError as exc:
            raise web.HTTPNotFound(text=f"{exc}\n") from exc
        a = self.agent
        mirror = Mirror(a.ks)
        claim_key = a.ks.claim(ref)
        got = await a.etcd.get(claim_key)
        if got is not None:
            mirror.apply(claim_key, got[0], 0, got[1])
        claim = mirror.claims.get(ref)
        if claim is None or claim.node != a.cfg.name:
            raise web.HTTPNotFound(text=f"no notebook of task {task_id} runs on {a.cfg.name}\n")
        metrics_key = a.ks.metrics(ref, claim.attempt)
        got = await a.etcd.get(metrics_key)
        if got is not None:
            mirror.apply(metrics_key, got[0], 0, got[1])
        reported = mirror.metrics.get(ref, {}).get(claim.attempt)
        port = reported.last.get(METRIC) if reported else None
        if not port or port != int(port) or not 0 < port < 65536:
            raise web.HTTPServiceUnavailable(text=f"the notebook of {task_id} is starting\n")
        process = await asyncio.to_thread(_listener, int(port), task_id)
        if process is None:
            log.warning("notebook proxy: port %s reported by %s is not that task's", port,
                        task_id)
            raise web.HTTPBadGateway(text=f"task {task_id} listens on no port it reported\n")
        found = self.targets[task_id] = Target(int(port), process)
        return found

    async def handle(self, request: web.Request) -> web.StreamResponse:
        found = await self.target(request.match_info["task"])
        url = URL(f"http://127.0.0.1:{found.port}{request.raw_path}", encoded=True)
        headers = forwarded_headers(request)
        try:
            if request.headers.get("Upgrade", "").lower() == "websocket":
                return await self._websocket(request, url, headers)
            return await self._http(request, url, headers)
        except aiohttp.ClientConnectionError as exc:
            self.targets.pop(request.match_info["task"], None)
            raise web.HTTPBadGateway(text=f"the notebook did not answer: {exc}\n") from exc

    async def _http(self, request: web.Request, url: URL,
                    headers: dict[str, str]) -> web.StreamResponse:
        body = request.content if request.body_exists else None
        async with self.session().request(request.method, url, headers=headers, data=body,
                                          allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers.add(name, value)
            if upstream.content_length is not None:  # the bytes pass as they came
                response.content_length = upstream.content_length
            # Jupyter's CSP allows framing by itself; the dashboard's default is DENY.
            response.headers.setdefault("X-Frame-Options", "SAMEORIGIN")
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _websocket(self, request: web.Request, url: URL,
                         headers: dict[str, str]) -> web.StreamResponse:
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "")
                     .split(",") if p.strip()]
        async with self.session().ws_connect(url, headers=headers, protocols=protocols,
                                             max_msg_size=WS_MAX_MESSAGE) as upstream:
            client = web.WebSocketResponse(
                protocols=[upstream.protocol] if upstream.protocol else (),
                max_msg_size=WS_MAX_MESSAGE)
            client.headers["X-Frame-Options"] = "SAMEORIGIN"
            await client.prepare(request)
            pumps = [asyncio.create_task(_pump(client, upstream)),
                     asyncio.create_task(_pump(upstream, client))]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                with contextlib.suppress(Exception):
                    await client.close()
            return client


async def _pump(source: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse) -> None:
    """Pass messages from ``source`` to ``sink`` until either side closes."""
    async for message in source:
        if message.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        else:
            break
    await sink.close()


def add_notebook_routes(app: web.Application, agent: NotebookAgent) -> None:
    """Register ``/notebook/TASK_ID/...`` (every method, websockets too) on ``app``."""
    proxy = NotebookProxy(agent)
    app.router.add_route("*", "/notebook/{task}/{tail:.*}", proxy.handle)
    app.on_cleanup.append(proxy.close)
