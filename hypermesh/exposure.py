"""Safe defaults for what an agent listens on: plaintext only on loopback.

An agent's gRPC port without TLS, its dashboard and its metrics (plain HTTP, no
authentication) may listen on a loopback address; anywhere else they need the
operator to say ``--insecure``, and the agent then warns at every start
(``exposed``). The dashboard may listen beyond loopback without ``--insecure`` only
behind its login (a dashboard token) and over HTTPS (the agent's mesh certificate,
``dashboard_https``). ``check_exposure`` is the rule, applied when an
``AgentConfig`` is built, so a refused agent never binds a port.

The dashboard token (``--dashboard-token-file``, env ``HYPERMESH_DASHBOARD_TOKEN``)
is read here too (``dashboard_token``), so that a short one is refused at start.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from hypermesh.errors import UsageError


class Listeners(Protocol):
    """What ``warn_exposed`` reads of an agent's configuration (``AgentConfig``)."""

    @property
    def listen(self) -> str: ...
    @property
    def tls(self) -> Any: ...
    @property
    def insecure(self) -> bool: ...
    @property
    def metrics_listen(self) -> str | None: ...
    @property
    def http_listen(self) -> str | None: ...
    @property
    def dashboard_token(self) -> str | None: ...

ENV_DASHBOARD_TOKEN = "HYPERMESH_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16
"""Shortest dashboard token accepted: 16 random characters are beyond guessing at the
one failed login a second the dashboard allows (``agent/ops/dashboard_auth.py``)."""

log = logging.getLogger("hypermesh.agent")


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names a loopback host (127.0.0.0/8, ::1, localhost)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or '' / 0.0.0.0: every interface) may be reachable


def dashboard_https(http_listen: str | None, tls: bool, token: bool) -> bool:
    """Whether the dashboard is served over HTTPS with the agent's mesh certificate: when
    the agent has its TLS files and the dashboard either needs a login (a token is set)
    or listens beyond loopback. On loopback without a login nothing secret crosses, and
    plain HTTP spares a browser the mesh CA's warning."""
    if http_listen is None or not tls:
        return False
    return token or not is_loopback(http_listen)


def exposed(
    listen: str, tls: bool, metrics_listen: str | None, http_listen: str | None,
    dashboard_token: bool = False,
) -> list[str]:
    """The unprotected listeners reachable beyond this machine, as ``--option ADDRESS``."""
    out = []
    if not tls and not is_loopback(listen):
        out.append(f"--listen {listen} (gRPC without TLS)")
    if http_listen is not None and not is_loopback(http_listen):
        if not dashboard_token:
            out.append(f"--http-listen {http_listen} (dashboard without a login)")
        elif not tls:
            out.append(f"--http-listen {http_listen} (dashboard login over plain HTTP)")
    if metrics_listen is not None and not is_loopback(metrics_listen):
        out.append(f"--metrics-listen {metrics_listen} (metrics, plain HTTP)")
    return out


def check_exposure(
    listen: str, tls: bool, insecure: bool, metrics_listen: str | None, http_listen: str | None,
    dashboard_token: bool = False,
) -> None:
    """Raise ``UsageError`` when a plaintext listener is off loopback without ``insecure``."""
    found = exposed(listen, tls, metrics_listen, http_listen, dashboard_token)
    if found and not insecure:
        dashboard = any(f.startswith("--http-listen") for f in found)
        raise UsageError(
            f"refusing to serve plaintext beyond this machine: {'; '.join(found)}. "
            "Give --tls-ca, --tls-cert and --tls-key (mutual TLS on gRPC, HTTPS for the "
            "dashboard; see `hypermesh tls`), "
            + ("a dashboard login token (--dashboard-token-file or "
               f"{ENV_DASHBOARD_TOKEN}), " if dashboard else "")
            + "keep the dashboard and metrics on 127.0.0.1, or say --insecure to accept it"
        )


def dashboard_token(token_file: Path | None, env: bool = True) -> str | None:
    """The dashboard's login token: the first line of ``token_file`` (which keeps it out
    of ``ps``), else env ``HYPERMESH_DASHBOARD_TOKEN`` (with ``env``); None when neither
    is given. A file that cannot be read is a ``UsageError``; the length is checked by
    ``check_token``."""
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--dashboard-token-file {token_file}: {exc.strerror}") from exc
        return lines[0].strip() if lines else ""
    value = os.environ.get(ENV_DASHBOARD_TOKEN) if env else None
    return value.strip() if value else None


def check_token(token: str | None) -> None:
    """Refuse a dashboard token that is short enough to guess, or not printable ASCII
    (it travels in a form field and an ``Authorization`` header)."""
    if token is None:
        return
    if len(token) < MIN_TOKEN_CHARS:
        raise UsageError(
            f"the dashboard token (--dashboard-token-file or {ENV_DASHBOARD_TOKEN}) has "
            f"{len(token)} characters: give at least {MIN_TOKEN_CHARS}, e.g. "
            "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    if not token.isascii() or not token.isprintable() or " " in token:
        raise UsageError("the dashboard token must be printable ASCII without spaces")


def warn_exposed(cfg: Listeners) -> None:
    """Log a warning for each plaintext listener ``--insecure`` let off loopback (at
    every start, so that the choice stays visible)."""
    found = exposed(cfg.listen, cfg.tls is not None, cfg.metrics_listen, cfg.http_listen,
                    cfg.dashboard_token is not None)
    for what in found:
        log.warning("--insecure: %s is reachable from other machines unprotected",
                    what)
    if cfg.insecure and not found:
        log.warning("--insecure given, but every plaintext listener is on loopback")
