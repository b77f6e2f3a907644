"""What a telemetry sample holds, and the pure arithmetic that turns two readings of
cumulative counters into rates and percentages.

No psutil, no NVML, no clock here: :mod:`hypermesh.agent.ops.telemetry` reads the
machine and hands the readings in. Percentages of CPU follow ``top``'s per-process
convention where it is about processes (100 = one core fully busy) and psutil's
machine convention where it is about the node (100 = every core busy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypermesh.agent.ops.gpus import GpuSample

ProcessKey = tuple[int, float]
"""A process identity that survives pid reuse: (pid, create time in Unix seconds)."""


@dataclass(frozen=True)
class Counters:
    """Cumulative machine counters at one moment (``at``: monotonic seconds)."""

    at: float
    cpu_busy_s: float
    cpu_total_s: float
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    net_recv_bytes: int = 0
    net_sent_bytes: int = 0


def busy_percent(prev: Counters, now: Counters) -> float:
    """Share of the machine's CPU time that was busy between two readings, 0-100."""
    total = now.cpu_total_s - prev.cpu_total_s
    if total <= 0:
        return 0.0
    busy = now.cpu_busy_s - prev.cpu_busy_s
    return max(0.0, min(100.0, 100.0 * busy / total))


def per_second(prev: float, now: float, elapsed: float) -> float:
    """Rate of a cumulative counter; 0 when no time passed or the counter went back
    (a reset or wrap-around)."""
    if elapsed <= 0 or now < prev:
        return 0.0
    return (now - prev) / elapsed


def tree_cpu_seconds(
    prev: Mapping[ProcessKey, float], now: Mapping[ProcessKey, float], prev_wall: float
) -> float:
    """CPU seconds a set of processes used since the previous reading.

    ``prev`` and ``now`` map each process to its cumulative CPU seconds. A process
    seen before counts its difference; a process new since then counts all of its
    time if it started after the previous reading (``prev_wall``, Unix seconds),
    and nothing if it is merely new to us (its earlier time is not this interval's).
    A process that ended between the readings takes its last interval with it.
    """
    used = 0.0
    for key, cpu in now.items():
        before = prev.get(key)
        if before is not None:
            used += max(0.0, cpu - before)
        elif key[1] >= prev_wall:
            used += cpu
    return used


@dataclass(frozen=True)
class NodeSample:
    """A node at one moment. Rates are averages since the previous sample."""

    time: float
    cpu_percent: float
    load1: float
    memory_used: int
    memory_total: int
    disk_used: int
    disk_total: int
    disk_read_per_s: float
    disk_write_per_s: float
    net_recv_per_s: float
    net_sent_per_s: float
    agent_cpu_percent: float
    agent_rss: int
    gpus: tuple[GpuSample, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["gpus"] = [g.to_json() for g in self.gpus]
        return out


@dataclass(frozen=True)
class TaskUsage:
    """What one running attempt's process tree used in the last sampling period."""

    task_id: str
    attempt: int
    processes: int
    cpu_percent: float
    rss: int
    gpu_memory: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class History:
    """The last ``size`` node samples, oldest first. Owned by one writer."""

    size: int
    _items: deque[NodeSample] = field(init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"history size {self.size}: must be at least 1")
        self._items = deque(maxlen=self.size)

    def add(self, sample: NodeSample) -> None:
        self._items.append(sample)

    def latest(self) -> NodeSample | None:
        return self._items[-1] if self._items else None

    def last(self, n: int) -> list[NodeSample]:
        """The newest ``n`` samples (all of them for n >= size), oldest first."""
        if n <= 0:
            return []
        return list(self._items)[-n:]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[NodeSample]:
        return iter(self._items)
