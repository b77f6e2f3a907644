"""The ``local`` provisioner: agent processes on this machine.

Each node is ``hypermesh agent start --preset local --pool P --name N`` in its
own work directory under the context's work root (or the pool's ``root``
option). A spot node polls the pool's ``spot_notice_url`` option for interruption
notices (nothing answers by default). The provider id is the process id; a
process counts as ours only while its command line names this node and this
namespace, so a reused pid is never signalled. Used by the tests and the local
mesh to "burst".

In a mesh that runs mutual TLS (the leader has ``--tls-*``), a member may gossip only
for the name in its own certificate, so each node gets one issued for its name, from
the CA directory the pool's ``ca_dir`` option names (``hypermesh tls init``; the same
CA as the leader's ``--tls-ca``), written as ``NAME.pem`` / ``NAME-key.pem`` into the
node's work directory. Without ``ca_dir`` such a pool starts nothing: its nodes could
never join.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
from pathlib import Path

import psutil

from hypermesh.agent.burst.provisioner import Context, NodeSpec, ProvisionError
from hypermesh.errors import UsageError
from hypermesh.local.agents import AgentProcess
from hypermesh.state.pools import Pool
from hypermesh.tls import TlsFiles, issue

log = logging.getLogger(__name__)

NO_NOTICES = "http://127.0.0.1:1/latest/meta-data/spot/instance-action"
NODE_HOSTS = ("127.0.0.1", "localhost")  # where a local node's peers dial it


class LocalProvisioner:
    def __init__(self, pool: Pool, ctx: Context) -> None:
        self.pool = pool
        self.ctx = ctx
        self.root = Path(pool.options.get("root") or ctx.work_root)
        # Children this process started, so their exit statuses are collected.
        self._children: dict[int, AgentProcess] = {}

    def launch(self, spec: NodeSpec) -> str:
        self._reap()
        extra = spec.agent_args()
        if spec.spot:
            # No cloud metadata here: the notice comes from the pool's option (a test
            # server), else from a closed local port that refuses at once.
            extra += ["--spot-notice-url", self.pool.options.get("spot_notice_url", NO_NOTICES)]
        if self.ctx.store:
            extra += ["--store", self.ctx.store]
        tls = self.node_tls(spec.name, self.root / spec.name)
        if tls is not None:
            extra += ["--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert),
                      "--tls-key", str(tls.key)]
        agent = AgentProcess(
            spec.name, self.ctx.etcd, self.ctx.namespace, self.root / spec.name,
            slots=spec.pool.slots, extra=extra,
            env=dict(os.environ, **dict(self.ctx.etcd_env)) if self.ctx.etcd_env else None,
        )
        try:
            agent.start(wait=False)
        except OSError as exc:
            raise ProvisionError(f"cannot start a local agent for {spec.name}: {exc}") from exc
        assert agent.proc is not None
        self._children[agent.proc.pid] = agent
        log.info("started local agent %s (pid %d) in %s", spec.name, agent.proc.pid, agent.work_dir)
        return str(agent.proc.pid)

    def node_tls(self, name: str, work_dir: Path) -> TlsFiles | None:
        """The TLS files of node ``name`` (None: the mesh is plaintext): the mesh CA
        and a certificate for its name, issued into ``work_dir`` from the pool's
        ``ca_dir`` (reused if the directory has one already)."""
        mesh = self.ctx.tls
        if mesh is None:
            return None
        pool = self.pool.name
        ca_dir = self.pool.options.get("ca_dir")
        if not ca_dir:
            raise ProvisionError(
                f"pool {pool}: the mesh uses TLS and the pool names no CA to issue node "
                "certificates from (`hypermesh pool set ... --option ca_dir=DIR`, DIR made "
                "by `hypermesh tls init`)"
            )
        ca = Path(ca_dir)
        try:
            if (ca / "ca.pem").read_bytes() != mesh.ca.read_bytes():
                raise ProvisionError(
                    f"pool {pool}: {ca}/ca.pem is not the mesh's CA (the leader's --tls-ca "
                    f"{mesh.ca}); its nodes could never join"
                )
        except OSError as exc:
            raise ProvisionError(f"pool {pool}: cannot read its CA: {exc}") from exc
        files = TlsFiles(mesh.ca.absolute(), work_dir.absolute() / f"{name}.pem",
                         work_dir.absolute() / f"{name}-key.pem")
        if files.cert.exists() and files.key.exists():
            return files
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
            issue(ca, name, NODE_HOSTS, agent=True, out=work_dir)
        except (OSError, UsageError) as exc:
            raise ProvisionError(
                f"pool {pool}: cannot issue a certificate for {name}: {exc}"
            ) from exc
        return files

    def _ours(self, name: str, provider_id: str) -> psutil.Process | None:
        """The running process ``provider_id`` if it is this node's agent, else None."""
        self._reap()
        try:
            proc = psutil.Process(int(provider_id))
            cmdline = proc.cmdline()
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        pairs = set(itertools.pairwise(cmdline))
        if ("--name", name) in pairs and ("--namespace", self.ctx.namespace) in pairs:
            return proc
        return None

    def find(self, name: str) -> str:
        """The pid of this node's agent ("" if none runs), for a record that lost it."""
        for proc in psutil.process_iter(["cmdline"]):
            if self._ours(name, str(proc.pid)) is not None:
                return str(proc.pid)
        return ""

    def terminate(self, name: str, provider_id: str) -> bool:
        proc = self._ours(name, provider_id or self.find(name))
        if proc is None:
            return True  # already gone (a pid reused since is not ours to signal)
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)  # the agent drains and deregisters
        return True

    def gone(self, name: str, provider_id: str) -> bool:
        return self._ours(name, provider_id) is None

    def _reap(self) -> None:
        for pid, agent in list(self._children.items()):
            if agent.proc is None or agent.proc.poll() is not None:
                del self._children[pid]
