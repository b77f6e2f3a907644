"""Scale harness in one process: hundreds of real agent cores on one event loop (issue 23).

``scripts/bench_scale.py mesh`` runs one agent process per member, which a 2-core
machine cannot do past a few dozen. This script starts a real etcd (loopback, fsync
off, its own data directory) and ``--members`` real :class:`~hypermesh.agent.daemon.Agent`
objects in this one process, on one asyncio loop, with the ``lan`` preset (what
``hypermesh agent start`` uses by default). What each member runs is the product's own
code: its etcd client and lease keep-alive, the namespace mirror (one watch per member),
the election, the scheduling loop with the leader's duty and the claimer, its gRPC
server and gossip with its peers over loopback gRPC. What is patched out, in this
script only:

- a task's processes: ``AttemptProcess.run`` returns a succeeded outcome (after
  ``--task-seconds``) without spawning anything; with ``--reports K`` it first writes K
  ``HM_METRIC`` lines into the attempt's log over that time, which the agent's own
  metrics watch reads, stores and asks the pruner about (the experiment then has an
  objective and ``pruning: median``, and every trial reports the same curve, so none
  is pruned);
- the lifeline (``Lifeline.open`` would start one watchdog process per member);
- the members' signal handlers (the harness owns SIGINT and SIGTERM);
- with ``--no-gossip``, gossip itself (``Agent._run_gossip`` waits for the stop), so that
  the etcd side can be measured alone.

Per member: its own name and work directory, gRPC on ``127.0.0.1:0``, no dashboard, no
``/metrics`` or health listener, no peer sharing, telemetry every 3600 s (the longest
allowed) and 0 GPUs (no NVML). Each member's etcd client gets a connection of its own
(``grpc.use_local_subchannel_pool``), as a member on its own machine has; gossip channels
to one peer are shared by every member of the process (gRPC's global subchannel pool)
unless ``--gossip-connections own`` (N x (N - 1) loopback connections, two descriptors
each: only for small N).

Members start in batches of ``--batch`` (each batch registered and mirroring, then
``--batch-pause`` seconds, before the next), within ``--start-timeout`` seconds. The
decision-log lines ``lost lease`` and ``-> dead`` are counted in each window: a run with
either measured a churning mesh (one loop lagging past the keep-alive or probe timeouts),
not a steady one; ``--lease-ttl`` (lan: 10) lets members on a lagging loop keep their
leases. Then ``--tasks`` trivial tasks are submitted
exactly as the CLI does (``hypermesh submit RECIPE --wait`` in a subprocess) and the
submit window reports, per task: this process's CPU (every member's summed, gRPC's threads
included), etcd's CPU, the watch events etcd delivered and the bytes it sent, and
tasks/s; the changes the members' mirrors applied, in all and by key kind (where
etcd's watch events go); and the loop's lag (how late a 50 ms timer fired). Then, after
``--settle``, an idle window of ``--idle-seconds``: CPU per member in % of a core (the process's
divided by N), etcd's writes, Range RPCs and lease keep-alives per second per member,
and the agent-to-agent gRPC bytes (``ss``).

    .venv/bin/python scripts/bench_scale_inproc.py --members 256 --tasks 2000
        [--slots 1] [--idle-seconds 10] [--no-gossip] [--lease-ttl 10] [--flush-rate N]
        [--json]

Everything it starts (etcd, the members, the temporary directory) is stopped and removed
before it returns, also on failure and on Ctrl-C. It asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import resource
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dispatch import machine, proc_cpu, recipe_text
from bench_scale import (
    ETCD_IDLE_ROWS,
    ETCD_TASK_ROWS,
    EtcdDelta,
    etcd_metrics,
    print_rows,
    tcp_bytes_by_local_port,
    tcp_delta,
)

from hypermesh.agent import daemon
from hypermesh.agent.gossip import duty as gossip_duty
from hypermesh.agent.tasks import lifeline, mounts, runner
from hypermesh.config import AgentConfig
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.agents import hypermesh_command
from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import MAX_BLOCK

log = logging.getLogger("bench_scale_inproc")

TELEMETRY_PERIOD_S = 3600.0
"""The longest telemetry period ``AgentConfig`` allows: no sample during a run."""

STOP_TIMEOUT_S = 120.0
"""How long every member together may take to drain and stop."""

LAG_TICK_S = 0.05
"""Period of the loop-lag probe: how late this timer fires is the loop's backlog."""

