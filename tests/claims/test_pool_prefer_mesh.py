"""Soft pool preference end to end: real etcd, two real agents in two pools.

``p1`` (pool ``onprem``) and ``c1`` (pool ``cloud``) have two slots each; the recipes
prefer ``onprem``. While p1 has room it runs the tasks (c1 leaves them to it, as its
decision log says); the work it has no room for goes to c1 at once; when p1 is gone
(SIGKILL) c1 takes over its tasks."""

from __future__ import annotations

from collections import Counter

import pytest

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh
from tests.tasks.test_blocks_mesh import assert_written_in_blocks

PREFERRING = """\
experiments:
  e:
    parameters:
      i: {{values: [{values}]}}
    command: sleep {seconds}
    prefer_pools: [onprem]
"""
DELAY = ("--pool-delay", "4")


def nodes_of(mesh: Mesh, wid: str) -> Counter[str]:
    """How many first attempts of the workflow's tasks each node ran."""
    return Counter(t["attempts"][0]["node"] for t in mesh.hm_json("tasks", wid))


def all_running(mesh: Mesh, wid: str) -> Counter[str] | None:
    """Once every task of the workflow runs, how many run on each node; else None."""
    tasks = mesh.hm_json("tasks", wid)
    if all(t["state"] == "running" for t in tasks):
        return Counter(t["node"] for t in tasks)
    return None


def test_preferred_pool_runs_tasks_first_others_take_the_rest(mesh: Mesh) -> None:
    onprem = mesh.agent("p1", slots=2, extra=("--pool", "onprem", *DELAY))
    cloud = mesh.agent("c1", slots=2, extra=("--pool", "cloud", *DELAY))
    wait_for(lambda: len(mesh.hm_json("nodes")) == 2, 30, "both agents to register")

    # p1 has room for both tasks: they run there, c1 leaves them to it.
    wid = mesh.submit(mesh.write_recipe(PREFERRING.format(values="0, 1", seconds=0.5), "a.yaml"))
    assert mesh.wait_state(wid, {"succeeded", "failed"})["state"] == "succeeded", mesh.logs()
    assert nodes_of(mesh, wid) == {"p1": 2}, mesh.logs()
    assert "to p1, a node of a preferred pool with room" in cloud.log_tail(100_000)

    # Four tasks, room for two on p1: c1 takes the other two without waiting.
    wid = mesh.submit(mesh.write_recipe(PREFERRING.format(values="0, 1, 2, 3", seconds=4),
                                        "b.yaml"))

    running = wait_for(lambda: all_running(mesh, wid), 20, "all four tasks to run",
                       interval=0.2)
    assert running == {"p1": 2, "c1": 2}, mesh.logs()

    # p1 is gone: its two tasks are lost and c1 runs them when it has room.
    onprem.kill()
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded", \
        mesh.logs()
    finals = Counter(t["attempts"][-1]["node"] for t in mesh.hm_json("tasks", wid))
    assert finals == {"c1": 4}, mesh.logs()


def test_submit_warns_when_no_preferred_pool_exists(mesh: Mesh) -> None:
    recipe = mesh.write_recipe(PREFERRING.format(values="0", seconds=0))
    result = mesh.hm("submit", str(recipe), check=True)
    assert ("warning: experiment 'e': no preferred pool (onprem) is declared or has a live "
            "node; the preference does nothing until one does") in result.stderr
    mesh.hm("pool", "set", "onprem", check=True)
    again = mesh.hm("submit", str(recipe), check=True).stderr
    assert "preferred pool" not in again  # (no node is live yet: that warning stays)
    assert "no live node in the mesh" in again


@pytest.mark.parametrize("watch", ["all", "own"])
def test_on_a_large_mesh_the_preferred_pool_runs_one_task_blocks_first(
    mesh: Mesh, watch: str
) -> None:
    # 32 slots each: a mesh of 64 slots, where the experiment runs in one-task blocks.
    # p1 has room for 32 of the 40 tasks: it runs those, c1 the other 8 at once. (A
    # longer delay than above: p1 claims its 32 blocks two offers at a time.)
    for name, pool in (("p1", "onprem"), ("c1", "cloud")):
        mesh.agent(name, slots=32, extra=("--pool", pool, "--watch", watch,
                                          "--pool-delay", "15"))
    wait_for(lambda: len(mesh.hm_json("nodes")) == 2, 30, "both agents to register")
    values = ", ".join(str(i) for i in range(40))
    wid = mesh.submit(mesh.write_recipe(PREFERRING.format(values=values, seconds=10), "c.yaml"))

    running = wait_for(lambda: all_running(mesh, wid), 30, "all 40 tasks to run",
                       interval=0.2)
    assert running == {"p1": 32, "c1": 8}, mesh.logs()
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    assert_written_in_blocks(mesh, wid, 40)
