"""Gang claims: the agent's I/O side. The policy, and why it cannot deadlock, is in
``agent/gang/policy.py``; the records and transactions in ``hypermesh.state.gangs``/``gang_txns``.

``GangDuty`` runs beside the agent's ordinary claims. On every change of the mirrored
view (and, while it holds or joins a seat or backs off, every ``TICK_S``, for the
waiting bound) it asks ``gang.plan`` what to do
and carries it out: takes and gives back seats, starts a gang (rank 0), runs this
node's member process with the rendezvous environment, records member ends and (rank
0) the attempt. Only the agent's event loop touches its state. A seat takes one of
the node's slots (and its GPUs, booked at join) from the moment it is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hypermesh.agent.gang import policy as gang
from hypermesh.agent.ops.telemetry import TaskRoot
from hypermesh.agent.tasks.containers import image_for
from hypermesh.agent.tasks.gpu_pool import visible_devices
from hypermesh.agent.tasks.runner import AttemptProcess, Outcome
from hypermesh.agent.tasks.running import Running
from hypermesh.errors import EtcdUnavailable, HypermeshError, LeaseLost
from hypermesh.recipe.templating import render
from hypermesh.state import gang_txns
from hypermesh.state.gangs import MemberEnd, Rendezvous
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import Attempt
from hypermesh.state.txns import ClaimPlan, Finish

if TYPE_CHECKING:
    from hypermesh.agent.ops.telemetry import Machine
    from hypermesh.agent.tasks.attempts import Attempts
    from hypermesh.agent.tasks.containers import Containers
    from hypermesh.agent.tasks.gpu_pool import DeviceSource, GpuPool
    from hypermesh.agent.tasks.logs import LogShipper
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.records import NodeRecord
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")

TICK_S = 0.5  # the longest time between two looks at the gangs (waiting bounds)
CHECKPOINTS = ".hm-checkpoints"  # a gang's checkpoints without data: under the workdir


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for a gang's rendezvous (rank 0's master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def gang_checkpoint_dir(workdir: Path, ref: TaskRef) -> Path:
    """Where every rank of a gang without data keeps its checkpoints: one folder of the
    workflow's workdir, which every node shares (it runs the commands there)."""
    return workdir / CHECKPOINTS / ref.id


class GangHost(Protocol):
    """What :class:`GangDuty` uses of its agent. It writes ``written_revision`` (never
    lowers it), sets ``lease_lost`` when a write meets ``LeaseLost``, and runs its member
    processes through the agent's attempts (their folders, environment and watch)."""

    cfg: AgentConfig
    view: MeshView
    etcd: Etcd
    ks: Keyspace
    lease: int
    address: str  # advertised: where the other ranks reach this node
    bound_address: str  # what it binds here (``address`` may be a NAT's or a name)
    work_dir: Path
    base_env: dict[str, str]
    machine: Machine
    gpu_source: DeviceSource
    gpu_pool: GpuPool
    containers: Containers
    logs: LogShipper
    attempts: Attempts
    running: dict[TaskRef, Running]
    claiming: set[TaskRef]
    written_revision: int
    drain_grace: float | None
    mirror_ready: asyncio.Event
    stopping: asyncio.Event
    lease_lost: asyncio.Event

    @property
    def lease_is_lost(self) -> bool: ...

    def lease_fresh(self) -> bool: ...

    def record(self) -> NodeRecord: ...

    def decide(self, message: str) -> None: ...

    def wake(self) -> None: ...


