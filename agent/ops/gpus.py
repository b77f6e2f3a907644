"""Per-GPU figures from NVML, behind an interface so that tests can use a fake.

A machine without NVML (no NVIDIA driver, no ``pynvml``, a container without the
device) is the normal case, not an error: :func:`open_gpus` returns
:class:`NoGpus`, which reports nothing. A figure a GPU does not support (some
report no utilisation, e.g. under MIG) is ``None``, never a failure of the whole
sample.

Process ids from NVML are the host's; in a container with its own pid namespace
they match the agent's view only with ``hostPID`` (see ``scripts/k8s/``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. ``None``: the GPU does not report that figure."""

    index: int
    name: str
    utilization_percent: float | None
    memory_used: int | None
    memory_total: int | None
    temperature_c: float | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class GpuSource(Protocol):
    """Where GPU figures come from. Called from one thread at a time."""

    @property
    def available(self) -> bool:
        """Whether GPU figures are reported at all (NVML present)."""
        ...

    def sample(self) -> list[GpuSample]:
        """Every GPU's current figures, in index order."""
        ...

    def process_memory(self) -> dict[int, int]:
        """GPU memory in bytes per process id, summed over the GPUs it uses."""
        ...

    def close(self) -> None: ...


class NoGpus:
    """A machine without NVML: no GPUs, no error."""

    available = False

    def sample(self) -> list[GpuSample]:
        return []

    def process_memory(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        pass


class NvmlGpus:
    """NVML through ``pynvml`` (the ``nvidia-ml-py`` package). The constructor
    raises when NVML cannot be initialised; :func:`open_gpus` handles that."""

    available = True

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
        except Exception:
            pynvml.nvmlShutdown()
            raise

    def _try(self, call: Callable[..., T], *args: Any) -> T | None:
        try:
            return call(*args)
        except self._nvml.NVMLError as exc:
            log.debug("NVML: %s", exc)
            return None

    def sample(self) -> list[GpuSample]:
        nv = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            temp = self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            out.append(
                GpuSample(
                    index=i,
                    name=self._names[i],
                    utilization_percent=None if util is None else float(util.gpu),
                    memory_used=None if mem is None else int(mem.used),
                    memory_total=None if mem is None else int(mem.total),
                    temperature_c=None if temp is None else float(temp),
                )
            )
        return out

    def process_memory(self) -> dict[int, int]:
        nv = self._nvml
        used: dict[int, int] = {}
        for h in self._handles:
            seen: set[int] = set()  # a process can be listed as compute and graphics
            for query in (
                nv.nvmlDeviceGetComputeRunningProcesses,
                nv.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                for p in self._try(query, h) or []:
                    if p.pid in seen:
                        continue
                    seen.add(p.pid)
                    # usedGpuMemory is None where the driver cannot tell (Windows WDDM).
                    used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        return used

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_gpus() -> GpuSource:
    """NVML when it works on this machine, else :class:`NoGpus`."""
    try:
        return NvmlGpus()
    except Exception as exc:  # no driver, no library, no device: a machine without GPUs
        log.debug("NVML unavailable: %s", exc)
        return NoGpus()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
