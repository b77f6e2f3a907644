"""GPU assignment: the pure pool (exclusive GPUs, packing by share and by memory, no
overcommit) and, on real agents with ``--gpus`` and the fake NVML layer, tasks that see
exactly their GPUs in CUDA_VISIBLE_DEVICES and never double-book one under concurrency."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from hypermesh.agent.ops.gpus import GpuSample
from hypermesh.agent.tasks.gpu_pool import (
    ENV_FAKE_NVML,
    CountOverride,
    FakeNvml,
    GpuInfo,
    GpuPool,
    NvmlDevices,
)
from hypermesh.recipe.recipe import Hardware
from tests.conftest import Mesh
from tests.tasks.test_blocks_mesh import keys_of

GiB = 1 << 30


def gpus(*used: int, total: int = 16 * GiB) -> list[GpuInfo]:
    return [GpuInfo(i, "Tesla T4", total, u) for i, u in enumerate(used)]


def test_whole_gpus_are_exclusive() -> None:
    pool, devices = GpuPool(), gpus(0, 0, 0)
    assert pool.book("a", Hardware(gpus=2), devices) == [0, 1]
    assert pool.book("b", Hardware(gpus=2), devices) is None  # only one left
    assert pool.book("c", Hardware(gpus=0.5), devices) == [2]
    assert pool.book("d", Hardware(gpus=1), devices) is None  # GPU 2 is shared now
    pool.release("a")
    assert pool.book("d", Hardware(gpus=1), devices) == [0]
    assert pool.book("e", Hardware(), devices) == []  # no GPU asked, none given


def test_shares_pack_onto_the_fullest_gpu_that_fits() -> None:
    pool, devices = GpuPool(), gpus(0, 0)
    placed = [pool.book(n, Hardware(gpus=0.25), devices) for n in range(8)]
    assert placed == [[0]] * 4 + [[1]] * 4
    assert pool.book("x", Hardware(gpus=0.25), devices) is None
    pool.release(5)
    assert pool.book("y", Hardware(gpus=0.5), devices) is None  # 0.25 free is not 0.5
    assert pool.book("z", Hardware(gpus=0.25), devices) == [1]


def test_memory_requests_count_nvml_used_memory_and_reservations() -> None:
    pool, devices = GpuPool(), gpus(0, 12 * GiB)  # another process holds 12 GiB of GPU 1
    hw = Hardware(gpus=1, gpu_memory=4 * GiB)
    placed = [pool.book(n, hw, devices) for n in range(6)]
    # Fullest first: GPU 1 (4 GiB free) takes one, then GPU 0 four; the sixth fits nowhere.
    assert placed == [[1], [0], [0], [0], [0], None]
    assert pool.book("big", Hardware(gpus=1, gpu_memory=17 * GiB), gpus(0)) is None
    # A memory request where memory is unknown (the --gpus override without NVML) is refused.
    assert GpuPool().book("m", hw, [GpuInfo(0)]) is None
    assert GpuPool().book("s", Hardware(gpus=0.5), [GpuInfo(0)]) == [0]


def test_planner_copy_does_not_touch_the_pool_until_adopted() -> None:
    pool, devices = GpuPool(), gpus(0)
    scratch = pool.copy()
    assert scratch.book("t", Hardware(gpus=0.5), devices) == [0]
    assert pool.bookings == {}
    assert pool.adopt(scratch, "t") == [0]
    assert pool.place(Hardware(gpus=0.75), devices) is None


class Samples:
    """The agent's NVML layer as a test double: fixed samples."""

    available = True

    def sample(self) -> list[GpuSample]:
        return [GpuSample(0, "H100", 50.0, 3 * GiB, 80 * GiB, 40.0),
                GpuSample(1, "H100", None, None, None, None)]


def test_nvml_devices_come_from_the_agents_nvml_layer() -> None:
    assert NvmlDevices(Samples()).devices() == [  # type: ignore[arg-type]
        GpuInfo(0, "H100", 80 * GiB, 3 * GiB),
        GpuInfo(1, "H100"),  # memory not reported: unknown (0)
    ]


def test_fake_nvml_and_count_override(tmp_path: Path) -> None:
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps([{"name": "A100", "memory_total": 80 * GiB, "memory_used": 1}]))
    assert FakeNvml(spec).devices() == [GpuInfo(0, "A100", 80 * GiB, 1)]
    assert CountOverride(FakeNvml(spec), 2, "x").devices() == [
        GpuInfo(0, "A100", 80 * GiB, 1),
        GpuInfo(1, "x"),
    ]


# --------------------------------------------------------------------------- real agents


def spans_and_devices(mesh: Mesh, wid: str) -> list[tuple[float, float, set[str]]]:
    rows = []
    for t in mesh.hm_json("tasks", wid):
        (a,) = t["attempts"]
        seen = (mesh.root / "out" / str(t["index"])).read_text().strip()
        rows.append((a["started_at"], a["ended_at"], set(seen.split(",")) if seen else set()))
    return rows


