"""The ``local`` provisioner: agent processes on this machine.

Each node is ``hypermesh agent start --preset local --pool P --name N`` in its
own work directory under the context's work root (or the pool's ``root``
option). A spot node polls the pool's ``spot_notice_url`` option for interruption
notices (nothing answers by default). The provider id is the process id; a
process counts as ours only while its command line names this node and this
namespace, so a reused pid is never signalled. Used by the tests and the local
mesh to "burst".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
from pathlib import Path

import psutil

from hypermesh.agent.burst.provisioner import Context, NodeSpec, ProvisionError
from hypermesh.local.agents import AgentProcess
from hypermesh.state.pools import Pool

log = logging.getLogger(__name__)

NO_NOTICES = "http://127.0.0.1:1/latest/meta-data/spot/instance-action"


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
        agent = AgentProcess(
            spec.name, self.ctx.etcd, self.ctx.namespace, self.root / spec.name,
            slots=spec.pool.slots, extra=extra,
        )
        try:
            agent.start(wait=False)
        except OSError as exc:
            raise ProvisionError(f"cannot start a local agent for {spec.name}: {exc}") from exc
        assert agent.proc is not None
        self._children[agent.proc.pid] = agent
        log.info("started local agent %s (pid %d) in %s", spec.name, agent.proc.pid, agent.work_dir)
        return str(agent.proc.pid)

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
