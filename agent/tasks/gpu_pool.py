"""Which GPUs of this node each task gets: ``CUDA_VISIBLE_DEVICES`` assignment and packing.

A task asking for ``gpus: N`` (a whole number) gets N GPUs no other task of this node
holds. A task asking for a share (``gpus: 0.25``) or for memory (``gpu_memory: 10GiB``)
shares one GPU with other such tasks, as long as the shares add up to at most 1 and the
memory reserved on it fits both the GPU's total and what NVML reports free (other
processes' memory counts). Among GPUs that fit, the fullest is chosen, so small trials
pack together and whole GPUs stay free for tasks that need them (Hydra's multi-model
packing). A task that fits nowhere is not claimed: the node never overcommits.
Memory used by other processes is estimated as NVML's figure while none of our tasks held
the GPU, or more when NVML later shows more than our reservations explain.

``GpuPool`` is pure (bookings in, placements out); the device list comes from a
``DeviceSource``: NVML on a real machine (the agent's NVML layer, ``agent/ops/gpus.py``),
``FakeNvml`` (a JSON file) in tests, and the ``--gpus N`` override, which keeps NVML's
memory figures for the GPUs NVML knows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hypermesh.agent.ops.gpus import GpuSource, open_gpus
from hypermesh.recipe.recipe import Hardware

ENV_FAKE_NVML = "HYPERMESH_FAKE_NVML"
EPSILON = 1e-9


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as its source reports it; memory in bytes, 0 total meaning unknown."""

    index: int
    name: str = ""
    memory_total: int = 0
    memory_used: int = 0

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)


class DeviceSource(Protocol):
    def devices(self) -> list[GpuInfo]: ...


class NvmlDevices:
    """This node's GPUs from NVML, through the agent's NVML layer (``agent/ops/gpus.py``);
    none where NVML or its driver is missing."""

    def __init__(self, source: GpuSource | None = None) -> None:
        self.source = source if source is not None else open_gpus()

    def devices(self) -> list[GpuInfo]:
        return [
            GpuInfo(g.index, g.name, g.memory_total or 0, g.memory_used or 0)
            for g in self.source.sample()
        ]


