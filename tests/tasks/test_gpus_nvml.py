"""The NVML code path (``agent/ops/gpus.py``'s ``NvmlGpus``, ``detect_gpus``) on a machine
without a GPU: a stand-in ``pynvml`` module (tests/nvml_standin/) answers the calls the
real library answers and raises its ``NVMLError`` subclasses where it does. No real
GPU or NVML library runs here; what this shows is that our side of the calls —
samples, unsupported figures, per-process GPU memory summed per task, failures at
start — behaves, in-process and in a real agent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

from hypermesh.agent.ops.gpus import NoGpus, NvmlGpus, open_gpus
from hypermesh.agent.ops.telemetry import Sampler, TaskRoot, Telemetry, detect_gpus
from hypermesh.agent.tasks.gpu_pool import GpuInfo, NvmlDevices
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh

STANDIN = Path(__file__).parent / "nvml_standin"
GiB, MiB = 1 << 30, 1 << 20
H100 = "NVIDIA H100 80GB HBM3"

Spec = Callable[[dict[str, Any]], None]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[ModuleType, Spec]]:
    """The stand-in imported as ``pynvml`` and a function that sets its figures."""
    path = tmp_path / "nvml.json"
    monkeypatch.setenv("HM_TEST_PYNVML", str(path))
    found = importlib.util.spec_from_file_location("pynvml", STANDIN / "pynvml.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    found.loader.exec_module(module)

    def write(spec: dict[str, Any]) -> None:
        path.write_text(json.dumps(spec))

    yield module, write
    assert module._inits == 0, "NVML was initialised more often than shut down"


def two_gpus(root: int, child: int) -> dict[str, Any]:
    """GPU 0 reports everything and lists the task's root both as a compute and a
    graphics process; GPU 1 (a MIG-like one) reports no utilisation, memory or
    temperature, no compute process list, and a graphics process whose memory the
    driver cannot tell."""
    return {
        "gpus": [
            {"name": H100, "util": 55, "total": 80 * GiB, "used": 7 * GiB, "temp": 41,
             "compute": [[root, 2 * GiB], [child, 1 * GiB], [1, 4 * GiB]],
             "graphics": [[root, 2 * GiB]]},
            {"name": H100, "name_bytes": True, "util": None, "total": 80 * GiB, "used": None,
             "temp": None, "compute": "NotSupported",
             "graphics": [[child, 512 * MiB], [root, None]]},
        ]
    }


def test_samples_and_per_process_gpu_memory_through_pynvml(
    nvml: tuple[ModuleType, Spec], tmp_path: Path
) -> None:
    module, spec = nvml
    tree = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & wait"])
    try:
        child = wait_for(lambda: psutil.Process(tree.pid).children(), 10, "the child")
        assert isinstance(child, list)
        spec(two_gpus(tree.pid, child[0].pid))
        assert detect_gpus() == (2, H100)
        gpus = open_gpus()
        assert isinstance(gpus, NvmlGpus) and gpus.available
        first, second = gpus.sample()
        assert (first.index, first.name, first.utilization_percent) == (0, H100, 55.0)
        assert (first.memory_used, first.memory_total, first.temperature_c) == (
            7 * GiB, 80 * GiB, 41.0)
        # Not supported is "unknown", never a failed sample; bytes names are decoded.
        assert (second.index, second.name) == (1, H100)
        assert (second.utilization_percent, second.memory_used, second.memory_total,
                second.temperature_c) == (None, None, None, None)
        # Per process, over both GPUs; a pid listed twice on one GPU counts once, and
        # memory the driver cannot tell counts 0.
        assert gpus.process_memory() == {
            tree.pid: 2 * GiB, child[0].pid: 1 * GiB + 512 * MiB, 1: 4 * GiB}
        sampler = Sampler(tmp_path, gpus)
        node, (usage,) = sampler.sample([TaskRoot("wf.exp.0", 1, tree.pid)])
        assert usage.processes == 2 and usage.gpu_memory == 3 * GiB + 512 * MiB
        assert [g.utilization_percent for g in node.gpus] == [55.0, None]
        # What the claims see: NVML's memory where it reports it, unknown (0) where not.
        assert NvmlDevices(gpus).devices() == [GpuInfo(0, H100, 80 * GiB, 7 * GiB),
                                               GpuInfo(1, H100)]
        telemetry = Telemetry(tmp_path, 1.0, 4, gpus)
        telemetry.history.add(node)
        reply = telemetry.message("n1", 0, "")
        assert reply.nvml
        assert [(g.utilization_percent, g.memory_used_bytes, g.temperature_c)
                for g in reply.latest.gpus] == [(55.0, 7 * GiB, 41.0), (-1, -1, -1)]
        sampler.close()  # shuts NVML down (the fixture checks every init was matched)
        with pytest.raises(module.NVMLError_Uninitialized):
            module.nvmlDeviceGetCount()
    finally:
        tree.kill()
        tree.wait()


@pytest.mark.parametrize("failure", ["LibraryNotFound", "DriverNotLoaded"])
def test_nvml_that_cannot_start_means_no_gpus(nvml: tuple[ModuleType, Spec], failure: str) -> None:
    module, spec = nvml
    spec({"init": failure, "gpus": []})
    with pytest.raises(module.NVMLError) as raised:  # the stand-in fails as NVML does
        module.nvmlInit()
    assert type(raised.value).__name__ == f"NVMLError_{failure}"
    assert detect_gpus() == (0, "")
    assert isinstance(open_gpus(), NoGpus)


def test_a_gpu_list_that_fails_while_sampling_is_not_fatal(nvml: tuple[ModuleType, Spec]) -> None:
    _, spec = nvml
    spec(two_gpus(os.getpid(), os.getpid()))
    gpus = open_gpus()
    spec({"gpus": []})  # e.g. a GPU fell off the bus: its handle is now invalid
    assert [(s.utilization_percent, s.memory_used) for s in gpus.sample()] == [(None, None)] * 2
    assert gpus.process_memory() == {}
    gpus.close()


def test_an_agent_reports_gpus_and_task_gpu_memory_through_pynvml(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = mesh.root / "task.pid"
    spec = mesh.root / "nvml.json"
    spec.write_text(json.dumps({"gpus": [
        {"name": H100, "util": 87, "total": 80 * GiB, "used": 20 * GiB, "temp": 63,
         "compute": [[str(pid_file), 3 * GiB], [1, 1 * GiB]], "graphics": "NotSupported"},
    ]}))
    # The agent process imports the stand-in as pynvml.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(STANDIN), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("HM_TEST_PYNVML", str(spec))
    mesh.agent("node1", extra=("--telemetry-period", "0.5"))
    (node,) = mesh.hm_json("nodes")
    assert (node["gpus"], node["gpu_type"]) == (1, H100)
    recipe = mesh.write_recipe(
        f"experiments:\n  train:\n    hardware: {{gpus: 1}}\n"
        f"    command: ['echo $$ > {pid_file}; echo \"[$CUDA_VISIBLE_DEVICES]\"; exec sleep 60']\n"
    )
    wid = mesh.submit(recipe)

    def attributed() -> dict[str, Any] | None:
        (row,) = mesh.hm_json("top")
        t = row["telemetry"]
        tasks = t["tasks"] if t else []
        return t if tasks and tasks[0]["gpu_memory_bytes"] == 3 * GiB else None

    try:
        t = wait_for(attributed, 30, "the task's GPU memory in `top`", interval=0.3)
        assert isinstance(t, dict) and t["nvml"]
        (gpu,) = t["latest"]["gpus"]
        assert gpu == {"index": 0, "name": H100, "utilization_percent": 87.0,
                       "memory_used_bytes": 20 * GiB, "memory_total_bytes": 80 * GiB,
                       "temperature_c": 63.0}
        assert "[0]" in mesh.hm("logs", f"{wid}.train.0", check=True).stdout
    finally:
        mesh.hm("cancel", wid)
