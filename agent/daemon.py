"""The agent daemon: one asyncio program per machine.

It holds one etcd lease for its whole registration (node key, every claim),
mirrors the namespace with a watch, stands for leader when no live node leads
(a candidacy on a short lease of its own), claims tasks that fit, runs them, and records each
attempt with a fenced transaction. SIGTERM (or the Drain RPC) drains it: no new
claims, running tasks are stopped with a grace period and handed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import math
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from hypermesh.agent import leader
from hypermesh.agent.burst import spot
from hypermesh.agent.burst.duty import BurstDuty
from hypermesh.agent.burst.policy import BurstConfig
from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.agent.claims.locality import Locality
from hypermesh.agent.claims.pool_wait import PoolWait
from hypermesh.agent.claims.unsure import UnsureClaims
from hypermesh.agent.claims.wake_timer import WakeTimer
from hypermesh.agent.gang.duty import GangDuty
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.duty import Gossip
from hypermesh.agent.ops.health import Health
from hypermesh.agent.ops.metrics import MetricsServer
from hypermesh.agent.ops.telemetry import TaskRoot, Telemetry, detect_machine
from hypermesh.agent.share.config import ShareConfig
from hypermesh.agent.share.duty import ChunkShare
from hypermesh.agent.tasks.blocks import BlockDuty, choose_block
from hypermesh.agent.tasks.containers import Containers, image_for
from hypermesh.agent.tasks.dirpool import DirPool
from hypermesh.agent.tasks.gpu_pool import GpuPool, gpu_source, visible_devices
from hypermesh.agent.tasks.logs import LogShipper
from hypermesh.agent.tasks.metrics_watch import attempt_watch, metrics_file
from hypermesh.agent.tasks.mounts import Mounts
from hypermesh.agent.tasks.runner import AttemptProcess, Outcome, use_pidfd_child_watcher

from hypermesh._proto import agent_pb2_grpc
from hypermesh.config import SMALL_MESSAGE_GRPC_OPTIONS, AgentConfig
from hypermesh.errors import EtcdUnavailable, HypermeshError, LeaseLost
from hypermesh.recipe.recipe import Experiment
from hypermesh.recipe.sampling import expand, expand_more, experiment_seed
from hypermesh.recipe.templating import param_env, render
from hypermesh.state import search
from hypermesh.state.blocks import block_size
from hypermesh.state.etcd import Etcd, hush_broken_stream_noise
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.model import TERMINAL, Attempt, MeshView, NodeRecord, dumps
from hypermesh.state.search import is_adaptive
from hypermesh.state.txns import (
    ClaimPlan,
    Finish,
    add_task,
    claim_tasks,
    expand_experiment,
    finish_attempts,
    publish_progress,
    set_workflow_state,
)

log = logging.getLogger("hypermesh.agent")

STOP_STEP_S = 5.0  # longest wait for each step of stopping

PROGRESS_S = 1.0
"""Least time between two progress summaries of one workflow the leader publishes
(``progress/<wid>``, followed by ``submit --wait`` and ``status --watch``), seconds."""


def bind_dashboard(listen: str) -> socket.socket:
    """The web dashboard's listening socket on ``listen`` (HOST:PORT, port 0: any
    free one), bound at once so that a taken port fails the start with OSError."""
    host, _, port = listen.rpartition(":")
    try:
        return socket.create_server((host, int(port)), backlog=64)
    except OSError as exc:
        raise OSError(f"cannot serve the dashboard on {listen} (--http-listen): {exc}") from exc


@dataclass
class Running:
    """An attempt this node is running; owned by the agent's event loop."""

    plan: ClaimPlan
    claim_revision: int
    gpus: float
    devices: list[int] = field(default_factory=list)  # GPU indices booked for it
    process: AttemptProcess | None = None
    task: asyncio.Task[None] | None = None
    block: BlockRef | None = None  # the held block it belongs to (agent/tasks/blocks.py)
    started_at: float | None = None


GC_YOUNG = 20_000
"""Allocations that trigger a young-generation collection in an agent (Python's
default is 700)."""