LOCAL_POOL = ("grpc.use_local_subchannel_pool", 1)
"""Channel option that gives a channel connections of its own, not shared process-wide."""


class BenchError(RuntimeError):
    """The run could not complete; the message says why."""


# ---------------------------------------------------------------- patches (this script only)


@dataclass
class Counters:
    """What the patched code saw: attempts run per member."""

    attempts: collections.Counter[str] = field(default_factory=collections.Counter)


COUNTERS = Counters()


class DecisionCounter(logging.Handler):
    """Counts the members' decision-log lines that say the mesh is not healthy: a node
    lease lost (``lost lease``) and a member gossip declared dead (``-> dead``, once per
    member that saw it). A run with either measured a mesh that churns, not a steady one."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lost = 0
        self.dead = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "lost lease" in msg:
            self.lost += 1
        elif "-> dead" in msg:
            self.dead += 1

    def attach(self) -> None:
        logging.getLogger("hypermesh.agent").addHandler(self)

    def take(self) -> tuple[int, int]:
        """(leases lost, gossip deaths) since the last call."""
        out = (self.lost, self.dead)
        self.lost = self.dead = 0
        return out


EVENTS = DecisionCounter()


class MirrorCounter:
    """Counts the changes the members' mirrors apply, by key kind (``wf``, ``block``,
    ``offer``...), while on: where the watch events etcd delivers go. It wraps
    ``Etcd.mirror``'s ``apply`` (every member's mirror runs in this process), so the
    initial loads before the submit window are not counted, and neither is the CLI's
    own watch (another process)."""

    def __init__(self) -> None:
        self.on = False
        self.kinds: collections.Counter[str] = collections.Counter()

    def attach(self) -> None:
        from hypermesh.state import etcd as etcd_module
        mirror, counter = etcd_module.Etcd.mirror, self

        def counted_mirror(etcd: Any, prefix: str, apply: Any, *args: Any, **kw: Any) -> Any:
            def counted(key: str, *rest: Any) -> None:
                if counter.on:
                    counter.kinds[key[len(prefix):].split("/", 1)[0]] += 1
                apply(key, *rest)
            return mirror(etcd, prefix, counted, *args, **kw)

        etcd_module.Etcd.mirror = counted_mirror  # type: ignore[method-assign]

    def start(self) -> None:
        self.kinds.clear()
        self.on = True

    def stop(self) -> dict[str, int]:
        self.on = False
        return dict(self.kinds.most_common())


APPLIED = MirrorCounter()


class _NoLifeline:
    """Stands for :class:`Lifeline`: no journal, no watchdog process."""

    journal = None
    marker = ""

    def close(self, wait: float = 0.0) -> None:
        pass


def patch_agents(
    task_seconds: float, gossip: bool, own_gossip_connections: bool, reports: int = 0
) -> None:
    """Monkeypatch the agent code for many members in one process (module docstring)."""

    async def run_attempt(self: runner.AttemptProcess) -> runner.Outcome:
        COUNTERS.attempts[str(self.log_path).split("/members/", 1)[-1].split("/", 1)[0]] += 1
        for step in range(reports):
            with open(self.log_path, "a") as log:
                log.write(f'HM_METRIC {{"step": {step}, "loss": {1 / (step + 1)!r}}}\n')
            await asyncio.sleep(task_seconds / reports)
        await asyncio.sleep(0 if reports else task_seconds)
        return runner.Outcome("succeeded", 0, "exit", time.time())

    def open_lifeline(work_dir: object, decide: object) -> _NoLifeline:
        return _NoLifeline()

    async def no_mount(self: mounts.Mounts, spec: str) -> Path:
        return self.root

    runner.AttemptProcess.run = run_attempt  # type: ignore[method-assign]
    lifeline.Lifeline.open = open_lifeline  # type: ignore[assignment]
    mounts.Mounts.ensure = no_mount  # type: ignore[method-assign]
    if not gossip:
        async def no_gossip(self: daemon.Agent) -> None:
            await self.stopping.wait()

        daemon.Agent._run_gossip = no_gossip  # type: ignore[method-assign]
    if own_gossip_connections:
        gossip_duty.CHANNEL_OPTIONS.append(LOCAL_POOL)


def member_config(
    name: str, work_dir: Path, slots: int, lease_ttl: int, watch: str = "all", gpus: int = 0,
) -> AgentConfig:
    """What ``hypermesh agent start --preset lan --name NAME --work-dir DIR --slots S
    --lease-ttl TTL --listen 127.0.0.1:0 --http-listen off --metrics-listen off
    --peer-sharing off --telemetry-period 3600 --gpus G`` builds."""
    return AgentConfig.lan(
        name=name, listen="127.0.0.1:0", work_dir=work_dir, slots=slots, gpus=gpus,
        lease_ttl=lease_ttl, http_listen=None, metrics_listen=None, health_listen=None,
        peer_sharing=False, telemetry_period=TELEMETRY_PERIOD_S, watch=watch,
    )


def with_task_inputs(recipe: str, inputs: bool) -> str:
    """``recipe`` (``recipe_text``'s) with a data set and an input per task (placement by
    locality), when ``inputs``: the members have no store, so none holds any of it."""
    if not inputs:
        return recipe
    head, sep, tail = recipe.partition("    command:")
    return f"{head}    data: {{d: d}}\n    inputs: 'd/part-{{{{task_index}}}}'\n{sep}{tail}"


def with_prefer_pools(recipe: str, pools: str | None) -> str:
    """``recipe`` (``recipe_text``'s) preferring ``pools`` (prefer_pools), when given."""
    if not pools:
        return recipe
    head, sep, tail = recipe.partition("    command:")
    return f"{head}    prefer_pools: [{pools}]\n{sep}{tail}"


def with_reports(recipe: str, reports: int, tpe: bool = False) -> str:
    """``recipe`` (``recipe_text``'s) ranked by ``loss`` and pruned by the median pruner,
    when its tasks report metrics; with ``tpe``, an adaptive search of one parameter."""
    if not reports:
        return recipe
    head, sep, tail = recipe.partition("    command:")
    search = "    parameters: {x: {range: [0, 1]}}\n    sampling: tpe\n" if tpe else ""
    return f"{head}{search}    objective: {{metric: loss}}\n    pruning: median\n{sep}{tail}"


def with_workers(recipe: str, workers: int | None) -> str:
    """``recipe`` (``recipe_text``'s) with a ``workers`` cap, when given."""
    if workers is None:
        return recipe
    head, sep, tail = recipe.partition("    command:")
    return f"{head}    workers: {workers}\n{sep}{tail}"


def with_task_gpus(recipe: str, gpus: float) -> str:
    """``recipe`` (``recipe_text``'s) with each task asking for ``gpus`` GPUs."""
    if not gpus:
        return recipe
    head, sep, tail = recipe.partition("    command:")
    return f"{head}    hardware: {{gpus: {gpus:g}}}\n{sep}{tail}"


# ---------------------------------------------------------------- results


@dataclass
class Result:
    """One run. CPU in seconds; ``per_task`` and ``idle`` derive the figures."""

    members: int
    slots: int
    tasks: int
    gossip: bool
    start_s: float = 0.0
    wall_s: float = 0.0
    process_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0
    cli_cpu_s: float = 0.0
    etcd: EtcdDelta | None = None
    attempts: int = 0
    attempts_per_member_max: int = 0
    members_that_ran: int = 0
    lag_ms_p50: float = 0.0
    lag_ms_p99: float = 0.0
    lag_ms_max: float = 0.0
    threads: int = 0
    rss_mb: float = 0.0
    idle_s: float = 0.0
    idle_process_cpu_s: float = 0.0
    idle_etcd_cpu_s: float = 0.0
    idle_etcd: EtcdDelta | None = None
    idle_gossip_bytes: float | None = None
    idle_lag_ms_p99: float = 0.0
    lease_losses: int = 0  # node leases lost by members during the submit window
    gossip_deaths: int = 0  # members gossip declared dead (and revoked) meanwhile
    idle_lease_losses: int = 0
    idle_gossip_deaths: int = 0
    applied_by_kind: dict[str, int] = field(default_factory=dict)  # members' mirrors

    def per_task(self) -> dict[str, float]:
        t = self.tasks
        e = self.etcd
        assert e is not None
        return {
            "tasks_per_s": t / self.wall_s,
            "agents_cpu_ms": 1e3 * self.process_cpu_s / t,
            "etcd_cpu_ms": 1e3 * self.etcd_cpu_s / t,
            "cli_cpu_ms": 1e3 * self.cli_cpu_s / t,
            **e.per_task(t),
            "mirror_applies": sum(self.applied_by_kind.values()) / t,
        }

    def idle(self) -> dict[str, float | None]:
        e = self.idle_etcd
        if e is None or self.idle_s <= 0:
            return {}
        per = self.members * self.idle_s
        return {
            "agent_cpu_pct": 100 * self.idle_process_cpu_s / per,
            "process_cpu_pct": 100 * self.idle_process_cpu_s / self.idle_s,
            "etcd_cpu_pct": 100 * self.idle_etcd_cpu_s / self.idle_s,
            **e.per_agent_second(per),
            "gossip_bytes_per_s_per_agent": (
                None if self.idle_gossip_bytes is None else self.idle_gossip_bytes / per),
            "lag_ms_p99": self.idle_lag_ms_p99,
        }


# ---------------------------------------------------------------- the loop's lag


class LagProbe:
    """How late a ``LAG_TICK_S`` timer fires on this loop, sample by sample."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.samples = []
        self._task = asyncio.create_task(self._run(), name="lag probe")

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + LAG_TICK_S
            await asyncio.sleep(LAG_TICK_S)
            self.samples.append(1e3 * max(0.0, time.perf_counter() - due))

    def stop(self) -> tuple[float, float, float]:
        """p50, p99 and max lag in ms since ``start``."""
        if self._task is not None:
            self._task.cancel()
        s = sorted(self.samples) or [0.0]
        return (statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))], s[-1])


# ---------------------------------------------------------------- members


class Members:
    """The members of this process: their agents and the tasks running them."""

    def __init__(self, root: Path, etcd_url: str, namespace: str, slots: int,
                 lease_ttl: int, watch: str = "all", gpus: int = 0) -> None:
        self.root = root
        self.watch = watch
        self.gpus = gpus
        self.lease_ttl = lease_ttl
        self.etcd_url = etcd_url
        self.namespace = namespace
        self.slots = slots
        self.agents: list[daemon.Agent] = []
        self.runs: list[asyncio.Task[None]] = []

    def add(self, name: str) -> daemon.Agent:
        agent = daemon.Agent(member_config(name, self.root / name, self.slots, self.lease_ttl,
                                           self.watch, self.gpus),
                             parse_endpoints(self.etcd_url), self.namespace)
        options = getattr(getattr(agent.etcd.client, "_manager", None), "grpc_options", None)
        if isinstance(options, list):  # its own connection to etcd, as on its own machine
            options.append(LOCAL_POOL)
        self.agents.append(agent)
        self.runs.append(asyncio.create_task(agent.run(), name=f"agent {name}"))
        return agent

    def check_alive(self) -> None:
        for agent, run in zip(self.agents, self.runs, strict=True):
            if run.done():
                exc = None if run.cancelled() else run.exception()
                raise BenchError(f"member {agent.cfg.name} stopped: {exc!r}")

    async def start(self, n: int, batch: int, pause: float, timeout: float,
                    out: Any) -> float:
        """Start ``n`` members, ``batch`` at a time, each batch registered and its
        mirror loaded, and ``pause`` seconds passed, before the next; seconds taken."""
        started = time.perf_counter()
        deadline = started + timeout
        while len(self.agents) < n:
            new = [self.add(f"m{len(self.agents) + 1:04d}")
                   for _ in range(min(batch, n - len(self.agents)))]
            while not all(a.lease and a.mirror_ready.is_set() for a in new):
                self.check_alive()
                if time.perf_counter() > deadline:
                    raise BenchError(f"{len(self.agents)} members not up within {timeout:g}s")
                await asyncio.sleep(0.1)
            print(f"  {len(self.agents)}/{n} members up "
                  f"({time.perf_counter() - started:.1f}s)", file=out, flush=True)
            if len(self.agents) < n:
                await asyncio.sleep(pause)
        await self.wait_for_mesh(n, deadline)
        return time.perf_counter() - started

    async def wait_for_mesh(self, n: int, deadline: float) -> None:
        """Until a leader is elected and the first and last members see all ``n``."""
        probes = [self.agents[0], self.agents[-1]]
        while True:
            self.check_alive()
            leader = probes[0].view.leader()
            if leader is not None and all(len(a.view.nodes) >= n for a in probes):
                return
            if time.perf_counter() > deadline:
                raise BenchError(f"no leader or not all {n} members in the view "
                                 f"(leader {leader}, seen {[len(a.view.nodes) for a in probes]})")
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """Drain every member at once; cancel those not stopped within ``STOP_TIMEOUT_S``."""
        for agent in self.agents:
            agent.request_drain(grace=0.0, why="benchmark over")
        if not self.runs:
            return
        _, pending = await asyncio.wait(self.runs, timeout=STOP_TIMEOUT_S)
        for run in pending:
            run.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
        for run in self.runs:  # retrieve every exception: none is logged as never retrieved
            if run.done() and not run.cancelled():
                run.exception()

    def ports(self) -> set[int]:
        return {int(a.bound_address.rpartition(":")[2]) for a in self.agents if a.bound_address}


# ---------------------------------------------------------------- the run


async def submit(recipe: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``hypermesh submit RECIPE --wait`` as the CLI runs it: its exit status and stderr.
    Killed if it runs past ``timeout`` or this run is cancelled."""
    return await hypermesh(["submit", str(recipe), "--wait"], env, timeout)


async def hypermesh(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """The CLI with ``args``: its exit status and stderr. Killed if it runs past
    ``timeout`` or this run is cancelled."""
    proc = await asyncio.create_subprocess_exec(
        *hypermesh_command(), *args, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if isinstance(exc, TimeoutError):
            raise BenchError(f"{args[0]} ran past {timeout:g}s") from exc
        raise
    assert proc.returncode is not None
    return proc.returncode, stderr.decode(errors="replace")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cli_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def measure(args: argparse.Namespace, etcd: EtcdServer, root: Path, out: Any) -> Result:
    env = {**os.environ, "HYPERMESH_ETCD": etcd.url, "HYPERMESH_NAMESPACE": args.namespace}
    etcd_pid = etcd.proc.pid if etcd.proc else -1
    members = Members(root / "members", etcd.url, args.namespace, args.slots,
                      args.lease_ttl, args.watch, args.gpus)
    result = Result(members=args.members, slots=args.slots, tasks=args.tasks,
                    gossip=not args.no_gossip)
    lag = LagProbe()
    EVENTS.attach()
    try:
        result.start_s = await members.start(args.members, args.batch, args.batch_pause,
                                             args.start_timeout, out)
        print(f"  {args.members} members up, leader {members.agents[0].view.leader()}, in "
              f"{result.start_s:.1f}s; settling {args.settle:g}s", file=out, flush=True)
        await asyncio.sleep(args.settle)
        members.check_alive()
        if args.flush_rate is not None:
            code, stderr = await hypermesh(["settings", f"flush-rate={args.flush_rate}"],
                                           env, 60)
            if code:
                raise BenchError(f"settings flush-rate exited {code}: {stderr[-2000:]}")
        recipe = root / "inproc.yaml"
        recipe.write_text(with_reports(with_workers(with_prefer_pools(with_task_inputs(
            with_task_gpus(recipe_text(args.tasks, block=args.block), args.task_gpus),
            args.task_inputs), args.prefer_pools), args.workers), args.reports, args.tpe))
        COUNTERS.attempts.clear()
        EVENTS.take()
        APPLIED.start()
        m0 = await asyncio.to_thread(etcd_metrics, etcd.url)
        e0, p0, c0 = proc_cpu(etcd_pid)[0], time.process_time(), _cli_cpu()
        lag.start()
        t0 = time.perf_counter()
        code, stderr = await submit(recipe, env, args.submit_timeout)
        result.wall_s = time.perf_counter() - t0
        p1, e1, c1 = time.process_time(), proc_cpu(etcd_pid)[0], _cli_cpu()
        result.lag_ms_p50, result.lag_ms_p99, result.lag_ms_max = lag.stop()
        result.lease_losses, result.gossip_deaths = EVENTS.take()
        result.applied_by_kind = APPLIED.stop()
        m1 = await asyncio.to_thread(etcd_metrics, etcd.url)
        if code != 0:
            raise BenchError(f"submit --wait exited {code}: {stderr[-2000:]}")
        members.check_alive()
        result.process_cpu_s, result.etcd_cpu_s, result.cli_cpu_s = p1 - p0, e1 - e0, c1 - c0
        result.etcd = EtcdDelta.between(m0, m1)
        result.attempts = sum(COUNTERS.attempts.values())
        result.attempts_per_member_max = max(COUNTERS.attempts.values(), default=0)
        result.members_that_ran = len(COUNTERS.attempts)
        result.threads = len(os.listdir("/proc/self/task"))
        result.rss_mb = _rss_mb()
        print(f"  submit --wait: {result.wall_s:.2f}s, {args.tasks / result.wall_s:.1f} "
              f"tasks/s; {result.attempts} attempts on {result.members_that_ran} members",
              file=out, flush=True)
        if args.idle_seconds > 0:
            await measure_idle(args, members, etcd, result, lag, out)
        return result
    finally:
        lag.stop()
        print(f"  stopping {len(members.agents)} members", file=out, flush=True)
        stopping = time.perf_counter()
        await members.stop()
        print(f"  stopped in {time.perf_counter() - stopping:.1f}s", file=out, flush=True)


async def measure_idle(args: argparse.Namespace, members: Members, etcd: EtcdServer,
                       result: Result, lag: LagProbe, out: Any) -> None:
    print(f"  idle: {args.settle:g}s settle, {args.idle_seconds:g}s measured", file=out,
          flush=True)
    await asyncio.sleep(args.settle)
    etcd_pid = etcd.proc.pid if etcd.proc else -1
    ports = members.ports()
    m0 = await asyncio.to_thread(etcd_metrics, etcd.url)
    g0 = await asyncio.to_thread(tcp_bytes_by_local_port, ports)
    lag.start()
    t0, p0, e0 = time.perf_counter(), time.process_time(), proc_cpu(etcd_pid)[0]
    await asyncio.sleep(args.idle_seconds)
    t1, p1, e1 = time.perf_counter(), time.process_time(), proc_cpu(etcd_pid)[0]
    result.idle_lag_ms_p99 = lag.stop()[1]
    result.idle_lease_losses, result.idle_gossip_deaths = EVENTS.take()
    m1 = await asyncio.to_thread(etcd_metrics, etcd.url)
    g1 = await asyncio.to_thread(tcp_bytes_by_local_port, ports)
    members.check_alive()
    result.idle_s = t1 - t0
    result.idle_process_cpu_s = p1 - p0
    result.idle_etcd_cpu_s = e1 - e0
    result.idle_etcd = EtcdDelta.between(m0, m1)
    result.idle_gossip_bytes = tcp_delta(g0, g1) if (g0 or g1) else None


async def run_all(args: argparse.Namespace, etcd: EtcdServer, root: Path, out: Any) -> Result:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    # Every member's run() installs SIGTERM/SIGINT handlers on the loop: the last would
    # win, and Ctrl-C would drain one member. The harness keeps them (asyncio.run's own
    # SIGINT handler cancels this task, whose finally stops every member).
    loop.add_signal_handler = lambda *a, **k: None  # type: ignore[method-assign]
    return await measure(args, etcd, root, out)


def run(args: argparse.Namespace, out: Any) -> Result:
    patch_agents(args.task_seconds, not args.no_gossip, args.gossip_connections == "own",
                 args.reports)
    APPLIED.attach()
    with tempfile.TemporaryDirectory(prefix="hm-bench-inproc-") as tmp:
        root = Path(tmp)
        logging.basicConfig(filename=root / "agents.log", level=args.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        etcd = EtcdServer(root / "etcd", fsync=False)
        try:
            etcd.start()
            print(f"  etcd at {etcd.url} (fsync off)", file=out, flush=True)
            return asyncio.run(run_all(args, etcd, root, out))
        except BaseException:
            _tail(root / "agents.log", out)
            raise
        finally:
            etcd.stop()
            logging.shutdown()
            if args.keep_log is not None:
                with contextlib.suppress(OSError):
                    shutil.copyfile(root / "agents.log", args.keep_log)


def _tail(path: Path, out: Any, lines: int = 30) -> None:
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        if text:
            print("  agents' log, last lines:", file=out)
            for line in text:
                print(f"    {line[:300]}", file=out)


# ---------------------------------------------------------------- report


def report(r: Result, out: Any) -> dict[str, Any]:
    per, idle = r.per_task(), r.idle()
    print(file=out)
    print(f"{r.members} members x {r.slots} slots in one process, gossip "
          f"{'on' if r.gossip else 'OFF'}, {r.tasks} tasks; started in {r.start_s:.1f}s", file=out)
    print("per task:", file=out)
    print_rows([
        ("tasks/s end to end", "tasks_per_s", "{:.1f}"),
        ("agents' CPU, summed (ms)", "agents_cpu_ms", "{:.3f}"),
        ("etcd CPU (ms)", "etcd_cpu_ms", "{:.3f}"),
        ("submit CLI CPU (ms)", "cli_cpu_ms", "{:.3f}"),
        *ETCD_TASK_ROWS,
        ("changes the members applied", "mirror_applies", "{:.2f}"),
    ], per, out)
    by_kind = ", ".join(f"{k} {n / r.tasks:.2f}" for k, n in r.applied_by_kind.items())
    print(f"  {'members applied, by key kind':<32}{by_kind or '-'}", file=out)
    print(f"  {'attempts run (members)':<32}{f'{r.attempts} ({r.members_that_ran})':>14}",
          file=out)
    print(f"  {'most attempts on one member':<32}{r.attempts_per_member_max:>14}", file=out)
    print(f"  {'loop lag p50/p99/max (ms)':<32}"
          f"{f'{r.lag_ms_p50:.0f}/{r.lag_ms_p99:.0f}/{r.lag_ms_max:.0f}':>14}", file=out)
    print(f"  {'leases lost, gossip deaths':<32}{f'{r.lease_losses}, {r.gossip_deaths}':>14}",
          file=out)
    print(f"  {'threads, peak RSS (MB)':<32}{f'{r.threads}, {r.rss_mb:.0f}':>14}", file=out)
    if idle:
        print(f"idle ({r.idle_s:.0f}s), per member:", file=out)
        print_rows([
            ("CPU, % of a core", "agent_cpu_pct", "{:.3f}"),
            *ETCD_IDLE_ROWS,
            ("gossip bytes /s (ss)", "gossip_bytes_per_s_per_agent", "{:.0f}"),
        ], idle, out)
        print(f"  {'process CPU, % of a core':<32}{idle['process_cpu_pct'] or 0:>14.1f}",
              file=out)
        print(f"  {'etcd CPU, % of a core':<32}{idle['etcd_cpu_pct'] or 0:>14.1f}", file=out)
        print(f"  {'loop lag p99 (ms)':<32}{idle['lag_ms_p99'] or 0:>14.0f}", file=out)
        print(f"  {'leases lost, gossip deaths':<32}"
              f"{f'{r.idle_lease_losses}, {r.idle_gossip_deaths}':>14}", file=out)
    return {"per_task": per, "idle": idle, "result": asdict(r)}


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--members", type=int, required=True, help="agents in this process")
    p.add_argument("--tasks", type=int, default=2000, help="trivial tasks submitted [2000]")
    p.add_argument("--slots", type=int, default=1, help="slots per member [1]")
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="idle window after the run; 0 skips it [10]")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds before the run and before the idle window [5]")
    p.add_argument("--lease-ttl", type=int, default=10,
                   help="the members' node lease TTL in seconds (lan: 10); a longer one keeps "
                   "members whose shared loop lags from giving their leases up [10]")
    p.add_argument("--no-gossip", action="store_true",
                   help="members do not gossip: the etcd side alone")
    p.add_argument("--gossip-connections", choices=("shared", "own"), default="shared",
                   help="gossip channels to one peer share one connection process-wide "
                   "(shared), or each member has its own (own: 2 N (N-1) descriptors) [shared]")
    p.add_argument("--task-seconds", type=float, default=0.0,
                   help="how long each (patched) attempt takes [0]")
    p.add_argument("--batch", type=int, default=16, help="members started at once [16]")
    p.add_argument("--block", type=int, default=None,
                   help="tasks per block (the recipe's batch); default: the automatic size, "
                   "which is per-task keys once the slots are over a quarter of the tasks")
    p.add_argument("--gpus", type=int, default=0,
                   help="GPUs of each member (agent start --gpus; none need exist) [0]")
    p.add_argument("--task-gpus", type=float, default=0.0,
                   help="GPUs each task asks for (hardware: {gpus: G}) [0]")
    p.add_argument("--task-inputs", action="store_true",
                   help="each task has a data set input (inputs: placement by locality; no "
                   "member has a store, so nothing is mounted and none holds any of it)")
    p.add_argument("--prefer-pools", default=None, metavar="POOLS",
                   help="the tasks prefer these pools (prefer_pools: [POOLS]); the members "
                   "are of pool default")
    p.add_argument("--workers", type=int, default=None,
                   help="the experiment's workers cap (workers: W); with --block 1, task by task")
    p.add_argument("--reports", type=int, default=0, metavar="K",
                   help="HM_METRIC lines each task reports over --task-seconds; the "
                        "experiment then prunes (pruning: median) [0]")
    p.add_argument("--tpe", action="store_true",
                   help="with --reports: an adaptive search (sampling: tpe, one parameter), "
                        "its trials created as results come in, --workers at a time")
    p.add_argument("--batch-pause", type=float, default=1.0,
                   help="seconds between two batches [1]")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds all members may take to start [600]")
    p.add_argument("--submit-timeout", type=float, default=600.0,
                   help="seconds submit --wait may take [600]")
    p.add_argument("--namespace", default="default", help="the mesh's namespace [default]")
    p.add_argument("--log-level", default="INFO",
                   help="the members' log level (to a file in the temporary directory) [INFO]")
    p.add_argument("--keep-log", type=Path, default=None, metavar="FILE",
                   help="copy the members' log here before the temporary directory goes")
    p.add_argument("--watch", choices=("all", "own", "auto"), default="all",
                   help="the members' --watch: own = blocks from the leader's offers; "
                   "auto = own past the mesh's watch-all seats [all]")
    p.add_argument("--flush-rate", type=int, default=None,
                   help="the mesh setting flush-rate, set before the submit [its default]")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    for name in ("members", "tasks", "slots", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.reports < 0:
        p.error(f"--reports must not be negative, got {args.reports}")
    if args.tpe and not args.reports:
        p.error("--tpe needs --reports (the objective the search models)")
    if args.block is not None and not 1 <= args.block <= MAX_BLOCK:
        p.error(f"--block must be 1 to {MAX_BLOCK}, got {args.block}")
    if args.task_seconds < 0 or args.settle < 0 or args.idle_seconds < 0:
        p.error("--task-seconds, --settle and --idle-seconds must not be negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    print(f"command: {command}", file=out)
    print(f"{args.members} members x {args.slots} slots on one loop, {args.tasks} tasks, "
          f"preset lan (lease TTL {args.lease_ttl}s), gossip {'OFF' if args.no_gossip else 'on'}, "
          "etcd fsync OFF",
          file=out, flush=True)
    try:
        result = run(args, out)
    except (BenchError, TimeoutError, RuntimeError, OSError) as exc:
        print(f"bench_scale_inproc: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_scale_inproc: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    summary = report(result, out)
    if args.json:
        print(json.dumps({"command": command, "members": args.members, "slots": args.slots,
                          "tasks": args.tasks, "gossip": not args.no_gossip,
                          "gossip_connections": args.gossip_connections,
                          "preset": "lan", "lease_ttl": args.lease_ttl,
                          "machine": machine(), **summary},
                         indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
