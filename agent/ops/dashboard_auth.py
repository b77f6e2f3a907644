"""Who may read the web dashboard: the Host check and the login.

Both run as one aiohttp middleware (``guard``) in front of every route, the unknown
ones included, before any handler reads the agent's state.

- Host check, always (loopback too: DNS rebinding points a name the attacker owns
  at 127.0.0.1, and the browser then sends that name as ``Host``). A request is
  served only when its ``Host`` names an IP address (a browser sends one only when
  the URL holds it, so the request reached that address and no DNS name was
  involved), ``localhost``, this machine's host name, or a name the operator added
  (``--dashboard-host NAME`` matches NAME at any port, ``NAME:PORT`` at that port
  only). The port is not compared otherwise: it plays no part in rebinding, and
  ``kubectl port-forward`` or a proxy changes it. Anything else: 403, plain text.
- Login, when the agent has a dashboard token (``AgentConfig.dashboard_token``).
  A request passes with a session cookie issued by ``POST /login`` (a random id
  kept in this process's memory for ``SESSION_S``; never the token) or with
  ``Authorization: Bearer TOKEN``. Otherwise pages redirect to ``/login`` and
  ``/api`` answers 401. A wrong token answers 403 and is logged; wrong tokens are
  answered one at a time, ``FAIL_DELAY_S`` apart, so guessing runs at one try a
  second for the whole process. ``POST /login`` is the only route that is not GET
  or HEAD, and it also requires that a browser's ``Origin`` names this dashboard.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import ipaddress
import logging
import secrets
import socket
import time
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

log = logging.getLogger("hypermesh.agent")

SESSION_S = 12 * 3600  # a browser session's life: the operator logs in again after it
MAX_SESSIONS = 1000  # sessions kept; the oldest is dropped past this
FAIL_DELAY_S = 1.0  # each wrong token waits this long, one after the other
MAX_WAITING_FAILURES = 16  # wrong tokens waiting at once; more are answered 429 at once
LOOPBACK_NAMES = frozenset({"localhost"})

LOGIN_FORM = """<!doctype html>
<html><head><meta charset="utf-8"><title>hypermesh: log in</title>
<style>body{{font:15px system-ui,sans-serif;margin:4em auto;max-width:24em}}
input{{font:inherit;width:100%;margin:.4em 0;padding:.3em}}</style></head>
<body><h1>hypermesh</h1><p>{message}</p>
<form method="post" action="/login">
<input type="password" name="token" autocomplete="current-password" autofocus
 placeholder="dashboard token" aria-label="dashboard token">
