"""What this machine has and how busy it is.

Capacity (:func:`detect_machine`): GPUs from NVML when present, CPUs and memory
from psutil. Load (:class:`Telemetry`): every ``--telemetry-period`` seconds a
sample of CPU, memory, disk and network (psutil) and of each GPU (NVML, through
:mod:`hypermesh.agent.ops.gpus`), kept in a bounded history, plus what each running
attempt's process tree used (CPU, resident memory, GPU memory).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from hypermesh._proto import agent_pb2
from hypermesh.agent.ops.gpus import GpuSource, open_gpus
from hypermesh.agent.ops.usage import (
    Counters,
    History,
    NodeSample,
    ProcessKey,
    TaskUsage,
    busy_percent,
    per_second,
    tree_cpu_seconds,
)

if TYPE_CHECKING:
    from hypermesh.agent.tasks.mounts import CacheScan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_type: str
    cpus: float
    memory: int


def detect_gpus() -> tuple[int, str]:
    """(count, type of the first GPU) from NVML; (0, "") on a machine without it."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # NVML missing or no driver: a machine without GPUs
        log.debug("NVML unavailable: %s", exc)
        return 0, ""
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return 0, ""
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return count, name.decode() if isinstance(name, bytes) else str(name)
    finally:
        pynvml.nvmlShutdown()


def detect_machine(gpus: int | None = None, gpu_type: str | None = None) -> Machine:
    """The machine's capacity; ``gpus``/``gpu_type`` override what NVML says."""
    if gpus is None:
        found, found_type = detect_gpus()
        gpus = found
        gpu_type = gpu_type if gpu_type is not None else found_type
    return Machine(
        gpus=gpus,
        gpu_type=gpu_type or "",
        cpus=float(psutil.cpu_count() or 1),
        memory=int(psutil.virtual_memory().total),
    )


def cpu_percent() -> float:
    return float(psutil.cpu_percent(interval=None))


# ---------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class TaskRoot:
    """A running attempt's first process (the root of its process tree)."""

    task_id: str
    attempt: int
    pid: int


class Sampler:
    """Reads the machine with psutil and the GPUs through a :class:`GpuSource`.

    Blocking (reads /proc): the agent calls :meth:`sample` in a worker thread, one
    call at a time. Keeps the previous reading to turn counters into rates.
    """

    def __init__(self, disk_path: Path, gpus: GpuSource) -> None:
        self.disk_path = disk_path
        self.gpus = gpus
        self._me = psutil.Process()
        self._prev = self._counters()
        self._prev_wall = time.time()
        self._prev_agent = self._agent_cpu_s()
        self._prev_procs: dict[ProcessKey, float] = {}

    def _counters(self) -> Counters:
        cpu = psutil.cpu_times()
        idle = cpu.idle + getattr(cpu, "iowait", 0.0)
        total = sum(cpu)
        disk = psutil.disk_io_counters()
        net = psutil.net_io_counters()
        return Counters(
            at=time.monotonic(),
            cpu_busy_s=total - idle,
            cpu_total_s=total,
            disk_read_bytes=disk.read_bytes if disk else 0,
            disk_write_bytes=disk.write_bytes if disk else 0,
            net_recv_bytes=net.bytes_recv if net else 0,
            net_sent_bytes=net.bytes_sent if net else 0,
        )

    def _agent_cpu_s(self) -> float:
        t = self._me.cpu_times()
        return float(t.user + t.system)

    def sample(self, roots: list[TaskRoot]) -> tuple[NodeSample, list[TaskUsage]]:
        """The node now, and each running attempt's use since the last call."""
        now, wall = self._counters(), time.time()
        prev, self._prev = self._prev, now
        elapsed = now.at - prev.at
        agent_cpu = self._agent_cpu_s()
        prev_agent, self._prev_agent = self._prev_agent, agent_cpu
        memory = psutil.virtual_memory()
        try:
            disk = psutil.disk_usage(str(self.disk_path))
            disk_used, disk_total = int(disk.used), int(disk.total)
        except OSError:
            disk_used = disk_total = 0
        node = NodeSample(
            time=wall,
            cpu_percent=busy_percent(prev, now),
            load1=float(os.getloadavg()[0]),
            memory_used=int(memory.total - memory.available),
            memory_total=int(memory.total),
            disk_used=disk_used,
            disk_total=disk_total,
            disk_read_per_s=per_second(prev.disk_read_bytes, now.disk_read_bytes, elapsed),
            disk_write_per_s=per_second(prev.disk_write_bytes, now.disk_write_bytes, elapsed),
            net_recv_per_s=per_second(prev.net_recv_bytes, now.net_recv_bytes, elapsed),
            net_sent_per_s=per_second(prev.net_sent_bytes, now.net_sent_bytes, elapsed),
            agent_cpu_percent=100.0 * per_second(prev_agent, agent_cpu, elapsed),
            agent_rss=int(self._me.memory_info().rss),
            gpus=tuple(self.gpus.sample()),
        )
        tasks = self._tasks(roots, elapsed, wall) if roots else []
        if not roots:
            self._prev_procs = {}
        self._prev_wall = wall
        return node, tasks

    def _tasks(self, roots: list[TaskRoot], elapsed: float, wall: float) -> list[TaskUsage]:
        gpu_memory = self.gpus.process_memory() if self.gpus.available else {}
        seen: dict[ProcessKey, float] = {}
        out = []
        for root in roots:
            cpu_now: dict[ProcessKey, float] = {}
            rss = gpu = 0
            for p in _tree(root.pid):
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        key = (p.pid, p.create_time())
                        cpu_now[key] = float(t.user + t.system)
                        rss += int(p.memory_info().rss)
                except psutil.Error:
                    continue  # ended while we looked
                gpu += gpu_memory.get(p.pid, 0)
            used = tree_cpu_seconds(self._prev_procs, cpu_now, self._prev_wall)
            seen.update(cpu_now)
            out.append(
                TaskUsage(
                    task_id=root.task_id,
                    attempt=root.attempt,
                    processes=len(cpu_now),
                    cpu_percent=100.0 * used / elapsed if elapsed > 0 else 0.0,
                    rss=rss,
                    gpu_memory=gpu,
                )
            )
        self._prev_procs = seen
        return out

    def close(self) -> None:
        self.gpus.close()


