"""``--tls-ca``, ``--tls-cert``, ``--tls-key``: the mesh CA and the member's own pair;
``--etcd-ca``, ``--etcd-cert``, ``--etcd-key``, ``--etcd-user``: how etcd is reached.

Every command takes them (through ``mesh_options``), as does ``hypermesh agent
start``; each falls back to its ``HYPERMESH_TLS_*`` or ``HYPERMESH_ETCD_*`` variable.
Given, the command's connections to agents are mutual TLS (``hypermesh/channels.py``);
the agent serves with them too. The etcd options make ``EtcdSecurity``
(``hypermesh/etcd_security.py``); the etcd password is read from
``HYPERMESH_ETCD_PASSWORD`` only, never from an option (options show in ``ps``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from hypermesh.etcd_security import (
    ENV_ETCD_CA,
    ENV_ETCD_CERT,
    ENV_ETCD_KEY,
    ENV_ETCD_PASSWORD,
    ENV_ETCD_USER,
)
from hypermesh.tls import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY

TLS_PARAMS = ("tls_ca", "tls_cert", "tls_key")
"""The keyword arguments ``tls_options`` adds, in ``TlsFiles.from_options`` order."""

ETCD_PARAMS = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user")
"""The keyword arguments ``etcd_options`` adds, in ``EtcdSecurity.from_options`` order."""


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


def etcd_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--etcd-ca``, ``--etcd-cert``, ``--etcd-key`` and ``--etcd-user``."""
    for param, env, what in reversed((
        ("etcd_ca", ENV_ETCD_CA, "The CA of etcd's server certificates (PEM); needed for "
         "https:// endpoints"),
        ("etcd_cert", ENV_ETCD_CERT, "A client certificate for etcd (--client-cert-auth)"),
        ("etcd_key", ENV_ETCD_KEY, "The key of --etcd-cert"),
    )):
        fn = click.option(
            "--" + param.replace("_", "-"), param, default=None, metavar="FILE",
            help=f"{what} [env {env}].",
        )(fn)
    return click.option(
        "--etcd-user", "etcd_user", default=None, metavar="NAME",
        help=f"etcd user [env {ENV_ETCD_USER}]; its password is read from "
        f"{ENV_ETCD_PASSWORD} only.",
    )(fn)
