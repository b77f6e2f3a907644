"""The local mesh's certificate authority: a CA and its members' certificates in one
directory, made on first use and reused when the mesh starts again there.

Agents get certificates issued with ``agent=True`` (their node name and
``agent.hypermesh``, for 127.0.0.1); the CLI the user certificate ``cli``.
"""

from __future__ import annotations

from pathlib import Path

from hypermesh.tls import TlsFiles, init_ca, issue

CLI_USER = "cli"
"""The local mesh CLI's certificate name (a user's: it may not gossip)."""


class LocalPki:
    """A mesh CA in ``directory`` (``ca.pem``, ``ca-key.pem``) and what it issued."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def member(self, name: str, *, agent: bool = False) -> TlsFiles:
        """The files of member ``name``, its certificate issued now if it has none."""
        if not (self.directory / "ca.pem").exists():
            init_ca(self.directory, "hypermesh local mesh CA")
        cert = self.directory / f"{name}.pem"
        if not cert.exists():
            issue(self.directory, name, ["127.0.0.1", "localhost"], agent=agent)
        return TlsFiles(self.directory / "ca.pem", cert, self.directory / f"{name}-key.pem")
