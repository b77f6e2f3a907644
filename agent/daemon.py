"""The agent daemon: one asyncio program per machine, and the composition root of its parts.

:class:`Agent` wires the configuration, the etcd client and the mirror of the namespace
(``MeshView``) to the agent's duties, serves its gRPC API (``agent/server.py``), its
``/metrics`` and its web dashboard, and owns its lifecycle:

- it holds one etcd lease for its whole registration (node key, every claim), kept alive
  while it lives; when it is lost, every attempt stops and the node rejoins with a new one;
- it mirrors the namespace with a watch;
- it stands for leader when no live node leads (``agent/leader/election.py``);
- its scheduling loop (``agent/scheduler.py``) leads while it is the leader
  (``agent/leader/duty.py``) and claims tasks that fit (``agent/claims/claimer.py``);
  ``agent/tasks/attempts.py`` runs them and records each attempt with a fenced transaction;
- gossip, chunk sharing, bursting, gangs, telemetry and the leader's housekeeping
  (retention, etcd compaction and defragmentation: ``agent/leader/housekeeping.py``) run
  beside it.

SIGTERM (or the Drain RPC, or a spot interruption notice) drains it: no new claims,
running tasks are stopped with a grace period and handed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import signal
import socket
import time
from typing import Any

import grpc

from hypermesh import addresses, keepalive
from hypermesh._proto import agent_pb2_grpc
from hypermesh.agent.burst import spot
from hypermesh.agent.burst.duty import BurstDuty
from hypermesh.agent.burst.policy import BurstConfig
from hypermesh.agent.claims.claimer import Claimer
from hypermesh.agent.claims.locality import Locality
from hypermesh.agent.claims.pool_wait import PoolWait
from hypermesh.agent.claims.unsure import UnsureClaims
from hypermesh.agent.gang.duty import GangDuty
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.duty import Gossip
from hypermesh.agent.leader.compaction import (
    TEST_TIMINGS_ENV,
    HousekeepingConfig,
    with_test_timings,
)
from hypermesh.agent.leader.duty import LeaderDuty
from hypermesh.agent.leader.election import Campaign
from hypermesh.agent.leader.housekeeping import Housekeeping
from hypermesh.agent.ops.health import Health
from hypermesh.agent.ops.metrics import MetricsServer
from hypermesh.agent.ops.telemetry import TaskRoot, Telemetry, detect_machine
from hypermesh.agent.scheduler import Scheduler
from hypermesh.agent.server import LOCAL_SOCKET, AgentServicer, LocalSocket, local_socket_path
from hypermesh.agent.share.config import ShareConfig
from hypermesh.agent.share.duty import ChunkShare
from hypermesh.agent.tasks.attempts import Attempts
from hypermesh.agent.tasks.blocks import BlockDuty
from hypermesh.agent.tasks.containers import Containers
from hypermesh.agent.tasks.dirpool import DirPool
from hypermesh.agent.tasks.gpu_pool import GpuPool, gpu_source
from hypermesh.agent.tasks.images import ImageCache, ImageConfig, images_in_use
from hypermesh.agent.tasks.lifeline import Lifeline
from hypermesh.agent.tasks.logs import LogShipper
from hypermesh.agent.tasks.metrics_watch import PruningMedians
from hypermesh.agent.tasks.mounts import Mounts
from hypermesh.agent.tasks.runner import use_pidfd_child_watcher
from hypermesh.agent.tasks.task_env import host_env
from hypermesh.config import SMALL_MESSAGE_GRPC_OPTIONS, AgentConfig
from hypermesh.errors import EtcdUnavailable, LeaseLost
from hypermesh.etcd_security import PLAINTEXT
from hypermesh.etcd_watch import Following
from hypermesh.exposure import dashboard_https, warn_exposed
from hypermesh.state.etcd import Etcd, hush_broken_stream_noise, keepalive_interval
from hypermesh.state.folding import FOLD_AFTER_TASKS
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import NodeRecord, dumps
from hypermesh.state.settings import take_watch_seat
from hypermesh.state.view import MeshView, load_view

log = logging.getLogger("hypermesh.agent")

STOP_STEP_S = 5.0  # longest wait for each step of stopping
SNAPSHOT_S = 2.0  # longest a --watch own node's dashboard reuses a view read from etcd


def bind_dashboard(listen: str) -> socket.socket:
    """The web dashboard's listening socket on ``listen`` (HOST:PORT, port 0: any
    free one), bound at once so that a taken port fails the start with OSError."""
    host, _, port = listen.rpartition(":")
    try:
        return socket.create_server((host, int(port)), backlog=64)
    except OSError as exc:
        raise OSError(f"cannot serve the dashboard on {listen} (--http-listen): {exc}") from exc


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


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """Which event loop runs the agent: ``uvloop``, or ``asyncio`` (its log says)."""
    return type(loop).__module__.partition(".")[0]


class Agent:
    """One agent: its configuration, its lease, its mirror of the namespace and its duties.

    Everything runs on one event loop; nothing here is touched from another thread. Each
    duty receives this object through a narrow protocol of its own (the ``*Host`` classes
    beside the duties) and changes only what its protocol says it writes. The agent itself
    owns the node lease (``lease``, ``last_renewal``, ``lease_lost``), its registration
    (``state``, the addresses) and the lifecycle events:

    - ``stopping``: set once, when a drain is asked for; never cleared;
    - ``lease_lost``: set when the node lease is gone (by the keeper, the scheduling loop
      or a duty that met ``LeaseLost``), cleared when the node has rejoined;
    - ``mirror_ready``: set once the mirror holds the namespace;
    - ``view_changed``: set on every batch the mirror applies (the campaign clears it);
    - ``wakeup``: wakes the scheduling loop (:meth:`wake`).

    Shared counters: ``written_revision`` is the newest revision this node wrote (every
    writer raises it, none lowers it): claims wait until the mirrored view has caught up
    with it (read-your-writes). ``claiming`` holds the tasks of the claim transaction in
    flight (written only by the claimer). ``running`` is the attempts' table
    (:attr:`Attempts.running`, the same dict). ``cfg`` is replaced only by the Drain RPC
    (a new kill grace).
    """

    def __init__(self, cfg: AgentConfig, endpoints: list[str], namespace: str) -> None:
        self.cfg = cfg
        self.ks = Keyspace(namespace)
        self.etcd = Etcd(endpoints, security=cfg.etcd_security or PLAINTEXT)
        self.view = MeshView(self.ks)
        self._node_record: tuple[tuple[object, ...], NodeRecord] | None = None
        # Only the leader (and a node claiming a block) needs every batch of every block
        # applied; the rest wait in the view until asked for (``full_view``).
        self.view.defer_batches = True
        # Settled blocks past this many tasks are kept as counts (hypermesh/state/folding.py).
        self.view.fold_after = FOLD_AFTER_TASKS
        self.gpu_source = gpu_source(cfg.gpus, cfg.gpu_type)
        self.gpu_pool = GpuPool()
        devices = self.gpu_source.devices()
        self.machine = detect_machine(
            len(devices), cfg.gpu_type or (devices[0].name if devices else "")
        )
        self.work_dir = cfg.work_dir.resolve()
        self.dirs = DirPool(self.work_dir / "spare-dirs")  # empty folders for attempts
        self.lease = 0
        self.last_renewal = time.monotonic()
        # The lease this agent gave up while it could not reach etcd: its tasks are
        # stopped, and gossip asks the peers that reach etcd to revoke it (its claims).
        self.gave_up: int | None = None
        self.rejoined_at: float | None = None  # monotonic; see rejoined_since
        self.drain_grace: float | None = None
        self.written_revision = 0
        # A task gets the allow-listed part of the agent's environment, and what its
        # recipe names (pass_env) from the rest: never the agent's credentials.
        self.agent_env = dict(os.environ)
        self.base_env = host_env(self.agent_env, cfg.task_env)
        self.stopping = asyncio.Event()
        self.lease_lost = asyncio.Event()
        self.mirror_ready = asyncio.Event()
        self.view_changed = asyncio.Event()
        # ``--watch own``: the mirror follows ``Keyspace.own_ranges`` until this node leads,
        # then the whole namespace (``_widen``); ``view_whole`` is set once it holds it.
        self.view_whole = asyncio.Event()
        if cfg.watch == "all":
            self.view_whole.set()
        self.watch_seat: int | None = None  # ``--watch auto``: the seat it took, if any
        self.pruning_medians = PruningMedians(self.etcd, self.ks)  # pruning, when partial
        self._mirror: asyncio.Task[None] | None = None
        self._widening = False
        self._snapshot: tuple[float, MeshView] | None = None  # read_view's, when partial
        self._snapshot_lock = asyncio.Lock()
        self.wakeup = asyncio.Event()
        # Agents gossip with lan timings in every preset: real gRPC round trips
        # between Python processes on a loaded 2-core machine need them.
        self.gossip = Gossip(self, GossipConfig.lan())
        self.containers = Containers(cfg.container_runtime)
        # Images pulled ahead of claims, kept within a budget; what is being pulled goes
        # into the node's record (publish_record), for `hypermesh tasks`.
        self.images = ImageCache(
            ImageConfig.for_agent(cfg.preset, cfg.image_budget, cfg.image_pull_deadline),
            self.work_dir, self.containers.runtime,
            in_use=self._images_in_use,
            changed=self.publish_record, wake=self.wake, decide=self.decide,
        )
        self._publishing: asyncio.Task[None] | None = None
        self._republish = False
        self.mounts = Mounts(self.work_dir, cfg.store, cfg.cache_size, cfg.data_deadline)
        share_cfg = ShareConfig.local() if cfg.preset == "local" else ShareConfig.lan()
        self.share = ChunkShare(self, share_cfg)  # peer chunk sharing; .share.peers.holders()
        self.logs = LogShipper(cfg.store, namespace, cfg.log_upload_s)
        self.locality = None if cfg.locality_delay is None else Locality(
            cfg.name, cfg.store, cfg.locality_delay, self.mounts, self.wake,
            self.decide, self.gossip.alive, self.share.peers.holders,
        )
        self.pool_wait = PoolWait(cfg.pool_delay, self.wake, self.decide, self.gossip.alive)
        burst_cfg = BurstConfig.local() if cfg.preset == "local" else BurstConfig.lan()
        self.burst = BurstDuty(self, burst_cfg)  # acts only while this agent leads
        self.gangs = GangDuty(self)  # seats in gangs (experiments with nodes > 1)
        # Retention, compaction and defragmentation; acts only while this agent leads.
        housekeeping = (HousekeepingConfig.local() if cfg.preset == "local"
                        else HousekeepingConfig.lan())
        self.housekeeping = Housekeeping(
            self, with_test_timings(housekeeping, os.environ.get(TEST_TIMINGS_ENV)))
        self.address = ""  # where peers and the CLI reach it: cfg.advertise, else bound_address
        self.bound_address = ""  # the gRPC server's bound HOST:PORT (maybe 0.0.0.0)
        self.http_address = ""
        self.metrics_address = ""
        self._dashboard: Any = None  # the web dashboard's aiohttp runner, once serving
        self._dashboard_start: asyncio.Task[None] | None = None
        self.state = "alive"
        self.started_at = time.time()
        self.blocks = BlockDuty(self)
        self.unsure = UnsureClaims(self.etcd, self.ks, cfg.name, lambda: self.lease, self.decide)
        self.attempts = Attempts(self)
        self.running = self.attempts.running
        self.claiming: set[TaskRef] = set()  # tasks of the claim transaction in flight
        self.claimer = Claimer(self)
        self.leader_duty = LeaderDuty(self)
        self.leader_duty.offers.free_gpus = self.gossip.free_gpus  # GPU work: where one is free
        self.leader_duty.offers.locality = self.locality  # inputs: where the data is
        self.leader_duty.offers.pool_delay = cfg.pool_delay  # prefer_pools: their nodes first
        self.leader_duty.offers.alive = self.gossip.alive
        self.campaign = Campaign(self)
        self.scheduler = Scheduler(self)
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None  # --health-listen
        self._local: LocalSocket | None = None  # the socket of this agent's mounts
        self.telemetry = Telemetry(self.work_dir, cfg.telemetry_period, cfg.telemetry_history)
        self.health: Health | None = None
        self.metrics: MetricsServer | None = None

    # ------------------------------------------------------------------ identity
    def record(self) -> NodeRecord:
        """The node's registration record as of now (made again only when what can
        change has: the scheduler asks for it at every wake-up)."""
        key = (self.cfg, self.machine, self.address, self.state, self.lease, self.started_at,
               self.metrics_address, self.http_address,
               self.images.version)  # the same objects: compared by identity
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
            pulling=self.images.pulling(),
            offers=self.cfg.watch == "own",
        )

    def _images_in_use(self) -> set[str]:
        return images_in_use(self.view, self.attempts.running)

    def publish_record(self) -> None:
        """Write the node's record again (what it pulls changed): one write at a time,
        each of the record as it is then; nothing while the node holds no lease."""
        if self._publishing is not None and not self._publishing.done():
            self._republish = True
            return
        self._publishing = asyncio.ensure_future(self._put_record())

    async def _put_record(self) -> None:
        self._republish = True
        while self._republish:
            self._republish = False
            if not self.lease or self.lease_lost.is_set():
                return  # rejoining registers the record as it is then
            try:
                await self.etcd.put(
                    self.ks.node(self.cfg.name), dumps(self.record().to_json()), self.lease
                )
            except (EtcdUnavailable, LeaseLost) as exc:
                log.warning("%s: node record not updated: %s", self.cfg.name, exc)

    def decide(self, message: str) -> None:
        """The node's decision log (claimed, lost lease, result rejected...), one
        line each in the agent's log, which tests and operators read."""
        log.info("%s: %s", self.cfg.name, message)

    @property
    def is_leader(self) -> bool:
        """This node leads: the view says so, and holds the whole namespace (a node
        that watched only its own part leads once its mirror has widened)."""
        return self.view.leader() == self.cfg.name and self.view_whole.is_set()

    def _start_mirror(
        self, ranges: list[tuple[str, str]], ready: asyncio.Event
    ) -> asyncio.Task[None]:
        # Watching its own part, the node follows the workflows it works on as well.
        following = Following(self.ks.workflow_ranges) if ranges else None
        self.view.following = following
        task = asyncio.create_task(
            self.etcd.mirror(
                self.ks.root,
                self.view.apply,
                self._on_batch,
                reset=self.view.reset,
                ready=ready,
                # Workflows and blocks before batches, so that those fold as they come.
                first=(self.ks.kind_prefix("wf"), self.ks.kind_prefix("block")),
                tidy=self.view.fold_settled,
                ranges=ranges,
                following=following,
            ),
            name="mirror",
        )
        task.add_done_callback(self._task_died)
        self._mirror = task
        return task

    def _widen(self) -> None:
        """Elected while watching only part of the namespace: load all of it and follow
        it from now on, in place of the partial mirror (the view is reloaded whole)."""
        old, self._widening = self._mirror, True
        if old is not None:
            old.cancel()
            self._tasks.remove(old)
        self.decide("elected: watching the whole namespace")
        self._tasks.append(self._start_mirror([], self.view_whole))

    def candidacy(self) -> tuple[str, int] | None:
        """The election key this node stands with and its create revision (None: it
        holds none); the leader's burst writes are fenced on it (``agent/burst/fence.py``)."""
        return self.campaign.held()

    def full_view(self) -> MeshView:
        """The view with every batch applied, for readers of per-task state (status,
        logs, metrics, the dashboard); scheduling reads ``view``."""
        self.view.settle()
        return self.view

    async def read_view(self) -> MeshView:
        """What readers of per-task state on request (the dashboard, logs) read: the full
        view; on a node that watches only its own part (``--watch own``), a snapshot of
        the namespace read from etcd, at most ``SNAPSHOT_S`` old, as the CLI reads it."""
        if self.view_whole.is_set():
            return self.full_view()
        async with self._snapshot_lock:
            if self._snapshot is None or time.monotonic() - self._snapshot[0] > SNAPSHOT_S:
                self._snapshot = (time.monotonic(),
                                  await load_view(self.etcd, self.ks, fold=True))
            return self._snapshot[1]

    def wake(self) -> None:
        """Wake the scheduling loop: something it acts on may have changed."""
        self.wakeup.set()

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "checkpoints").mkdir(exist_ok=True)
        self.dirs.open()
        # Kill what an earlier agent here left running; this agent's tasks die with it.
        self.lifeline = Lifeline.open(self.work_dir, self.decide)
        use_pidfd_child_watcher()
        hush_broken_stream_noise(asyncio.get_running_loop())
        self.decide(f"event loop: {loop_kind(asyncio.get_running_loop())}")
        tune_gc()
        await self.etcd.connect()
        self._server = grpc.aio.server(options=(*SMALL_MESSAGE_GRPC_OPTIONS,
                                                *keepalive.AGENT_SERVER_OPTIONS))
        servicer = AgentServicer(self)
        agent_pb2_grpc.add_AgentServicer_to_server(servicer, self._server)
        self.health = Health(self._server)
        host = self.cfg.listen.rpartition(":")[0]
        warn_exposed(self.cfg)
        if self.cfg.tls is not None:
            port = self._server.add_secure_port(self.cfg.listen, self.cfg.tls.server_credentials())
        else:
            port = self._server.add_insecure_port(self.cfg.listen)
        if port == 0:
            raise OSError(f"cannot listen on {self.cfg.listen}")
        self.bound_address = f"{host}:{port}"
        self.address = addresses.advertised(self.bound_address, self.cfg.advertise)
        await self.health.start()  # NOT_SERVING until registered
        await self._server.start()
        if self.cfg.peer_sharing:
            await self._serve_mounts(servicer)
        if self.cfg.health_listen is not None:
            self._health_server = await self.health.serve_plaintext(self.cfg.health_listen)
        if self.cfg.metrics_listen is not None:
            self.metrics = MetricsServer(self)
            self.metrics_address = addresses.public(
                await self.metrics.start(self.cfg.metrics_listen), self.cfg.advertise)
            (self.work_dir / "agent.metrics").write_text(self.metrics_address + "\n")
        dashboard_socket = None
        if self.cfg.http_listen is not None:
            dashboard_socket = bind_dashboard(self.cfg.http_listen)
            host, port = dashboard_socket.getsockname()[:2]
            self.http_address = addresses.public(f"{host}:{port}", self.cfg.advertise)
        await self._register()
        self._health_changed()
        (self.work_dir / "agent.address").write_text(self.address + "\n")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain)
        self._tasks = [
            asyncio.create_task(self._keep_lease(), name="lease"),
            asyncio.create_task(self.scheduler.run(), name="schedule"),
            asyncio.create_task(self.campaign.run(), name="campaign"),
            asyncio.create_task(self._run_gossip(), name="gossip"),
            asyncio.create_task(self._run_burst(), name="burst"),
            asyncio.create_task(self._run_housekeeping(), name="housekeeping"),
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
        self._tasks.append(self._start_mirror(
            self.ks.own_ranges(self.cfg.name) if self.cfg.watch == "own" else [],
            self.mirror_ready))
        if dashboard_socket is not None:
            self._dashboard_start = asyncio.create_task(self._serve_dashboard(dashboard_socket))
        bound = ("" if self.bound_address == self.address
                 else f" (listening on {self.bound_address})")
        self.decide(f"started at {self.address}{bound} with lease {self.lease:x}")
        try:
            await self.stopping.wait()
            await self._drain()
        finally:
            # Every step is bounded: a stuck peer or etcd must not keep a drained
            # node (and the spot machine it runs on) from exiting.
            for t in self._tasks:
                t.cancel()
            await asyncio.wait(self._tasks, timeout=STOP_STEP_S)
            for lease in (self.campaign.lease, self.lease):
                if not lease:  # a follower holds no candidacy lease
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.etcd.revoke(lease), STOP_STEP_S)
            if self.metrics is not None:
                await self.metrics.close()
            await self._server.stop(grace=1.0)
            if self._local is not None:
                await self._local.stop(grace=None)
            if self._health_server is not None:
                await self._health_server.stop(grace=None)
            self.telemetry.close()
            if self.locality is not None:
                self.locality.close()
            self.pool_wait.close()
            await self.images.close()
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

    async def _serve_mounts(self, servicer: AgentServicer) -> None:
        """Give the mounts this agent starts its Unix socket (``agent/server.py``), or
        its TCP address (and its TLS files) where the socket's path is too long or the
        socket cannot be served."""
        path = local_socket_path(self.work_dir)
        if path is not None:
            local = LocalSocket(path, servicer)
            try:
                await local.start()
            except OSError as exc:
                await local.stop(grace=None)
                log.warning("%s: no socket for mounts at %s (%s); they reach this agent "
                            "at %s", self.cfg.name, path, exc,
                            addresses.local(self.bound_address))
            else:
                self._local = local
                self.mounts.agent_address = local.address
                return
        else:
            log.warning("%s: %s is too long for a Unix socket; mounts reach this agent "
                        "at %s", self.cfg.name, self.work_dir / LOCAL_SOCKET,
                        addresses.local(self.bound_address))
        # The mounts run here: the bound address (not an advertised one, which may be a
        # NAT's), loopback for a wildcard.
        self.mounts.agent_address = addresses.local(self.bound_address)
        self.mounts.tls = self.cfg.tls

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
        c = self.cfg
        scheme = "https" if dashboard_https(c.http_listen, c.tls is not None,
                                            c.dashboard_token is not None) else "http"
        login = ", login required" if c.dashboard_token is not None else ""
        self.decide(f"dashboard at {scheme}://{self.http_address}/{login}")

    async def _run_gossip(self) -> None:
        await self.mirror_ready.wait()  # seeds come from the etcd registry
        await self.gossip.run()

    async def _run_burst(self) -> None:
        await self.mirror_ready.wait()
        await self.burst.run()

    async def _run_housekeeping(self) -> None:
        await self.mirror_ready.wait()
        await self.housekeeping.run()

    def _task_died(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.stopping.is_set():
            return
        log.error(
            "%s: %s stopped unexpectedly", self.cfg.name, task.get_name(), exc_info=task.exception()
        )
        self.request_drain()

    def request_drain(self, grace: float | None = None, why: str = "drain requested") -> None:
        if not self.stopping.is_set():
            self.drain_grace = grace
            self.decide(why)
            self.stopping.set()

    def _on_spot_notice(self, notice: spot.Notice) -> None:
        grace = spot.drain_grace(notice, time.time(), self.cfg.kill_grace)
        self.request_drain(grace, f"spot interruption notice ({notice.action}); draining")

    def _health_changed(self) -> None:
        if self.health is not None:
            self.health.refresh(self.state, self.lease_is_lost)

    def _task_roots(self) -> list[TaskRoot]:
        """The first process of each running attempt and gang member, for telemetry."""
        return self.attempts.task_roots() + self.gangs.task_roots()

    def _on_batch(self, revision: int) -> None:
        if not self._widening and self.view.leader() == self.cfg.name and (
            not self.view_whole.is_set()
        ):
            self._widen()
        self.view.fold_settled()
        self.leader_duty.dirty = True
        self.view_changed.set()
        self.wakeup.set()
        self.gangs.wake()

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
        self.attempts.stop_all("preempted", grace)
        self.gangs.stop_all("preempted", grace)
        deadline = time.monotonic() + grace + 10
        while (self.running or self.gangs.busy or self.blocks.busy()) and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        self.decide("drained")

    # ------------------------------------------------------------------ the node lease
    async def _register(self) -> None:
        self.lease = await self.etcd.grant(self.cfg.lease_ttl)
        self.last_renewal = time.monotonic()
        if self.cfg.watch == "auto" or self.watch_seat is not None:
            await self._take_watch_seat()
        await self.etcd.put(self.ks.node(self.cfg.name), dumps(self.record().to_json()), self.lease)

    async def _take_watch_seat(self) -> None:
        """``--watch auto``: watch the whole namespace if a seat is free for it (the mesh
        setting ``watch-all``), else only this node's part. Decided once, at the first
        registration (the mirror starts after it); a node that rejoins with a new lease
        takes a seat again, and keeps watching everything when none is left."""
        seat = await take_watch_seat(self.etcd, self.ks, self.cfg.name, self.lease)
        if self.cfg.watch == "auto":
            self.cfg = dataclasses.replace(self.cfg, watch="own" if seat is None else "all")
            if seat is None:
                self.decide("watches its own part: every watch-all seat is taken")
            else:
                self.view_whole.set()
                self.decide(f"watches the whole namespace (watch-all seat {seat})")
        elif seat is None:
            self.decide("rejoined without a watch-all seat; still watches the whole namespace")
        self.watch_seat = seat

    @property
    def lease_is_lost(self) -> bool:
        return self.lease_lost.is_set()

    def rejoined_since(self, when: float) -> bool:
        """Whether the node rejoined with a new lease (after losing one) after ``when``
        (monotonic). Its gossip still holds what it concluded while cut off: suspicions
        of the peers it could not reach, which the heal can turn into deaths (a last
        probe through a connection the cut left dead) that are about its own isolation."""
        return self.rejoined_at is not None and self.rejoined_at > when

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
                    self.lease, self.cfg.lease_ttl, self.lease_lost.set, self._renewed,
                    give_up_after=give_up_after(self.cfg.lease_ttl),
                )
            )
            try:
                await self.lease_lost.wait()
            finally:
                keeper.cancel()
            self.wakeup.set()
            self._health_changed()
            await self._handle_lease_lost()
            self._health_changed()

    async def _handle_lease_lost(self) -> None:
        """Our claims are gone: stop every attempt now (their results would be
        rejected anyway), then rejoin with a new lease."""
        self.decide(f"lost lease {self.lease:x}; stopping {len(self.running)} attempts")
        self.blocks.drop_all()
        self.attempts.stop_all("node-lost", grace=0)
        await self.gangs.lease_lost()
        while not self.attempts.processes_gone():  # an attempt set up meanwhile stops too
            self.attempts.stop_all("node-lost", grace=0)
            await asyncio.sleep(0.05)
        # Stopped before anyone can take them over: now peers may revoke it for us (the
        # attempts' ends are written, or found rejected, when etcd answers again).
        self.gave_up = self.lease
        while self.running:
            await asyncio.sleep(0.05)
        while True:
            try:
                await self._register()
                break
            except (EtcdUnavailable, LeaseLost) as exc:  # LeaseLost: granted by a member
                log.warning("re-register failed: %s", exc)  # that lost it in an election
                await asyncio.sleep(1)
        self.rejoined_at = time.monotonic()
        await self.etcd.revoke(self.gave_up)  # if no peer did: our old claims, at once
        self.gave_up = None
        self.lease_lost.clear()
        self.decide(f"rejoined with lease {self.lease:x}")
        self.wakeup.set()


def give_up_after(ttl: int) -> float:
    """Seconds without an answered renewal after which an agent gives its lease up:
    two renewal intervals (two renewals in a row failed), a third of the TTL before
    etcd can expire it, so its tasks stop before any peer may take them over."""
    return min(float(ttl), 2 * keepalive_interval(ttl))
