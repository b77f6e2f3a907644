"""Safe defaults for what an agent listens on: plaintext only on loopback.

An agent's gRPC port without TLS, its dashboard and its metrics (plain HTTP, no
authentication) may listen on a loopback address; anywhere else they need the
operator to say ``--insecure``, and the agent then warns at every start
(``exposed``). ``check_exposure`` is the rule, applied when an ``AgentConfig`` is
built, so a refused agent never binds a port.
"""

from __future__ import annotations

import ipaddress
import logging
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


def exposed(
    listen: str, tls: bool, metrics_listen: str | None, http_listen: str | None
) -> list[str]:
    """The plaintext listeners reachable beyond this machine, as ``--option ADDRESS``."""
    out = []
    if not tls and not is_loopback(listen):
        out.append(f"--listen {listen} (gRPC without TLS)")
    if http_listen is not None and not is_loopback(http_listen):
        out.append(f"--http-listen {http_listen} (dashboard, plain HTTP)")
    if metrics_listen is not None and not is_loopback(metrics_listen):
        out.append(f"--metrics-listen {metrics_listen} (metrics, plain HTTP)")
    return out


def check_exposure(
    listen: str, tls: bool, insecure: bool, metrics_listen: str | None, http_listen: str | None
) -> None:
    """Raise ``UsageError`` when a plaintext listener is off loopback without ``insecure``."""
    found = exposed(listen, tls, metrics_listen, http_listen)
    if found and not insecure:
        raise UsageError(
            f"refusing to serve plaintext beyond this machine: {'; '.join(found)}. "
            "Give --tls-ca, --tls-cert and --tls-key (mutual TLS on gRPC; see "
            "`hypermesh tls`), keep the dashboard and metrics on 127.0.0.1, or say "
            "--insecure to accept it"
        )


def warn_exposed(cfg: Listeners) -> None:
    """Log a warning for each plaintext listener ``--insecure`` let off loopback (at
    every start, so that the choice stays visible)."""
    found = exposed(cfg.listen, cfg.tls is not None, cfg.metrics_listen, cfg.http_listen)
    for what in found:
        log.warning("--insecure: %s is reachable from other machines without authentication",
                    what)
    if cfg.insecure and not found:
        log.warning("--insecure given, but every plaintext listener is on loopback")