class FakeNvml:
    """GPUs described by a JSON file, re-read on every query so a test can change the
    memory in use: ``[{"name": "Tesla T4", "memory_total": 16e9, "memory_used": 0}, ...]``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def devices(self) -> list[GpuInfo]:
        items = json.loads(self.path.read_text())
        return [
            GpuInfo(
                i,
                str(d.get("name", "")),
                int(d.get("memory_total", 0)),
                int(d.get("memory_used", 0)),
            )
            for i, d in enumerate(items)
        ]


class CountOverride:
    """``--gpus N``: exactly N GPUs; memory figures from ``inner`` where it knows the GPU."""

    def __init__(self, inner: DeviceSource, count: int, name: str = "") -> None:
        self.inner = inner
        self.count = count
        self.name = name

    def devices(self) -> list[GpuInfo]:
        known = {d.index: d for d in self.inner.devices()}
        return [known.get(i, GpuInfo(i, self.name)) for i in range(self.count)]


def gpu_source(count: int | None, name: str | None) -> DeviceSource:
    """The node's GPUs: the fake named by ``$HYPERMESH_FAKE_NVML`` when set (tests),
    else NVML; with the ``--gpus`` count override on top when given."""
    fake = os.environ.get(ENV_FAKE_NVML)
    inner: DeviceSource = FakeNvml(Path(fake)) if fake else NvmlDevices()
    return inner if count is None else CountOverride(inner, count, name or "")


@dataclass(frozen=True)
class Booking:
    """What one task holds on one GPU: a share (1.0 = the whole GPU, exclusive) and
    reserved memory in bytes."""

    share: float
    memory: int
    exclusive: bool


@dataclass
class GpuPool:
    """Bookings of this node's GPUs by owner (a task). Only the agent's event loop
    changes it; ``copy`` gives the claim planner a scratch pad."""

    bookings: dict[int, dict[object, Booking]] = field(default_factory=dict)
    # Per GPU: memory in use when we last saw it with no booking of ours (other processes').
    baseline: dict[int, int] = field(default_factory=dict)

    def copy(self) -> GpuPool:
        return GpuPool({i: dict(b) for i, b in self.bookings.items()}, dict(self.baseline))

    def place(self, hw: Hardware, devices: list[GpuInfo]) -> list[int] | None:
        """The GPUs a task with ``hw`` would get now, or None if it does not fit."""
        for d in devices:
            if not self.bookings.get(d.index):
                self.baseline[d.index] = d.memory_used
        if hw.gpus <= 0 and not hw.gpu_memory:
            return []
        if hw.gpus >= 1 and not hw.gpu_memory:
            free = [d.index for d in devices if not self.bookings.get(d.index)]
            need = int(hw.gpus)
            return free[:need] if len(free) >= need else None
        best: tuple[float, int] | None = None
        for d in devices:
            room = self._room(d, hw)
            if room is not None and (best is None or room < best[0]):
                best = (room, d.index)
        return None if best is None else [best[1]]

    def _room(self, d: GpuInfo, hw: Hardware) -> float | None:
        """Share left on ``d`` after placing a shared task there, or None if it does not fit."""
        held = self.bookings.get(d.index, {}).values()
        if any(b.exclusive for b in held):
            return None
        share, memory = self._need(d, hw)
        if memory and not d.memory_total:
            return None  # a memory request on a GPU whose memory is unknown
        used_share = sum(b.share for b in held)
        if used_share + share > 1 + EPSILON:
            return None
        if d.memory_total:
            available = self.memory_available(d)
            if memory > available:
                return None
            return (available - memory) / d.memory_total
        return 1 - used_share - share

    def memory_available(self, d: GpuInfo) -> int:
        """GPU memory not reserved by our tasks nor used by other processes. Our tasks may
        not have allocated their reservation yet, so others' use is estimated as what was
        in use while we held nothing there, or more if NVML shows more than our
        reservations explain."""
        reserved = sum(b.memory for b in self.bookings.get(d.index, {}).values())
        others = max(self.baseline.get(d.index, d.memory_used), d.memory_used - reserved)
        return d.memory_total - reserved - others

    @staticmethod
    def _need(d: GpuInfo, hw: Hardware) -> tuple[float, int]:
        if hw.gpu_memory:
            share = hw.gpu_memory / d.memory_total if d.memory_total else 0.0
            return min(share, 1.0), hw.gpu_memory
        return hw.gpus, int(hw.gpus * d.memory_total)

    def book(self, owner: object, hw: Hardware, devices: list[GpuInfo]) -> list[int] | None:
        """Place and book a task; the GPU indices, or None (nothing booked) if it does not fit."""
        placed = self.place(hw, devices)
        if placed is None:
            return None
        exclusive = hw.gpus >= 1 and not hw.gpu_memory
        by_index = {d.index: d for d in devices}
        for i in placed:
            share, memory = (1.0, 0) if exclusive else self._need(by_index[i], hw)
            self.bookings.setdefault(i, {})[owner] = Booking(share, memory, exclusive)
        return placed

    def adopt(self, other: GpuPool, owner: object) -> list[int]:
        """Take over ``owner``'s bookings from ``other`` (the planner's scratch pad);
        the GPU indices it holds there."""
        indices = []
        for i, held in other.bookings.items():
            if owner in held:
                self.bookings.setdefault(i, {})[owner] = held[owner]
                indices.append(i)
        return sorted(indices)

    def release(self, owner: object) -> None:
        for held in self.bookings.values():
            held.pop(owner, None)


def visible_devices(indices: list[int]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for ``indices`` ("" hides every GPU)."""
    return ",".join(str(i) for i in indices)
