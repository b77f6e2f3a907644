"""``hypermesh tls``: the mesh's certificate authority and its members' certificates.

``tls init DIR`` creates the CA; ``tls issue DIR NAME --host H`` a certificate for an
agent (NAME is its node name; with ``--agent``), a mount or a CLI user. Copy ``ca.pem`` and the
member's own pair to each machine; ``ca-key.pem`` stays with whoever issues.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hypermesh.cli.common import err
from hypermesh.errors import UsageError
from hypermesh.tls import AGENT_NAME, CERT_DAYS, init_ca, issue


@click.group()
def tls() -> None:
    """Create the mesh's CA and issue certificates (mutual TLS on every connection)."""


@tls.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def tls_init(directory: Path) -> None:
    """Create a CA in DIRECTORY: ca.pem (share it) and ca-key.pem (mode 0600, keep it)."""
    try:
        path = init_ca(directory)
    except UsageError as exc:
        err(f"error: {exc}")
        sys.exit(2)
    click.echo(path)


@tls.command("issue")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.argument("name")
@click.option("--host", "hosts", multiple=True, metavar="HOST_OR_IP",
              help="A host name or IP address the member is reached at (repeatable).")
@click.option("--days", default=CERT_DAYS, show_default=True, help="Days the certificate is valid.")
@click.option("--agent", "for_agent", is_flag=True,
              help=f"An agent's certificate: it also names {AGENT_NAME}, which clients "
              "check an agent's for and agents require of gossip and chunk traffic.")
def tls_issue(
    directory: Path, name: str, hosts: tuple[str, ...], days: int, for_agent: bool
) -> None:
    """Issue DIRECTORY/NAME.pem and NAME-key.pem, signed by the CA in DIRECTORY.

    NAME is the member's name in the mesh (an agent's node name: it may speak in
    gossip only for that name; issue it with --agent). Prints the certificate's path.
    """
    try:
        path = issue(directory, name, list(hosts), days, agent=for_agent)
    except UsageError as exc:
        err(f"error: {exc}")
        sys.exit(2)
    click.echo(path)
