"""``--tls-ca``, ``--tls-cert``, ``--tls-key``: the mesh CA and the member's own pair.

Every command takes them (through ``mesh_options``), as does ``hypermesh agent
start``; each falls back to its ``HYPERMESH_TLS_*`` variable. Given, the command's
connections to agents are mutual TLS (``hypermesh/channels.py``); the agent serves
with them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from hypermesh.tls import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY

TLS_PARAMS = ("tls_ca", "tls_cert", "tls_key")
"""The keyword arguments ``tls_options`` adds, in ``TlsFiles.from_options`` order."""


def tls_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the three options to a command (as ``tls_ca``, ``tls_cert``, ``tls_key``)."""
    for param, env, what in reversed((
        ("tls_ca", ENV_TLS_CA, "The mesh CA's certificate (PEM)"),
        ("tls_cert", ENV_TLS_CERT, "This member's certificate, issued by the mesh CA"),
        ("tls_key", ENV_TLS_KEY, "This member's private key"),
    )):
        fn = click.option(
            "--" + param.replace("_", "-"), param, default=None, metavar="FILE",
            help=f"{what} [env {env}]; with all three, connections are mutual TLS.",
        )(fn)
    return fn
