"""A ``workers`` cap on a large mesh (64 slots or more), end to end: real etcd, two
real agents with 32 slots each, both kinds of node. The capped experiment runs in
one-task blocks whose claims take slots of the cap (``bcap/``): no more of its tasks
run at once than the cap, the cap can be changed live, and no slot is left held."""

from __future__ import annotations

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh
from tests.mesh.test_workflows import attempts_of, peak
from tests.tasks.test_blocks_mesh import WATCH, assert_written_in_blocks, keys_of, run_to_success

CAPPED = """\
experiments:
  e:
    samples: {samples}
    workers: {workers}
    command: sleep {seconds}
"""


def large_mesh(mesh: Mesh, watch: str) -> None:
    for name in ("node1", "node2"):
        mesh.agent(name, slots=32, extra=("--watch", watch))
    wait_for(lambda: len(mesh.hm_json("nodes")) == 2, 30, "both agents to register")


def running(mesh: Mesh, wid: str) -> int:
    return sum(t["state"] == "running" for t in mesh.hm_json("tasks", wid))


@WATCH
def test_on_a_large_mesh_a_capped_experiment_runs_in_blocks_within_its_cap(
    mesh: Mesh, watch: str
) -> None:
    large_mesh(mesh, watch)
    wid, tasks = run_to_success(mesh, CAPPED.format(samples=12, workers=3, seconds=1))
    assert len(tasks) == 12
    assert peak(attempts_of(tasks, "e")) == 3, tasks  # reached, never passed, 64 slots free
    assert_written_in_blocks(mesh, wid, 12)
    assert keys_of(mesh, "bcap", wid) == [] and keys_of(mesh, "slot", wid) == []


@WATCH
def test_on_a_large_mesh_the_cap_of_an_experiment_in_blocks_changes_live(
    mesh: Mesh, watch: str
) -> None:
    large_mesh(mesh, watch)
    wid = mesh.submit(mesh.write_recipe(CAPPED.format(samples=10, workers=2, seconds=60)))
    wait_for(lambda: running(mesh, wid) == 2, 30, "two tasks to run", interval=0.2)
    assert len(keys_of(mesh, "bcap", wid)) == 2

    assert mesh.hm_json("scale", wid, "e", "--workers", "5")["workers"] == 5
    wait_for(lambda: running(mesh, wid) == 5, 30, "five tasks to run", interval=0.2)
    assert len(keys_of(mesh, "bcap", wid)) == 5
    assert len(keys_of(mesh, "bclaim", wid)) == 5  # and no sixth block was claimed

    mesh.hm("cancel", wid, check=True)
    wait_for(lambda: keys_of(mesh, "bcap", wid) == [], 30, "every slot to be given back")