def overlapping(rows: list[tuple[float, float, set[str]]]) -> list[tuple[set[str], set[str]]]:
    return [(a[2], b[2]) for a, b in itertools.combinations(rows, 2) if a[0] < b[1] and b[0] < a[1]]


RECIPE = """
experiments:
  train:
    samples: {samples}
    hardware: {hardware}
    command: ['echo "$CUDA_VISIBLE_DEVICES" > out/$HM_TASK_INDEX; sleep 1']
  cpu:
    after: [train]
    command: ['echo "[$CUDA_VISIBLE_DEVICES]" > out/cpu']
"""


def test_whole_gpu_tasks_never_share_a_gpu(mesh: Mesh) -> None:
    (mesh.root / "out").mkdir()
    mesh.agent(slots=8, extra=("--gpus", "3", "--gpu-type", "Tesla T4"))
    recipe = mesh.write_recipe(RECIPE.format(samples=6, hardware="{gpus: 1}"))
    wid = mesh.submit(recipe, "--wait")
    rows = spans_and_devices(mesh, wid)
    assert all(len(d) == 1 and d <= {"0", "1", "2"} for _, _, d in rows)
    pairs = overlapping(rows)
    assert pairs, "tasks should have run concurrently"
    assert all(not (a & b) for a, b in pairs)
    # At most 3 at once (3 GPUs) although the node has 8 slots.
    assert all(sum(1 for r in rows if r[0] <= s < r[1]) <= 3 for s, _, _ in rows)
    assert (mesh.root / "out" / "cpu").read_text().strip() == "[]"  # no GPU asked: none seen


@pytest.mark.parametrize("watch", ["all", "own"])
def test_gpu_tasks_on_a_large_mesh_run_in_one_task_blocks_and_never_share_a_gpu(
    mesh: Mesh, watch: str
) -> None:
    """From 64 slots on, a GPU experiment is written as one-task blocks: the holder books
    the GPUs as each starts, claims no block while its GPUs are taken (its slots are not
    the limit), and the leader offers GPU work where gossip says a GPU is free."""
    (mesh.root / "out").mkdir()
    for name in ("node1", "node2"):
        mesh.agent(name, slots=32, extra=("--gpus", "2", "--watch", watch))
    recipe = mesh.write_recipe(RECIPE.format(samples=10, hardware="{gpus: 1}"))
    wid = mesh.submit(recipe, "--wait")
    train = [t for t in mesh.hm_json("tasks", wid) if t["experiment"] == "train"]
    assert len(train) == 10 and all(t["state"] == "succeeded" for t in train), train
    by_node: dict[str, list[tuple[float, float, set[str]]]] = {}
    for t in train:
        (a,) = t["attempts"]
        seen = (mesh.root / "out" / str(t["index"])).read_text().strip()
        by_node.setdefault(a["node"], []).append((a["started_at"], a["ended_at"], {seen}))
    for rows in by_node.values():
        assert all(d <= {"0", "1"} for _, _, d in rows), rows
        assert all(not (a & b) for a, b in overlapping(rows)), rows
        assert all(sum(1 for r in rows if r[0] <= s < r[1]) <= 2 for s, _, _ in rows)
    assert len(keys_of(mesh, "block", wid)) == 11  # 10 + the cpu experiment's one
    assert keys_of(mesh, "task", wid) == [] and keys_of(mesh, "claim", wid) == []


def test_memory_packing_with_fake_nvml(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    (mesh.root / "out").mkdir()
    spec = mesh.root / "gpus.json"
    spec.write_text(json.dumps([
        {"name": "Tesla T4", "memory_total": 16 * GiB, "memory_used": 0},
        {"name": "Tesla T4", "memory_total": 16 * GiB, "memory_used": 12 * GiB},
    ]))
    monkeypatch.setenv(ENV_FAKE_NVML, str(spec))
    mesh.agent(slots=8)
    (node,) = mesh.hm_json("nodes")
    assert (node["gpus"], node["gpu_type"]) == (2, "Tesla T4")
    recipe = mesh.write_recipe(RECIPE.format(samples=8, hardware="{gpu_memory: 4GiB}"))
    wid = mesh.submit(recipe, "--wait")
    rows = spans_and_devices(mesh, wid)
    assert all(d in ({"0"}, {"1"}) for _, _, d in rows)
    for start, _, _ in rows:  # at any start: at most 4 on GPU 0 and 1 on GPU 1
        live = [d for s, e, d in rows if s <= start < e]
        assert sum(d == {"0"} for d in live) <= 4 and sum(d == {"1"} for d in live) <= 1
    # Packing happened: several trials shared GPU 0 at once.
    assert any(a == b == {"0"} for a, b in overlapping(rows))