def tune_gc() -> None:
    """Collect less often in a long-lived agent: the modules and objects of start-up
    are frozen out of every later collection, and the young generation is collected
    every ``GC_YOUNG`` allocations instead of 700. Each attempt of a trivial task
    allocates a few thousand short-lived objects: with the defaults an agent ran about
    120 young collections per 1,250 attempts, with these about 3 (docs/benchmarks.md).
    The pauses stay around a few milliseconds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 20, 20)


class Agent:
    def __init__(self, cfg: AgentConfig, endpoints: list[str], namespace: str) -> None:
        self.cfg = cfg
        self.ks = Keyspace(namespace)
        self.etcd = Etcd(endpoints)
        self.view = MeshView(self.ks)
        # The summaries this node published as leader (``progress/``), and when.
        self._published: dict[str, tuple[dict[str, Any] | None, float]] = {}
        self._progress_timer = WakeTimer(self._lead_again)
        self._node_record: tuple[tuple[object, ...], NodeRecord] | None = None
        # Only the leader (and a node claiming a block) needs every batch of every block
        # applied; the rest wait in the view until asked for (``full_view``).
        self.view.defer_batches = True
        self.gpu_source = gpu_source(cfg.gpus, cfg.gpu_type)
        self.gpu_pool = GpuPool()
        devices = self.gpu_source.devices()
        self.machine = detect_machine(
            len(devices), cfg.gpu_type or (devices[0].name if devices else "")
        )
        self.work_dir = cfg.work_dir.resolve()
        self._work_dir = str(self.work_dir)
        self.dirs = DirPool(self.work_dir / "spare-dirs")  # empty folders for attempts
        self._workflow_dirs: set[str] = set()  # attempts/WID folders made by this run
        self._attempts = str(self.work_dir / "attempts")
        self._checkpoints = str(self.work_dir / "checkpoints")
        # (workflow, experiment) -> (its recipe, the environment its tasks share)
        self._task_env: dict[tuple[str, str], tuple[object, dict[str, str]]] = {}
        self.lease = 0
        self.election_lease = 0
        self.last_renewal = time.monotonic()
        self.drain_grace: float | None = None
        self.rng = random.Random()
        # Read-your-writes: the newest revision this node wrote. Claims wait until
        # the mirrored view has caught up with it, so a task this node just
        # finished is never mistaken for an open one.
        self.written_revision = 0
        self.base_env = dict(os.environ)
        # Agents gossip with lan timings in every preset: real gRPC round trips
        # between Python processes on a loaded 2-core machine need them.
        self.gossip = Gossip(self, GossipConfig.lan())
        self.containers = Containers()
        self.mounts = Mounts(self.work_dir, cfg.store, cfg.cache_size, cfg.data_deadline)
        share_cfg = ShareConfig.local() if cfg.preset == "local" else ShareConfig.lan()
        self.share = ChunkShare(self, share_cfg)  # peer chunk sharing; .share.peers.holders()
        self.logs = LogShipper(cfg.store, namespace, cfg.log_upload_s)
        self.locality = None if cfg.locality_delay is None else Locality(
            cfg.name, cfg.store, cfg.locality_delay, self.mounts, lambda: self._wake.set(),
            self.decide, self.gossip.alive, self.share.peers.holders,
        )
        self.pool_wait = PoolWait(cfg.pool_delay, lambda: self._wake.set(), self.decide,
                                  self.gossip.alive)
        burst_cfg = BurstConfig.local() if cfg.preset == "local" else BurstConfig.lan()
        self.burst = BurstDuty(self, burst_cfg)  # acts only while this agent leads
        self.gangs = GangDuty(self)  # seats in gangs (experiments with nodes > 1)
        self._finishing: list[tuple[Finish, asyncio.Future[int | None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.address = ""
        self.http_address = ""
        self._dashboard: Any = None  # the web dashboard's aiohttp runner, once serving
        self._dashboard_start: asyncio.Task[None] | None = None
        self.state = "alive"
        self.started_at = time.time()
        self.running: dict[TaskRef, Running] = {}
        self.blocks = BlockDuty(self)
        self.unsure = UnsureClaims(self.etcd, self.ks, cfg.name, lambda: self.lease, self.decide)
        self._wake: asyncio.Event = asyncio.Event()
        self.claiming: set[TaskRef] = set()  # tasks of the claim transaction in flight
        self._stop = asyncio.Event()
        self._lease_lost = asyncio.Event()
        self._mirror_ready = asyncio.Event()
        self._view_changed = asyncio.Event()  # set on every batch the mirror applies
        self._leader_dirty = True
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: grpc.aio.Server | None = None
        self.telemetry = Telemetry(self.work_dir, cfg.telemetry_period, cfg.telemetry_history)
        self.health: Health | None = None
        self.metrics: MetricsServer | None = None
        self.metrics_address = ""

    # ------------------------------------------------------------------ identity
    def record(self) -> NodeRecord:
        """The node's registration record as of now (made again only when what can
        change has: the scheduler asks for it at every wake-up)."""
        key = (self.cfg, self.machine, self.address, self.state, self.lease, self.started_at,
               self.metrics_address, self.http_address)  # the same objects: compared by identity
        if self._node_record is None or self._node_record[0] != key:
            self._node_record = (key, self._make_record())
        return self._node_record[1]

    def _make_record(self) -> NodeRecord:
        return NodeRecord(
            name=self.cfg.name,
            address=self.address,
            pool=self.cfg.pool,
            spot=self.cfg.spot,
            slots=self.cfg.slots,
            gpus=self.machine.gpus,
            gpu_type=self.machine.gpu_type,
            cpus=self.machine.cpus,
            memory=self.machine.memory,
            labels=dict(self.cfg.labels),
            state=self.state,
            started_at=self.started_at,
            lease=self.lease,
            metrics=self.metrics_address,
            http_address=self.http_address,
        )

    def decide(self, message: str) -> None:
        """The node's decision log (claimed, lost lease, result rejected...), one
        line each in the agent's log, which tests and operators read."""
        log.info("%s: %s", self.cfg.name, message)

    @property
    def is_leader(self) -> bool:
        return self.view.leader() == self.cfg.name

    def full_view(self) -> MeshView:
        """The view with every batch applied, for readers of per-task state (status,
        logs, metrics, the dashboard); scheduling reads ``view``."""
        self.view.settle()
        return self.view

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        from hypermesh.agent.server import AgentServicer

        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "checkpoints").mkdir(exist_ok=True)
        self.dirs.open()
        use_pidfd_child_watcher()
        hush_broken_stream_noise(asyncio.get_running_loop())
        tune_gc()
        await self.etcd.connect()
        self._server = grpc.aio.server(options=SMALL_MESSAGE_GRPC_OPTIONS)
        agent_pb2_grpc.add_AgentServicer_to_server(AgentServicer(self), self._server)
        self.health = Health(self._server)
        host = self.cfg.listen.rpartition(":")[0]
        port = self._server.add_insecure_port(self.cfg.listen)
        if port == 0:
            raise OSError(f"cannot listen on {self.cfg.listen}")
        self.address = f"{host}:{port}"
        if self.cfg.peer_sharing:
            self.mounts.agent_address = self.address
        await self.health.start()  # NOT_SERVING until registered
        await self._server.start()
        if self.cfg.metrics_listen is not None:
            self.metrics = MetricsServer(self)
            self.metrics_address = await self.metrics.start(self.cfg.metrics_listen)
            (self.work_dir / "agent.metrics").write_text(self.metrics_address + "\n")
        dashboard_socket = None
        if self.cfg.http_listen is not None:
            dashboard_socket = bind_dashboard(self.cfg.http_listen)
            host, port = dashboard_socket.getsockname()[:2]
            self.http_address = f"{host}:{port}"
        await self._register()
        self._health_changed()
        (self.work_dir / "agent.address").write_text(self.address + "\n")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain)
        self._tasks = [
            asyncio.create_task(self._keep_lease(), name="lease"),
            asyncio.create_task(
                self.etcd.mirror(
                    self.ks.root,
                    self.view.apply,
                    self._on_batch,
                    reset=self.view.reset,
                    ready=self._mirror_ready,
                ),
                name="mirror",
            ),
            asyncio.create_task(self._schedule(), name="schedule"),
            asyncio.create_task(self._campaign(), name="campaign"),
            asyncio.create_task(self._run_gossip(), name="gossip"),
            asyncio.create_task(self._run_burst(), name="burst"),
            asyncio.create_task(self.gangs.run(), name="gangs"),
            asyncio.create_task(self.telemetry.run(self._task_roots), name="telemetry"),
        ]
        if self.cfg.spot:
            self._tasks.append(
                asyncio.create_task(
                    spot.watch(self.cfg.spot_notice_url, self.cfg.spot_poll, self._on_spot_notice),
                    name="spot",
                )
            )
        for t in self._tasks:
            t.add_done_callback(self._task_died)
        if dashboard_socket is not None:
            self._dashboard_start = asyncio.create_task(self._serve_dashboard(dashboard_socket))
        self.decide(f"started at {self.address} with lease {self.lease:x}")
        try:
            await self._stop.wait()
            await self._drain()
        finally:
            # Every step is bounded: a stuck peer or etcd must not keep a drained
            # node (and the spot machine it runs on) from exiting.
            for t in self._tasks:
                t.cancel()
            await asyncio.wait(self._tasks, timeout=STOP_STEP_S)
            for lease in (self.election_lease, self.lease):
                if not lease:  # a follower holds no candidacy lease
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.etcd.revoke(lease), STOP_STEP_S)
            if self.metrics is not None:
                await self.metrics.close()
            await self._server.stop(grace=1.0)
            self.telemetry.close()
            if self.locality is not None:
                self.locality.close()
            self.pool_wait.close()
            if self._dashboard_start is not None:
                self._dashboard_start.cancel()
            if self._dashboard is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dashboard.cleanup(), STOP_STEP_S)
            await self.logs.flush(STOP_STEP_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.etcd.close(), STOP_STEP_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.mounts.close(), 4 * STOP_STEP_S)
            self.decide("stopped")

    async def _serve_dashboard(self, sock: socket.socket) -> None:
        """Serve the web dashboard on its bound socket. Its modules (aiohttp) load in
        a thread after the agent has registered, so they never delay its start;
        connections wait in the socket's backlog meanwhile."""
        try:
            module = await asyncio.to_thread(
                importlib.import_module, "hypermesh.agent.ops.dashboard"
            )
            self._dashboard = await module.serve(self, sock)
        except Exception:
            log.exception("%s: the web dashboard failed to start", self.cfg.name)
            sock.close()
            return
        (self.work_dir / "http.address").write_text(self.http_address + "\n")
        self.decide(f"dashboard at http://{self.http_address}/")

    def _task_died(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self._stop.is_set():
            return
        log.error(
            "%s: %s stopped unexpectedly", self.cfg.name, task.get_name(), exc_info=task.exception()
        )
        self.request_drain()

    def request_drain(self, grace: float | None = None, why: str = "drain requested") -> None:
        if not self._stop.is_set():
            self.drain_grace = grace
            self.decide(why)
            self._stop.set()

    def _on_spot_notice(self, notice: spot.Notice) -> None:
        grace = spot.drain_grace(notice, time.time(), self.cfg.kill_grace)
        self.request_drain(grace, f"spot interruption notice ({notice.action}); draining")

    async def _register(self) -> None:
        self.lease = await self.etcd.grant(self.cfg.lease_ttl)
        self.last_renewal = time.monotonic()
        await self.etcd.put(self.ks.node(self.cfg.name), dumps(self.record().to_json()), self.lease)

    def _health_changed(self) -> None:
        if self.health is not None:
            self.health.refresh(self.state, self.lease_is_lost)

    def _task_roots(self) -> list[TaskRoot]:
        """The first process of each running attempt, for telemetry."""
        roots = []
        for ref, r in self.running.items():
            pid = r.process.pid if r.process is not None else None
            if pid is not None:
                roots.append(TaskRoot(ref.id, r.plan.attempt, pid))
        return roots + self.gangs.task_roots()

    @property
    def lease_is_lost(self) -> bool:
        return self._lease_lost.is_set()

    def lease_fresh(self) -> bool:
        """Whether the node lease was renewed within the last TTL. After a pause
        (SIGSTOP, a frozen VM) it is not, and etcd has likely dropped our claims."""
        return time.monotonic() - self.last_renewal < self.cfg.lease_ttl

    def _renewed(self, when: float) -> None:
        self.last_renewal = when

    async def _keep_lease(self) -> None:
        while True:
            keeper = asyncio.create_task(
                self.etcd.keep_lease(
                    self.lease, self.cfg.lease_ttl, self._lease_lost.set, self._renewed
                )
            )
            try:
                await self._lease_lost.wait()
            finally:
                keeper.cancel()
            self._wake.set()
            self._health_changed()
            await self._handle_lease_lost()
            self._health_changed()

    async def _campaign(self) -> None:
        """Lead when no live node does.

        A candidacy is a key under ``elect/`` on a short lease of its own
        (``--leader-ttl``), and only the leader holds one: the others watch, and when
        the leader's key goes (its lease lapsed or was revoked) or its node does, they
        race with one transaction each that stands only if no one stood since their
        view (see :meth:`_stand`). So the followers keep no second lease alive, and
        a silent leader is still replaced within the leader TTL."""
        await self._mirror_ready.wait()
        while True:
            self._view_changed.clear()
            vacant = self.view.vacant_candidacies()
            if vacant is None or not self._may_lead():
                await self._view_changed.wait()
                continue
            try:
                stood_at = await self._stand(vacant, self.view.revision)
            except (EtcdUnavailable, LeaseLost) as exc:
                log.warning("%s: campaign: %s", self.cfg.name, exc)
                await asyncio.sleep(0.5)
                continue
            if stood_at:
                await self._hold_candidacy(stood_at)

    def _may_lead(self) -> bool:
        return (
            not self._stop.is_set()
            and not self.lease_is_lost
            and self.cfg.name in self.view.nodes
        )

    async def _stand(self, vacant: list[str], seen: int) -> int:
        """Put this node's candidacy, clearing the keys of ``vacant`` (as of the view's
        revision ``seen``), in one transaction that fails if any candidacy was put
        after ``seen``: of the nodes that saw the same vacancy, one wins. Returns the
        revision of the candidacy, or 0 when another node stood first."""
        lease = await self.etcd.grant(self.cfg.leader_ttl)
        done = await self.etcd.txn(
            [self.etcd.none_created_since(self.ks.election, seen)],
            [
                *(self.etcd.op_delete(self.ks.election + key) for key in vacant),
                self.etcd.op_put(
                    self.ks.candidate(lease), dumps({"node": self.cfg.name}), lease
                ),
            ],
        )
        if not done.succeeded:
            await self.etcd.revoke(lease)
            return 0
        self.election_lease = lease
        self.decide(f"stood for leader with candidacy {lease:x}")
        return done.revision

    async def _hold_candidacy(self, stood_at: int) -> None:
        """Keep the candidacy's lease alive until it lapses or its key is gone (a
        node that stood while this node's own node key was gone cleared it)."""
        lease, key = self.election_lease, f"{self.election_lease:016x}"
        keeper = asyncio.create_task(
            self.etcd.keep_lease(lease, self.cfg.leader_ttl, lambda: None)
        )
        try:
            while True:
                changed = asyncio.ensure_future(self._view_changed.wait())
                await asyncio.wait([keeper, changed], return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if keeper.done():
                    self.decide(f"candidacy {lease:x} lapsed")
                    break
                self._view_changed.clear()
                if self.view.revision >= stood_at and key not in self.view.candidates:
                    self.decide(f"candidacy {lease:x} was cleared")
                    break
        finally:
            keeper.cancel()
            await self.etcd.revoke(lease)
            self.election_lease = 0

    async def _handle_lease_lost(self) -> None:
        """Our claims are gone: stop every attempt now (their results would be
        rejected anyway), then rejoin with a new lease."""
        self.decide(f"lost lease {self.lease:x}; stopping {len(self.running)} attempts")
        self.blocks.drop_all()
        for r in list(self.running.values()):
            if r.process is not None:
                r.process.stop("node-lost", grace=0)
        await self.gangs.lease_lost()
        while self.running:
            await asyncio.sleep(0.05)
        while True:
            try:
                await self._register()
                break
            except EtcdUnavailable as exc:
                log.warning("re-register failed: %s", exc)
                await asyncio.sleep(1)
        self._lease_lost.clear()
        self.decide(f"rejoined with lease {self.lease:x}")
        self._wake.set()

    def _on_batch(self, revision: int) -> None:
        self._leader_dirty = True
        self._view_changed.set()
        self._wake.set()
        self.gangs.wake()

    # ------------------------------------------------------------------ scheduling
    async def _schedule(self) -> None:
        await self._mirror_ready.wait()
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._stop.is_set() or self._lease_lost.is_set():
                continue
            if not self.lease_fresh():
                self._lease_lost.set()
                continue
            leading = self.is_leader
            if leading == self.view.defer_batches:  # it took over, or handed over
                self.view.set_defer_batches(not leading)
                self._published.clear()  # what another leader published since is unknown
            try:
                if self._leader_dirty and leading:
                    self._leader_dirty = False
                    try:
                        await self._lead()
                    except BaseException:
                        self._leader_dirty = True  # not done: lead again at the next wake
                        raise
                self._stop_cancelled()
                if self.unsure:
                    await self.unsure.settle(self.running, self.blocks.held)
                await self._claim()
            except LeaseLost:
                self._lease_lost.set()
            except EtcdUnavailable as exc:
                log.warning("%s: %s", self.cfg.name, exc)
                await asyncio.sleep(0.5)
                self._wake.set()
            except Exception:  # a round that failed must not end scheduling for good
                log.exception("%s: scheduling round failed; trying again", self.cfg.name)
                self.decide("scheduling round failed (see the log); trying again")
                await asyncio.sleep(0.5)
                self._wake.set()

    async def _run_gossip(self) -> None:
        await self._mirror_ready.wait()  # seeds come from the etcd registry
        await self.gossip.run()

    async def _run_burst(self) -> None:
        await self._mirror_ready.wait()
        await self.burst.run()

    async def _lead(self) -> None:
        for action in leader.plan(self.view):
            if isinstance(action, leader.Expand | leader.Extend):
                wf = self.view.workflows[action.workflow]
                exp = wf.recipe.experiment(action.experiment)
                seed = experiment_seed(wf.seed, exp)
                start = action.start if isinstance(action, leader.Extend) else 0
                count = None
                if is_adaptive(exp):  # only the budget: trials come one by one (Suggest)
                    params: list[dict[str, Any]] = []
                    count = start + (action.count if isinstance(action, leader.Extend)
                                     else self.view.target_count(wf.id, exp))
                elif isinstance(action, leader.Extend):
                    params = expand_more(exp, seed, action.start, action.count)
                else:
                    params = expand(exp, seed)
                if await expand_experiment(
                    self.etcd, self.ks, wf.id, exp.name, params, action.state_revision, start,
                    count, self._block_size(wf.id, exp, start + len(params)),
                    self.view.revision,
                ):
                    what = "extended" if start else "expanded"
                    added = len(params) if count is None else count - start
                    self.decide(f"{what} {wf.id}/{exp.name} by {added} tasks")
            elif isinstance(action, leader.Suggest):
                await self._suggest(action)
            else:
                summary = self.view.workflow_summary(action.workflow) | {"state": action.state}
                if await set_workflow_state(
                    self.etcd,
                    self.ks,
                    action.workflow,
                    action.expected,
                    action.state,
                    action.state_revision,
                    summary,
                ):
                    self._published[action.workflow] = (summary, time.monotonic())
                    self.decide(f"workflow {action.workflow} is {action.state}")
        await self._publish_progress()

    async def _publish_progress(self) -> None:
        """Publish the summary of each running workflow that changed (``progress/``),
        at most every ``PROGRESS_S`` each; a change held back wakes the loop when due."""
        now = time.monotonic()
        due = math.inf
        for wid in list(self.view.workflows):
            revision = self.view.workflow_state_revisions.get(wid)
            if revision is None or self.view.workflow_state(wid) in TERMINAL:
                self._published.pop(wid, None)
                continue
            last, at = self._published.get(wid, (None, -math.inf))
            if now - at < PROGRESS_S:  # not even looked at: at most once a period
                due = min(due, at + PROGRESS_S)
                continue
            summary = self.view.workflow_summary(wid)
            if summary == last:
                continue
            try:
                written = await publish_progress(self.etcd, self.ks, wid, summary, revision)
            except HypermeshError as exc:  # best effort: try again in a period
                log.info("%s: publishing the progress of %s: %s", self.cfg.name, wid, exc)
                self._published[wid] = (last, now)
                due = min(due, now + PROGRESS_S)
                continue
            if written is not None:
                self._published[wid] = (summary, now)
        if due < math.inf:
            self._progress_timer.at(due)

    def _block_size(self, wid: str, exp: Experiment, count: int) -> int:
        """Tasks per block of an expansion: the size of the experiment's blocks written
        so far (by this leader or one before it), else one chosen for its size."""
        written = self.view.blocks.get((wid, exp.name))
        if written:
            return written[min(written)]
        if any(ref.workflow == wid and ref.experiment == exp.name for ref in self.view.tasks):
            return 1  # written task by task already
        if self.view.workers(wid, exp) is not None:
            return 1  # capped live before its expansion (hypermesh scale): slot keys
        mesh_slots = sum(n.slots for n in self.view.nodes.values())
        return block_size(exp, count, mesh_slots)

    async def _suggest(self, action: leader.Suggest) -> None:
        """Create the next trials of an adaptive search (Optuna runs in a thread)."""
        wf = self.view.workflows[action.workflow]
        exp = wf.recipe.experiment(action.experiment)
        seed = experiment_seed(wf.seed, exp)
        trials = search.trials_of(self.view, wf.id, exp)
        for index in action.indices:
            params = await asyncio.to_thread(search.suggest, exp, seed, index, trials)
            ref = TaskRef(wf.id, exp.name, index)
            if not await add_task(self.etcd, self.ks, ref, params, action.state_revision):
                return  # another leader got there first; the watch brings its tasks
            trials.append(search.Trial(index, params, "running"))
            self.decide(f"suggested {ref}: {params}")

    def _stop_cancelled(self) -> None:
        for ref, r in self.running.items():
            if r.process is not None and (
                self.view.workflow_state(ref.workflow) == "cancelled"
                or self.view.experiment_cancelled(ref.workflow, ref.experiment)
            ):
                r.process.stop("cancelled")

    def _load(self) -> LocalLoad:
        load = LocalLoad()
        for ref, r in self.running.items():
            load.running.add(ref)
            if r.plan.slot is not None:
                load.slots_held.add((ref.workflow, ref.experiment, r.plan.slot))
            load.gpus_used += r.gpus
        load.running |= self.gangs.held()  # a seat in a gang takes a slot
        load.running |= self.claiming
        if self.machine.gpus:
            load.gpu_pool = self.gpu_pool.copy()
            load.gpu_devices = self.gpu_source.devices()
        return load

    def wake(self) -> None:
        self._wake.set()

    def _lead_again(self) -> None:
        self._leader_dirty = True
        self._wake.set()

    def stop_block(self, bref: BlockRef, refs: list[TaskRef]) -> None:
        """A held block's claim is gone: its attempts here stop now (their results
        would be rejected, and a peer may be running them already)."""
        for ref in refs:
            r = self.running.get(ref)
            if r is not None and r.block == bref and r.process is not None:
                r.process.stop("node-lost", grace=0)

    async def _start_block_tasks(self) -> None:
        """Fill free slots from the blocks held here, claiming another block when
        they have nothing left to start (agent/tasks/blocks.py)."""
        me = self.record()
        while not self._stop.is_set() and not self._lease_lost.is_set():
            if me.slots - len(self.running) - len(self.gangs.held()) - len(self.claiming) <= 0:
                return
            start = self.blocks.next_start()
            if start is None:
                if not self.blocks.wants_block():
                    return
                bref = choose_block(self.view, me, set(self.blocks.held), self.rng)
                if bref is None or await self.blocks.claim(bref) is None:
                    return
                continue
            block, ref, n, started_at = start
            r = Running(ClaimPlan(ref, n), block.fence, 0.0, block=block.ref,
                        started_at=started_at)
            self.running[ref] = r
            r.task = asyncio.create_task(self._execute(r), name=f"attempt {ref}")

    async def _claim(self) -> None:
        await self._start_block_tasks()
        while not self._stop.is_set() and not self._lease_lost.is_set():
            batch = min(self.cfg.claim_batch, 100 // ClaimPlan.OPS)
            if self.view.revision < self.written_revision:
                return  # the watch will bring our own writes and wake us
            if not self.view.open_task_by_task():
                return  # all open work is in blocks, started above
            load = self._load()
            me = self.record()
            placement = self.locality.placement(self.view) if self.locality else None
            preference = self.pool_wait.round(self.view, me)
            plans = choose_claims(self.view, me, load, batch, self.rng, placement, preference)
            if self.locality is not None and placement is not None:
                self.locality.after_round(placement, self.view)
            self.pool_wait.after_round(preference)
            if not plans:
                return
            # Until the claim is decided its slots and GPUs are taken here, so that a
            # gang seat joined meanwhile (agent/gang/duty.py) cannot take them too.
            self.claiming = {plan.ref for plan in plans}
            if load.gpu_pool is not None:
                for plan in plans:
                    self.gpu_pool.adopt(load.gpu_pool, plan.ref)
            revision = None
            now = time.time()
            try:
                revision = await claim_tasks(
                    self.etcd, self.ks, plans, self.cfg.name, self.lease, now
                )
            except EtcdUnavailable:
                self.unsure.tasks(plans, now)  # written or not: read back when etcd is back
                raise
            finally:
                self.claiming = set()
                if revision is None:
                    for plan in plans:
                        self.gpu_pool.release(plan.ref)
            if revision is None:
                # Someone else got there first; the watch will bring the change.
                return
            self.written_revision = max(self.written_revision, revision)
            for plan in plans:
                exp = self.view.workflows[plan.ref.workflow].recipe.experiment(plan.ref.experiment)
                r = Running(plan, revision, exp.hardware.gpus)
                if load.gpu_pool is not None:
                    r.devices = self.gpu_pool.adopt(load.gpu_pool, plan.ref)
                self.running[plan.ref] = r
                if plan.lost is not None:
                    self.decide(f"{plan.ref} attempt {plan.lost.attempt} on {plan.lost.node} lost")
                r.task = asyncio.create_task(self._execute(r), name=f"attempt {plan.ref}")
            self.decide(f"claimed {', '.join(str(p.ref) for p in plans)}")

    # ------------------------------------------------------------------ execution
    def attempt_dir(self, ref: TaskRef, attempt: int) -> Path:
        """The attempt's scratch folder (``HM_ATTEMPT_DIR``), beside its log."""
        return Path(self.attempt_path(ref, attempt))

    def attempt_path(self, ref: TaskRef, attempt: int) -> str:
        # Strings on the path of every attempt: pathlib costs more than the rest of it.
        return f"{self._attempts}/{ref.workflow}/{ref.experiment}.{ref.index}.{attempt}"

    def attempt_log(self, ref: TaskRef, attempt: int) -> Path:
        """The attempt's output: ``attempts/WID/EXPERIMENT.INDEX.N.log``."""
        return Path(f"{self.attempt_path(ref, attempt)}.log")

    def open_attempt_dir(self, ref: TaskRef, attempt: int) -> Path:
        """Make the attempt's scratch folder (from the pool of empty ones) and its
        workflow's folder, which also holds the logs; the scratch folder's path."""
        return Path(self._open_attempt_path(ref, attempt))

    def _open_attempt_path(self, ref: TaskRef, attempt: int) -> str:
        path = self.attempt_path(ref, attempt)
        if ref.workflow not in self._workflow_dirs:
            os.makedirs(f"{self._attempts}/{ref.workflow}", exist_ok=True)
            self._workflow_dirs.add(ref.workflow)
        self.dirs.make(path)
        return path

    def _environment(
        self, ref: TaskRef, attempt: int, params: dict[str, Any], folder: str
    ) -> dict[str, str]:
        wf = self.view.workflows[ref.workflow]
        shared = self._task_env.get((ref.workflow, ref.experiment))
        if shared is None or shared[0] is not wf.recipe:
            exp = wf.recipe.experiment(ref.experiment)
            base = dict(self.base_env)
            base.update({k: str(v) for k, v in dict(wf.recipe.env).items()})
            base.update({k: str(v) for k, v in dict(exp.env).items()})
            if len(self._task_env) >= 256:
                self._task_env.clear()
            shared = self._task_env[(ref.workflow, ref.experiment)] = (wf.recipe, base)
        env = dict(shared[1])
        env.update(param_env(params))
        env.update(
            HM_WORKFLOW_ID=ref.workflow,
            HM_EXPERIMENT=ref.experiment,
            HM_TASK_ID=ref.id,
            HM_TASK_INDEX=str(ref.index),
            HM_ATTEMPT=str(attempt),
            HM_NODE=self.cfg.name,
            HM_ATTEMPT_DIR=folder,
            HM_METRICS_FILE=metrics_file(folder),
        )
        return env

    async def _data_environment(self, ref: TaskRef, data: dict[str, str]) -> dict[str, str]:
        """Mount the task's data sets; ``HM_DATA_<ALIAS>`` for each, ``HM_DATA`` for the
        first, and ``HM_CHECKPOINT_DIR``: in the mounts' shared writable area when the
        task has data (so a later attempt on any node finds it), else on this node."""
        env: dict[str, str] = {}
        for alias, spec in data.items():
            path = await self.mounts.ensure(spec)
            env[f"HM_DATA_{alias.upper()}"] = str(path)
            env.setdefault("HM_DATA", str(path))
        if "HM_DATA" in env:
            checkpoints = Mounts.checkpoint_dir(Path(env["HM_DATA"]), ref.id)
            await asyncio.to_thread(checkpoints.mkdir, parents=True, exist_ok=True)
            env["HM_CHECKPOINT_DIR"] = str(checkpoints)
        else:  # local: no thread hop on the hot path of trivial tasks
            local = self._checkpoint_path(ref)
            if not os.path.isdir(local):
                self.dirs.make(local)
            env["HM_CHECKPOINT_DIR"] = local
        return env

    def _checkpoint_path(self, ref: TaskRef) -> str:
        """A task's checkpoint folder on this node, for tasks without data sets."""
        return f"{self._checkpoints}/{ref.id}"

    async def _execute(self, r: Running) -> None:
        ref, n = r.plan.ref, r.plan.attempt
        started = r.started_at or time.time()
        folder = self.attempt_path(ref, n)
        try:
            self._open_attempt_path(ref, n)
            wf = self.view.workflows[ref.workflow]
            exp = wf.recipe.experiment(ref.experiment)
            params = self.view.tasks.get(ref, {}).get("params", {})
            values = dict(params) | {
                "workflow_id": ref.workflow,
                "experiment": ref.experiment,
                "task_id": ref.id,
                "task_index": ref.index,
                "attempt": n,
            }
            commands = [render(c, values) for c in exp.command]
            env = self._environment(ref, n, params, folder)
            # Exactly the GPUs booked for it (none: every GPU hidden), in NVML's order.
            env.update(CUDA_VISIBLE_DEVICES=visible_devices(r.devices),
                       CUDA_DEVICE_ORDER="PCI_BUS_ID")
            try:
                env.update(await self._data_environment(ref, dict(exp.data)))
            except HypermeshError as exc:
                # The data set cannot be mounted here: the attempt fails (its log says
                # why) and retries, if any, may run where the store answers.
                self.decide(f"{ref} attempt {n}: data: {exc}")
                failed_log = self.attempt_log(ref, n)
                failed_log.write_text(f"hypermesh: cannot mount the task's data: {exc}\n")
                outcome = Outcome("failed", None, "data", time.time())
                await self._finish(r, exp.retries, started, outcome)
                self.logs.after_end(ref, n, failed_log)
                return
            log_path = f"{folder}.log"  # attempt_log's path, without pathlib's cost
            image = image_for(exp.framework, exp.image)
            if image is not None:
                commands, runtime = await self.containers.wrap(
                    f"{ref.id}-{n}", image, commands, env, self.base_env, r.devices,
                    Path(wf.workdir or self.work_dir), Path(log_path),
                )
                self.decide(f"{ref} attempt {n}: image {image} with {runtime or 'no runtime'}")
            process = r.process = AttemptProcess(
                commands,
                env=env,
                cwd=wf.workdir or self._work_dir,
                log_path=log_path,
                timeout=exp.timeout,
                grace=self.cfg.kill_grace,
            )
            if self._stop.is_set():
                r.process.stop("preempted", grace=self.drain_grace)
            outcome = await self.run_watched(r, exp, process, log_path)
            await self._finish(r, exp.retries, started, outcome)
            self.logs.after_end(ref, n, log_path)
        except Exception:
            log.exception("%s: attempt %s/%d crashed", self.cfg.name, ref, n)
            await self._finish(r, 0, started, Outcome("failed", None, "exit", time.time()))
        finally:
            self.running.pop(ref, None)
            self.gpu_pool.release(ref)
            # Left empty (as trivial tasks leave them): back to the pool of folders.
            self.dirs.recycle(folder)
            self.dirs.recycle(self._checkpoint_path(ref))
            self._wake.set()

    async def run_watched(
        self, r: Running, exp: Experiment, process: AttemptProcess, log_path: str
    ) -> Outcome:
        """Run an attempt's process while its log is copied to the store and its metrics
        are stored (and pruning asked); the metrics are stored once more at the end."""
        ref, n = r.plan.ref, r.plan.attempt
        copier = self.logs.while_running(ref, n, log_path)
        watch = attempt_watch(self, r, exp, log_path)
        stop_following = watch.follow_later(lambda: process.stop("pruned"))
        try:
            outcome = await process.run()
        finally:
            stop_following()
            if copier is not None:
                copier.cancel()
        try:
            await watch.finish()
        except Exception as exc:  # the claim is gone or etcd is away: the result decides
            self.decide(f"{ref} attempt {n}: metrics not stored: {exc}")
        return outcome

    async def _finish(self, r: Running, retries: int, started: float, outcome: Outcome) -> None:
        ref, n = r.plan.ref, r.plan.attempt
        attempt = Attempt(
            n,
            self.cfg.name,
            outcome.state,
            outcome.exit_code,
            outcome.reason,
            started,
            outcome.ended_at,
        )
        if r.block is not None:
            final = self.blocks.ended(r.block, r.claim_revision, ref.index, n, outcome.state,
                                      outcome.exit_code, outcome.reason, started,
                                      outcome.ended_at)
            if final != "succeeded":
                again = "; will run again" if final is None else f"; task {final}"
                self.decide(f"{ref} attempt {n} {outcome.state} ({outcome.reason}){again}")
            return
        # node-lost / preempted: runs again, not counted
        final = self.view.final_state(ref, outcome.state, outcome.reason, retries)
        delay = 0.1
        while True:  # until recorded, or until the claim is surely gone
            try:
                written = await self._record(
                    Finish(ref, r.claim_revision, r.plan.slot, attempt, final)
                )
                ok = written is not None
                if written is not None:
                    self.written_revision = max(self.written_revision, written)
                break
            except LeaseLost:
                ok = False
                break
            except EtcdUnavailable as exc:
                if self._lease_lost.is_set() or not self.lease_fresh():
                    ok = False
                    break
                log.warning("recording %s attempt %d: %s", ref, n, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
        if ok:
            suffix = f"; task {final}" if final else "; will run again"
            self.decide(f"{ref} attempt {n} {outcome.state} ({outcome.reason}){suffix}")
        else:
            self.decide(f"{ref} attempt {n} result rejected: claim no longer ours")

    async def _record(self, item: Finish) -> int | None:
        """Record an attempt's end; ends that arrive together share one transaction."""
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._finishing.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_finishes())
        return await future

    async def _flush_finishes(self) -> None:
        await asyncio.sleep(0)  # let attempts that end in the same loop turn join
        per_txn = 100 // Finish.OPS
        while self._finishing:
            batch = self._finishing[:per_txn]
            del self._finishing[:per_txn]
            try:
                revision = await finish_attempts(self.etcd, self.ks, [item for item, _ in batch])
                if revision is None and len(batch) > 1:
                    # One fence failed (a claim was lost): record the others alone.
                    for item, future in batch:
                        future.set_result(await finish_attempts(self.etcd, self.ks, [item]))
                    continue
                for _, future in batch:
                    future.set_result(revision)
            except Exception as exc:  # every waiter sees the failure and retries
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)

    async def _drain(self) -> None:
        self.state = "draining"
        self._health_changed()
        with contextlib.suppress(Exception):
            await self.gossip.leave()
        with contextlib.suppress(EtcdUnavailable):
            await self.etcd.put(
                self.ks.node(self.cfg.name), dumps(self.record().to_json()), self.lease
            )
        grace = self.cfg.kill_grace if self.drain_grace is None else self.drain_grace
        self.blocks.release_all()
        for r in list(self.running.values()):
            if r.process is not None:
                r.process.stop("preempted", grace=grace)
        self.gangs.stop_all("preempted", grace)
        deadline = time.monotonic() + grace + 10
        while (self.running or self.gangs.busy or self.blocks.busy()) and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        self.decide("drained")
