"""A stand-in for ``pynvml`` (the ``nvidia-ml-py`` package) for machines without an
NVIDIA GPU: the calls hypermesh makes, answering from a JSON file, and failing the
way the real library fails.

Put this folder first on ``sys.path`` (or ``PYTHONPATH``, for an agent process) and
name the file in ``HM_TEST_PYNVML``; it is read again on every call, so a test can
change the figures while an agent runs. Its shape::

    {"init": null | "LibraryNotFound" | "DriverNotLoaded",   # what nvmlInit raises
     "gpus": [{"name": "NVIDIA H100", "name_bytes": false,   # old versions return bytes
               "util": 55 | null,        # null: NVMLError_NotSupported (as under MIG)
               "total": BYTES, "used": BYTES | null, "temp": 40 | null,
               "compute": [[PID | "PATH of a pid file", BYTES | null], ...] | "NotSupported",
               "graphics": [...] | "NotSupported"}]}

As in the real library, every error is an ``NVMLError`` whose class is the subclass
for its code (``NVMLError(3)`` is an ``NVMLError_NotSupported``), and calls before
``nvmlInit`` (or after the last ``nvmlShutdown``) raise ``NVMLError_Uninitialized``.
Only for tests; it ships in tests/, never with the package.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """An NVML return code; constructed with a code, it is the code's subclass."""

    _codes: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._codes.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return {
            NVML_ERROR_UNINITIALIZED: "Uninitialized",
            NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        }.get(self.value, f"Unknown Error {self.value}")


class NVMLError_Uninitialized(NVMLError):  # the real library's names
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


NVMLError._codes.update({
    NVML_ERROR_UNINITIALIZED: NVMLError_Uninitialized,
    NVML_ERROR_INVALID_ARGUMENT: NVMLError_InvalidArgument,
    NVML_ERROR_NOT_SUPPORTED: NVMLError_NotSupported,
    NVML_ERROR_DRIVER_NOT_LOADED: NVMLError_DriverNotLoaded,
    NVML_ERROR_LIBRARY_NOT_FOUND: NVMLError_LibraryNotFound,
})
_BY_NAME = {"LibraryNotFound": NVML_ERROR_LIBRARY_NOT_FOUND,
            "DriverNotLoaded": NVML_ERROR_DRIVER_NOT_LOADED}

_inits = 0  # nvmlInit calls not yet matched by nvmlShutdown, as NVML counts them


@dataclass(frozen=True)
class c_nvmlUtilization_t:
    gpu: int
    memory: int


@dataclass(frozen=True)
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class c_nvmlProcessInfo_t:
    pid: int
    usedGpuMemory: int | None  # None: the driver cannot tell (as on WDDM)


@dataclass(frozen=True)
class _Handle:
    index: int


def _spec() -> dict[str, Any]:
    with open(os.environ["HM_TEST_PYNVML"]) as f:
        spec: dict[str, Any] = json.load(f)
    return spec


def _gpu(handle: _Handle) -> dict[str, Any]:
    if _inits <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    gpus = _spec()["gpus"]
    if not isinstance(handle, _Handle) or not 0 <= handle.index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpu: dict[str, Any] = gpus[handle.index]
    return gpu


def nvmlInit() -> None:
    global _inits
    failure = _spec().get("init")
    if failure:
        raise NVMLError(_BY_NAME[failure])
    _inits += 1


def nvmlShutdown() -> None:
    global _inits
    if _inits <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _inits -= 1


def nvmlDeviceGetCount() -> int:
    if _inits <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return len(_spec()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    handle = _Handle(index)
    _gpu(handle)
    return handle


def nvmlDeviceGetName(handle: _Handle) -> str | bytes:
    gpu = _gpu(handle)
    name: str = gpu["name"]
    return name.encode() if gpu.get("name_bytes") else name


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> c_nvmlUtilization_t:
    util = _gpu(handle).get("util")
    if util is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlUtilization_t(gpu=int(util), memory=0)


def nvmlDeviceGetMemoryInfo(handle: _Handle) -> c_nvmlMemory_t:
    gpu = _gpu(handle)
    if gpu.get("used") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlMemory_t(total=gpu["total"], free=gpu["total"] - gpu["used"], used=gpu["used"])


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    temp = _gpu(handle).get("temp")
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if temp is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(temp)


def _processes(handle: _Handle, kind: str) -> list[c_nvmlProcessInfo_t]:
    listed = _gpu(handle).get(kind, [])
    if listed == "NotSupported":
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    out = []
    for pid, used in listed:
        if isinstance(pid, str):  # a pid file a test task writes
            try:
                with open(pid) as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
        out.append(c_nvmlProcessInfo_t(pid=pid, usedGpuMemory=used))
    return out


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[c_nvmlProcessInfo_t]:
    return _processes(handle, "compute")


def nvmlDeviceGetGraphicsRunningProcesses(handle: _Handle) -> list[c_nvmlProcessInfo_t]:
    return _processes(handle, "graphics")
