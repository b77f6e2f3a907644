"""What this machine has: GPUs from NVML when present, CPUs and memory from psutil."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil

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