class GangDuty:
    """This agent's seats in gangs and their processes. Only the agent's event loop
    touches its state; only this duty changes it."""

    def __init__(self, agent: GangHost) -> None:
        self.agent = agent
        self.cfg = gang.GangConfig.local() if agent.cfg.preset == "local" else gang.GangConfig.lan()
        self.members: dict[TaskRef, gang.Member] = {}
        self.backoff: dict[TaskRef, float] = {}
        self.processes: dict[TaskRef, AttemptProcess] = {}
        self.devices: dict[TaskRef, list[int]] = {}  # GPUs booked for each seat
        self.joining: set[TaskRef] = set()  # seats whose join transaction is in flight
        self.written_revision = 0
        self._wake = asyncio.Event()
        self._runs: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        self._wake.set()

    def held(self) -> set[TaskRef]:
        """Gang tasks this node holds a seat of, or is joining: each takes a slot."""
        return set(self.members) | self.joining

    def task_roots(self) -> list[TaskRoot]:
        """The first process of each member process running here, for telemetry."""
        roots = []
        for ref, process in self.processes.items():
            pid = process.pid
            if pid is not None:
                roots.append(TaskRoot(ref.id, self.members[ref].attempt, pid))
        return roots

    @property
    def busy(self) -> bool:
        return any(m.running for m in self.members.values())

    def stop_all(self, reason: str, grace: float | None = None) -> None:
        for ref, process in self.processes.items():
            self.members[ref].stopping = True
            process.stop(reason, grace=grace)

    async def lease_lost(self) -> None:
        """Our seats went with our lease: stop every member process now and forget them."""
        self.stop_all("node-lost", grace=0)
        while self.busy:
            await asyncio.sleep(0.05)
        for ref in list(self.members):
            self._forget(ref)

    async def run(self) -> None:
        agent = self.agent
        await agent.mirror_ready.wait()
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # arrives as the event fires, and the agent's stop would wait for this loop.
            # Time matters only to seats held or being joined (the waiting bound) and
            # to back-offs; with none, only a change of the view (a wake) brings work.
            timeout = TICK_S if self.members or self.joining or self.backoff else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            if agent.lease_is_lost or agent.view.revision < self.written_revision:
                continue
            try:
                await self._tick()
            except LeaseLost:
                agent.lease_lost.set()
            except EtcdUnavailable as exc:
                log.warning("%s: gangs: %s", agent.cfg.name, exc)

    async def _tick(self) -> None:
        agent = self.agent
        free = (agent.cfg.slots - len(agent.running) - len(agent.claiming) - len(self.members)
                - len(self.joining))
        actions = gang.plan(
            agent.view, agent.record(), self.members, self.backoff, free, time.monotonic(),
            self.cfg, accepting=not agent.stopping.is_set(),
        )
        for action in actions:
            await self._do(action)

    def _wrote(self, revision: int | None) -> None:
        if revision is not None:
            self.written_revision = max(self.written_revision, revision)
            self.agent.written_revision = max(self.agent.written_revision, revision)

    def _forget(self, ref: TaskRef) -> None:
        self.members.pop(ref, None)
        self.devices.pop(ref, None)
        self.agent.gpu_pool.release(("gang", ref))

    async def _do(self, action: gang.Action) -> None:
        agent = self.agent
        if isinstance(action, gang.Join):
            await self._join(action)
        elif isinstance(action, gang.Leave):
            m = self.members[action.ref]
            if action.why != "lost":
                await gang_txns.leave(agent.etcd, agent.ks, m.ref, m.rank, m.seat_revision)
            if action.why == "timeout":
                self.backoff[action.ref] = time.monotonic() + self.cfg.backoff_s
            self._forget(action.ref)
            agent.decide(f"left gang {action.ref} rank {m.rank} ({action.why})")
            agent.wake()  # its slot is free for ordinary claims
        elif isinstance(action, gang.Start):
            await self._start(action.plan, action.seats)
        elif isinstance(action, gang.Launch):
            m = self.members[action.ref]
            m.attempt, m.running, m.stopping = action.rdv.attempt, True, False
            m.started_at = time.time()
            run = asyncio.create_task(self._run_member(m, action.rdv), name=f"gang {m.ref}")
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)
        elif isinstance(action, gang.Stop):
            m = self.members[action.ref]
            m.stopping = True
            process = self.processes.get(action.ref)
            if process is not None:
                process.stop(action.reason)
            agent.decide(f"{action.ref} attempt {m.attempt} rank {m.rank}: stopping "
                         f"({action.reason})")
        elif isinstance(action, gang.Record):
            await self._record(action)
        elif isinstance(action, gang.Drop):
            self.members[action.ref].outcome = None

    async def _join(self, action: gang.Join) -> None:
        agent = self.agent
        ref = action.ref
        exp = agent.view.workflows[ref.workflow].recipe.experiment(ref.experiment)
        if agent.machine.gpus and (exp.hardware.gpus or exp.hardware.gpu_memory):
            devices = agent.gpu_source.devices()
            booked = agent.gpu_pool.book(("gang", ref), exp.hardware, devices)
            if booked is None:
                return  # no GPU fits now: another look after the next change
            self.devices[ref] = booked
        host = agent.address.rpartition(":")[0]
        self.joining.add(ref)
        revision = None
        try:
            revision = await gang_txns.join(
                agent.etcd, agent.ks, ref, action.rank, agent.cfg.name, host, agent.lease
            )
        finally:
            self.joining.discard(ref)
            if revision is None:
                self.devices.pop(ref, None)
                agent.gpu_pool.release(("gang", ref))
        if revision is None:
            return  # someone took that rank first; the watch brings the change
        self._wrote(revision)
        self.members[ref] = gang.Member(ref, action.rank, revision, time.monotonic())
        agent.decide(f"joined gang {ref} as rank {action.rank} of {exp.nodes}")

    async def _start(self, plan: ClaimPlan, seats: dict[int, tuple[str, int]]) -> None:
        agent = self.agent
        host = agent.address.rpartition(":")[0]
        # Peers dial the advertised host; the port is probed where this node binds.
        rdv = Rendezvous(plan.attempt, host, free_port(agent.bound_address.rpartition(":")[0]),
                         seats, 0)
        revision = await gang_txns.start(
            agent.etcd, agent.ks, plan, rdv, agent.cfg.name, agent.lease, time.time()
        )
        if revision is None:
            return  # a seat changed meanwhile; the watch brings it
        self._wrote(revision)
        if plan.lost is not None:
            agent.decide(f"{plan.ref} attempt {plan.lost.attempt} on {plan.lost.node} lost")
        members = ", ".join(f"{r}={seats[r][0]}" for r in sorted(seats))
        agent.decide(f"started gang {plan.ref} attempt {plan.attempt} "
                     f"(master {host}:{rdv.master_port}; {members})")

    async def _record(self, action: gang.Record) -> None:
        agent = self.agent
        m = self.members[action.ref]
        rdv, end = action.rdv, action.end
        slot = agent.view.claims[action.ref].slot if action.ref in agent.view.claims else None
        attempt = Attempt(m.attempt, agent.cfg.name, end.state, end.exit_code, end.reason,
                          m.started_at, time.time())
        item = Finish(action.ref, rdv.revision, slot, attempt, action.final)
        revision = await gang_txns.finish(agent.etcd, agent.ks, item, rdv)
        m.outcome = None
        m.since = time.monotonic()
        self._wrote(revision)
        if revision is None:
            agent.decide(f"{action.ref} attempt {m.attempt} result rejected: gang changed")
            return
        suffix = f"; task {action.final}" if action.final else "; will run again"
        agent.decide(f"{action.ref} attempt {m.attempt} {end.state} ({end.reason}){suffix}")

    async def _run_member(self, m: gang.Member, rdv: Rendezvous) -> None:
        """Run this node's process of attempt ``rdv.attempt``, then record how it ended."""
        agent = self.agent
        ref, n = m.ref, rdv.attempt
        try:
            end = await self._process(m, rdv)
        except HypermeshError as exc:  # the data sets cannot be mounted here
            agent.decide(f"{ref} attempt {n} rank {m.rank}: data: {exc}")
            end = MemberEnd("failed", None, "data")
        except Exception:
            log.exception("%s: gang %s attempt %d crashed", agent.cfg.name, ref, n)
            end = MemberEnd("failed", None, "exit")
        finally:
            self.processes.pop(ref, None)
            m.running = m.stopping = False
            m.since = time.monotonic()
        agent.decide(f"{ref} attempt {n} rank {m.rank} ended {end.state} ({end.reason})")
        if m.rank == 0:
            m.outcome = end
        else:
            await self._report_end(m, rdv, end)
        self.wake()

    async def _report_end(self, m: gang.Member, rdv: Rendezvous, end: MemberEnd) -> None:
        """Record a member's end for rank 0, retried while etcd is away and our lease is
        fresh (rank 0 waits for it); a fenced-off write (the attempt is over) is dropped."""
        agent = self.agent
        delay = 0.1
        while not agent.lease_is_lost and agent.lease_fresh():
            try:
                self._wrote(await gang_txns.member_end(
                    agent.etcd, agent.ks, m.ref, rdv.attempt, m.rank, end, rdv.revision,
                    m.seat_revision,
                ))
                return
            except LeaseLost:
                return
            except EtcdUnavailable as exc:
                log.warning("%s: recording %s rank %d: %s", agent.cfg.name, m.ref, m.rank, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    async def _process(self, m: gang.Member, rdv: Rendezvous) -> MemberEnd:
        agent = self.agent
        ref, n = m.ref, rdv.attempt
        wf = agent.view.workflows[ref.workflow]
        exp = wf.recipe.experiment(ref.experiment)
        params = agent.view.tasks.get(ref, {}).get("params", {})
        values = dict(params) | {
            "workflow_id": ref.workflow, "experiment": ref.experiment, "task_id": ref.id,
            "task_index": ref.index, "attempt": n,
        }
        commands = [render(c, values) for c in exp.command]
        workdir = Path(wf.workdir or agent.work_dir)
        devices = self.devices.get(ref, [])
        attempts = agent.attempts
        env = attempts.environment(ref, n, params, attempts.attempt_path(ref, n))
        env.update(CUDA_VISIBLE_DEVICES=visible_devices(devices), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        env.update(await attempts.data_environment(ref, dict(exp.data)))
        if not exp.data:
            checkpoints = gang_checkpoint_dir(workdir, ref)
            await asyncio.to_thread(checkpoints.mkdir, parents=True, exist_ok=True)
            env["HM_CHECKPOINT_DIR"] = str(checkpoints)
        env.update(gang.rendezvous_env(ref, m.rank, rdv))
        attempts.open_attempt_dir(ref, n)
        log_path = attempts.attempt_log(ref, n)
        image = image_for(exp.framework, exp.image)
        on_stop = None  # a container left by a stop: removed
        if image is not None:
            name = f"{ref.id}-{n}-{m.rank}"
            commands, runtime = await agent.containers.wrap(
                name, image, commands, env, agent.base_env, devices, workdir, log_path,
            )
            on_stop = agent.containers.remover(runtime, name, len(commands))
            agent.decide(f"{ref} attempt {n}: image {image} with {runtime or 'no runtime'}")
        process = AttemptProcess(commands, env=env, cwd=workdir, log_path=log_path,
                                 timeout=exp.timeout, grace=agent.cfg.kill_grace,
                                 on_stop=on_stop)
        self.processes[ref] = process
        if m.stopping or agent.stopping.is_set():
            process.stop("preempted", grace=agent.drain_grace)
        agent.decide(f"{ref} attempt {n} rank {m.rank} of {len(rdv.seats)} running "
                     f"(master {rdv.master_addr}:{rdv.master_port})")
        if m.rank != 0:  # rank 0 speaks for the gang: its log and metrics are the task's
            return _end(await process.run())
        running = Running(ClaimPlan(ref, n), rdv.revision, exp.hardware.gpus)
        outcome = await attempts.run_watched(running, exp, process, log_path)
        agent.logs.after_end(ref, n, log_path)
        return _end(outcome)


def _end(outcome: Outcome) -> MemberEnd:
    return MemberEnd(outcome.state, outcome.exit_code, outcome.reason)