def _tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants. Walks down through ``/proc/PID/task/TID/children``
    (cost: the tree's size) rather than psutil's ``children()``, which reads every
    process of the machine for each tree; falls back to it where the kernel lacks
    that file."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    if not _HAS_CHILDREN_FILES:
        try:
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return [root]
    tree, todo = [root], [pid]
    while todo:
        for child in _children(todo.pop()):
            try:
                tree.append(psutil.Process(child))
            except psutil.Error:
                continue  # ended while we looked
            todo.append(child)
    return tree


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


_HAS_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


class Telemetry:
    """The node's samples: the latest per-task usage and a bounded history.

    :meth:`run` samples every ``period`` seconds in a worker thread; only the
    agent's event loop reads the results.
    """

    def __init__(
        self, disk_path: Path, period: float, history: int, gpus: GpuSource | None = None
    ) -> None:
        self.period = period
        self.history = History(history)
        self.tasks: list[TaskUsage] = []
        self.sampler = Sampler(disk_path, open_gpus() if gpus is None else gpus)

    @property
    def nvml(self) -> bool:
        return self.sampler.gpus.available

    def latest(self) -> NodeSample | None:
        return self.history.latest()

    async def run(self, roots: Callable[[], list[TaskRoot]]) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                node, tasks = await asyncio.to_thread(self.sampler.sample, roots())
            except Exception:  # a failed sample must not stop the agent; try again later
                log.exception("telemetry sample failed")
                continue
            self.history.add(node)
            self.tasks = tasks

    def close(self) -> None:
        self.sampler.close()

    def message(
        self, node: str, history: int, metrics_address: str, caches: Iterable[CacheScan] = ()
    ) -> agent_pb2.Telemetry:
        """The ``GetTelemetry`` reply: the latest sample, ``history`` earlier ones, and
        the node's chunk caches as last scanned."""
        latest = self.history.latest()
        earlier = self.history.last(history + 1)[:-1] if latest is not None else []
        return agent_pb2.Telemetry(
            node=node,
            period_s=self.period,
            nvml=self.nvml,
            latest=_node_message(latest) if latest is not None else None,
            history=[_node_message(s) for s in earlier],
            tasks=[
                agent_pb2.TaskUsage(
                    task_id=t.task_id,
                    attempt=t.attempt,
                    processes=t.processes,
                    cpu_percent=t.cpu_percent,
                    rss_bytes=t.rss,
                    gpu_memory_bytes=t.gpu_memory,
                )
                for t in self.tasks
            ],
            metrics_address=metrics_address,
            caches=[
                agent_pb2.CacheUsage(
                    dataset=c.dataset,
                    cached_bytes=c.cached_bytes,
                    cache_blocks=c.reads.get("cache", 0),
                    peer_blocks=c.reads.get("peer", 0),
                    store_blocks=c.reads.get("store", 0),
                )
                for c in caches
            ],
        )


def _node_message(s: NodeSample) -> agent_pb2.NodeSample:
    return agent_pb2.NodeSample(
        time=s.time,
        cpu_percent=s.cpu_percent,
        load1=s.load1,
        memory_used_bytes=s.memory_used,
        memory_total_bytes=s.memory_total,
        disk_used_bytes=s.disk_used,
        disk_total_bytes=s.disk_total,
        disk_read_bytes_per_s=s.disk_read_per_s,
        disk_write_bytes_per_s=s.disk_write_per_s,
        net_recv_bytes_per_s=s.net_recv_per_s,
        net_sent_bytes_per_s=s.net_sent_per_s,
        agent_cpu_percent=s.agent_cpu_percent,
        agent_rss_bytes=s.agent_rss,
        gpus=[
            agent_pb2.GpuSample(
                index=g.index,
                name=g.name,
                utilization_percent=_or_unknown(g.utilization_percent),
                memory_used_bytes=int(_or_unknown(g.memory_used)),
                memory_total_bytes=int(_or_unknown(g.memory_total)),
                temperature_c=_or_unknown(g.temperature_c),
            )
            for g in s.gpus
        ],
    )


def _or_unknown(value: float | None) -> float:
    return -1 if value is None else value
