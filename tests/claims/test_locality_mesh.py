"""Tasks go where their data is: real agents, real SeaweedFS, real FUSE mounts.

Round 1 pins one shard's task to each node (pools), so each node's chunk cache holds
one shard and gossip advertises it. Round 2 reads the same shards with no pinning:
each shard's tasks must land on the node that holds it. A task whose holder is busy
still runs elsewhere once the delay has passed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh
from tests.tasks.test_blocks_mesh import assert_written_in_blocks

MIB = 1 << 20
DELAY_S = 2.0

ROUND_1 = """
experiments:
  a:
    data: {shards: shards}
    pools: [p1]
    inputs: shards/shard-0
    command: cat "$HM_DATA_SHARDS"/shard-0/* > /dev/null
  b:
    data: {shards: shards}
    pools: [p2]
    inputs: shards/shard-1
    command: cat "$HM_DATA_SHARDS"/shard-1/* > /dev/null
"""


def _shards(store: S3Store, tmp_path: Path) -> None:
    """Two shards of 4 MiB (two files each), one 4 MiB chunk per shard."""
    src = tmp_path / "src"
    for shard in (0, 1):
        (src / f"shard-{shard}").mkdir(parents=True)
        for part in ("a", "b"):
            (src / f"shard-{shard}" / part).write_bytes(os.urandom(2 * MIB))
    put_dataset(store, src, "shards", chunk_size=4 * MIB)


def _start(mesh: Mesh, store_url: str, slots: int = 1,
           more: tuple[str, ...] = ()) -> tuple[AgentProcess, AgentProcess]:
    extra = ("--store", store_url, "--cache-size", "64MiB", "--locality-delay", str(DELAY_S),
             *more)
    one = mesh.agent("node1", slots=slots, extra=(*extra, "--pool", "p1"))
    two = mesh.agent("node2", slots=slots, extra=(*extra, "--pool", "p2"))
    return one, two


def _first_round(mesh: Mesh) -> None:
    """Each node reads one shard; then wait until both nodes know who holds what."""
    wid = mesh.submit(mesh.write_recipe(ROUND_1, "round1.yaml"))
    assert mesh.wait_state(wid, {"succeeded", "failed"}, 90)["state"] == "succeeded"
    nodes = {t["experiment"]: t["node"] for t in mesh.hm_json("tasks", wid)}
    assert nodes == {"a": "node1", "b": "node2"}

    def advertised() -> bool:  # as each node sees both (its own scan and gossip)
        for via in ("node1", "node2"):
            rows = mesh.hm_json("nodes", "--via", via)
            if not all(r["cached_bytes"] and r["cached_bytes"] >= 4 * MIB for r in rows):
                return False
        return True

    wait_for(advertised, 60, "both nodes to advertise the shard they read")


def _tasks(mesh: Mesh, wid: str) -> list[dict[str, Any]]:
    return sorted(mesh.hm_json("tasks", wid), key=lambda t: t["index"])


# Shard 1 first in index order, four tasks per shard: claiming by index alone would put
# shard 1 on whichever node asked first (a chance layout is 1 in 70).
ROUND_2 = """
experiments:
  e:
    data: {shards: shards}
    parameters:
      shard: {values: [1, 0]}
      rep: {values: [w, x, y, z]}
    inputs: ["shards/shard-{{shard}}"]
    command:
      - cat "$HM_DATA_SHARDS"/shard-{{shard}}/* > /dev/null
      - sleep 0.3
"""


def _second_round(mesh: Mesh) -> str:
    """Each shard's tasks run on the node that holds it; the workflow's id."""
    wid = mesh.submit(mesh.write_recipe(ROUND_2, "round2.yaml"))
    assert mesh.wait_state(wid, {"succeeded", "failed"}, 90)["state"] == "succeeded"
    placed = [(t["params"]["shard"], t["node"]) for t in _tasks(mesh, wid)]
    assert len(placed) == 8
    assert all(node == ("node1" if shard == 0 else "node2") for shard, node in placed), placed
    return wid


def test_second_round_tasks_land_on_the_node_holding_their_shard(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    _shards(store, tmp_path)
    _start(mesh, store_url)
    _first_round(mesh)
    _second_round(mesh)


def _large_mesh_after_the_first_round(mesh: Mesh, store: S3Store, store_url: str,
                                     tmp_path: Path, watch: str) -> None:
    """Two nodes of 32 slots (a mesh of 64 slots, where experiments with inputs run in
    one-task blocks), each holding the shard it read in the first round."""
    _shards(store, tmp_path)
    _start(mesh, store_url, slots=32, more=("--watch", watch))
    _first_round(mesh)


@pytest.mark.parametrize("watch", ["all", "own"])
def test_on_a_large_mesh_one_task_blocks_land_on_the_node_holding_their_shard(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path, watch: str
) -> None:
    # Nodes that watch everything choose one-task blocks by their data; the leader
    # offers them to nodes that watch their own part by the same rule.
    _large_mesh_after_the_first_round(mesh, store, store_url, tmp_path, watch)
    wid = _second_round(mesh)
    assert_written_in_blocks(mesh, wid, 8)


SHARD_0 = """
experiments:
  e:
    data: {shards: shards}
    inputs: shards/shard-0
    command: cat "$HM_DATA_SHARDS"/shard-0/* > /dev/null
"""


def _shard_0_on_node2(mesh: Mesh) -> tuple[str, float]:
    """One task reading shard 0 (node1's) runs, on node2: the workflow's id, and how
    long after the submit it started."""
    wid = mesh.submit(mesh.write_recipe(SHARD_0, "shard0.yaml"))
    status = mesh.wait_state(wid, {"succeeded", "failed"}, 60)
    assert status["state"] == "succeeded"
    (task,) = _tasks(mesh, wid)
    assert task["node"] == "node2"
    return wid, task["attempts"][0]["started_at"] - status["submitted_at"]


def test_a_task_whose_holder_is_busy_runs_elsewhere_after_the_delay(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    _shards(store, tmp_path)
    _, two = _start(mesh, store_url)
    _first_round(mesh)
    # node1 (holding shard 0) is busy with its only slot
    busy = mesh.submit(mesh.write_recipe(
        "experiments:\n  hold:\n    pools: [p1]\n    command: sleep 60\n", "busy.yaml"
    ))
    wait_for(lambda: _tasks(mesh, busy) and _tasks(mesh, busy)[0]["state"] == "running", 30,
             "node1 to be busy")
    wid, waited = _shard_0_on_node2(mesh)
    assert waited >= DELAY_S - 0.2, waited  # it was left to node1 for the delay first
    assert f"leaving {wid}.e.0 to node1" in two.log_tail(20000)
    mesh.hm("cancel", busy, check=True)


@pytest.mark.parametrize("watch", ["all", "own"])
def test_on_a_large_mesh_a_block_whose_holder_is_busy_runs_elsewhere_after_the_delay(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path, watch: str
) -> None:
    # node1 holds shard 0 and all its 32 slots are busy: the block is kept for it for
    # the delay (offered to it, or left to it by node2), then node2 runs it.
    _large_mesh_after_the_first_round(mesh, store, store_url, tmp_path, watch)
    busy = mesh.submit(mesh.write_recipe(
        "experiments:\n  hold:\n    pools: [p1]\n    samples: 32\n    command: sleep 60\n",
        "busy.yaml"))
    wait_for(lambda: [t["state"] for t in _tasks(mesh, busy)] == ["running"] * 32, 30,
             "node1's 32 slots to be busy")
    wid, waited = _shard_0_on_node2(mesh)
    assert waited >= DELAY_S - 0.2, waited  # it was kept for node1 for the delay first
    assert waited < 30, waited  # and not until one of node1's tasks ended (60 s)
    assert_written_in_blocks(mesh, wid, 1)
    mesh.hm("cancel", busy, check=True)