<input type="submit" value="Log in"></form></body></html>
"""


def split_host(header: str) -> tuple[str, str]:
    """(host, port) of a ``Host`` header value, lower case; port "" when absent. An
    IPv6 address loses its brackets; a trailing dot of a name is dropped."""
    value = header.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        host, port = value, ""
    return host.rstrip("."), port


class HostCheck:
    """The ``Host`` values this dashboard answers to (see the module's docstring).
    Fixed once built; read by every request."""

    def __init__(self, extra: tuple[str, ...], machine: str | None = None) -> None:
        names = set(LOOPBACK_NAMES)
        names.add((machine if machine is not None else socket.gethostname()).lower())
        self.any_port = names | {n for n in extra if ":" not in n}
        self.with_port = {n for n in extra if ":" in n}

    def allows(self, header: str | None) -> bool:
        if not header:
            return False
        host, port = split_host(header)
        if host in self.any_port or f"{host}:{port}" in self.with_port:
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True


class Login:
    """The dashboard's sessions and the check of its token. ``token`` None: no login.
    Only the middleware and the ``/login`` handlers change its sessions."""

    def __init__(self, token: str | None, port: int, https: bool) -> None:
        self.token = token
        self.https = https
        self.cookie = f"hypermesh_session_{port}"  # agents on one host keep apart cookies
        self.sessions: dict[str, float] = {}  # session id -> expiry (time.monotonic)
        self._fail_lock = asyncio.Lock()
        self._waiting = 0

    def _token_ok(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _session_ok(self, request: web.Request) -> bool:
        sid = request.cookies.get(self.cookie, "")
        expiry = self.sessions.get(sid)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self.sessions[sid]
            return False
        return True

    def new_session(self) -> str:
        now = time.monotonic()
        for sid in [s for s, expiry in self.sessions.items() if expiry < now]:
            del self.sessions[sid]
        while len(self.sessions) >= MAX_SESSIONS:
            del self.sessions[next(iter(self.sessions))]  # the oldest
        sid = secrets.token_urlsafe(32)
        self.sessions[sid] = now + SESSION_S
        return sid

    async def failed(self, request: web.Request, how: str) -> web.Response:
        """Log a wrong token and answer it after this process's earlier wrong ones,
        ``FAIL_DELAY_S`` each."""
        log.warning("dashboard: wrong token (%s) from %s", how, request.remote)
        if self._waiting >= MAX_WAITING_FAILURES:
            return web.Response(status=429, text="too many failed logins: try again later\n")
        self._waiting += 1
        try:
            async with self._fail_lock:
                await asyncio.sleep(FAIL_DELAY_S)
        finally:
            self._waiting -= 1
        return _forbidden("wrong token")

    async def check(self, request: web.Request) -> web.StreamResponse | None:
        """None when ``request`` may be served; else the answer it gets instead."""
        if self.token is None or self._session_ok(request):
            return None
        auth = request.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            return None if self._token_ok(auth[7:].strip()) else await self.failed(
                request, "bearer")
        if request.method in ("GET", "HEAD") and not request.path.startswith("/api/"):
            return _see_other("/login")
        return web.json_response(
            {"error": "login required: log in at /login or send Authorization: Bearer TOKEN"},
            status=401, headers={"WWW-Authenticate": 'Bearer realm="hypermesh"'},
        )

    async def form(self, request: web.Request) -> web.Response:
        return _login_page("Log in with the dashboard token the operator set.")

    async def submit(self, request: web.Request) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc.lower() != request.headers.get(
            "Host", ""
        ).lower():
            return _forbidden("cross-origin login refused")
        form = await request.post()
        given = form.get("token")
        if not isinstance(given, str) or not self._token_ok(given.strip()):
            answer = await self.failed(request, "login form")
            if answer.status != 403:
                return answer
            return _login_page("Wrong token.", status=403)
        response = _see_other("/")
        response.set_cookie(self.cookie, self.new_session(), max_age=SESSION_S, path="/",
                            httponly=True, samesite="Strict", secure=self.https)
        log.info("dashboard: a login from %s", request.remote)
        return response


def _see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})


def _forbidden(reason: str) -> web.Response:
    return web.Response(status=403, text=f"forbidden: {reason}\n")


def _login_page(message: str, status: int = 200) -> web.Response:
    return web.Response(status=status, text=LOGIN_FORM.format(message=html.escape(message)),
                        content_type="text/html", headers={"Cache-Control": "no-store"})


def guard(hosts: HostCheck, login: Login) -> Middleware:
    """The middleware: the Host check, then (with a token) the login, then the route."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not hosts.allows(host):
            log.warning("dashboard: refused Host %r from %s", host, request.remote)
            return _forbidden(f"this dashboard does not answer to Host {host!r} "
                              "(see --dashboard-host)")
        if login.token is not None and request.path != "/login":
            refused = await login.check(request)
            if refused is not None:
                return refused
        response = await handler(request)
        response.headers.setdefault("X-Frame-Options", "DENY")
        return response

    return middleware


def add_login_routes(app: web.Application, login: Login) -> None:
    if login.token is not None:
        app.router.add_get("/login", login.form)
        app.router.add_post("/login", login.submit)
