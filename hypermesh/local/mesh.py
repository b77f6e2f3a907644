"""A mesh on this machine: a real etcd and real agent processes on loopback.

Used by ``scripts/local_mesh.py``, the tests and the benchmarks. Every process
it starts is stopped by ``close()`` (and by the context managers), also when the
caller fails. The pieces it is made of live beside it: :mod:`~hypermesh.local.etcd`,
:mod:`~hypermesh.local.agents`, :mod:`~hypermesh.local.s3server`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hypermesh.local.agents import AgentProcess, mesh_agents, stop_all
from hypermesh.local.etcd import EtcdCluster, EtcdServer
from hypermesh.local.pki import CLI_USER, LocalPki
from hypermesh.local.processes import stop_started_under, unmount_under
from hypermesh.local.s3server import S3Server

MESH_BUCKET = "hypermesh"  # the local mesh's bucket on its own S3 server


class LocalMesh:
    """etcd plus N agents under one directory. Stops everything on ``close``."""

    def __init__(
        self,
        root: Path,
        *,
        agents: int = 1,
        slots: int = 2,
        namespace: str = "default",
        fsync: bool = True,
        agent_args: Sequence[str] = (),
        s3: bool = False,
        tls: bool = False,
        etcd_members: int = 1,
    ) -> None:
        self.root = Path(root)
        self.namespace = namespace
        # One etcd, or (etcd_members > 1) a cluster of that many members on loopback,
        # every agent and the CLI given all of their client URLs.
        self.etcd: EtcdServer | EtcdCluster = (
            EtcdCluster(self.root / "etcd", etcd_members, fsync=fsync) if etcd_members > 1
            else EtcdServer(self.root / "etcd", fsync=fsync))
        self.agent_count = agents
        self.slots = slots
        self.agent_args = list(agent_args)
        self.agents: list[AgentProcess] = []
        # With s3, a SeaweedFS server holds the mesh's data sets (store ``store_url``).
        self.s3: S3Server | None = None
        if s3:
            self.s3 = S3Server(self.root / "s3")
        self.store_url: str | None = None
        # With tls, a mesh CA in ROOT/tls (hypermesh/local/pki.py): agents serve mutual
        # TLS with their own certificates, and ``env()`` gives the CLI its own.
        self.pki: LocalPki | None = LocalPki(self.root / "tls") if tls else None

    def start(self) -> LocalMesh:
        try:
            self.etcd.start()
            if self.s3 is not None:
                self.s3.start()
                self.s3.make_bucket(MESH_BUCKET)
                self.store_url = self.s3.url(MESH_BUCKET, "mesh")
            for i in range(self.agent_count):
                self.add_agent(f"node{i + 1}")
        except BaseException:
            self.close()
            raise
        return self

    def add_agent(
        self, name: str, *, slots: int | None = None, extra: Sequence[str] = ()
    ) -> AgentProcess:
        agent = AgentProcess(
            name,
            self.etcd.url,
            self.namespace,
            self.root / name,
            slots=slots or self.slots,
            extra=[*self.agent_args, *self._tls_args(name), *extra],
            env=dict(os.environ, **self.env()) if self.s3 is not None else None,
        )
        self.agents.append(agent)
        agent.start()
        return agent

    def _tls_args(self, name: str) -> list[str]:
        if self.pki is None:
            return []
        tls = self.pki.member(name, agent=True)
        return ["--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]

    def env(self) -> dict[str, str]:
        """What points the CLI (and agents) at this mesh, its store and (with tls) the
        CLI's certificate included."""
        env = {"HYPERMESH_ETCD": self.etcd.url, "HYPERMESH_NAMESPACE": self.namespace}
        if self.s3 is not None and self.store_url is not None:
            env.update(self.s3.client_env(), HYPERMESH_STORE=self.store_url)
        if self.pki is not None:
            env.update(self.pki.member(CLI_USER).env())
        return env

    def close(self) -> None:
        try:
            for agent in self.agents:
                agent.terminate(timeout=15)
            # Agents a leader started to burst (local provisioner) go with the mesh.
            stop_all(mesh_agents(self.etcd.url, self.namespace), timeout=15)
            unmount_under(self.root)
        finally:
            self.etcd.stop()
            if self.s3 is not None:
                self.s3.stop()
            # What a start cut short by Ctrl-C or SIGTERM left unrecorded (an etcd whose
            # Popen was interrupted under load): every process naming a path under ROOT.
            stop_started_under(self.root, timeout=10)

    def __enter__(self) -> LocalMesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
