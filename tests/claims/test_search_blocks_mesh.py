"""Searches on a large mesh (64 slots or more), end to end: real etcd, real agents. An
adaptive search (TPE) and an experiment with pruning run in one-task blocks, not
task by task. With ``--watch own`` a node receives neither blocks nor metrics: its
pruning checks ask the pruner with the per-step medians the leader publishes
(``prunemed/``), and still stop the trials worse than the median."""

from __future__ import annotations

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh
from tests.tasks.test_blocks_mesh import WATCH, assert_written_in_blocks, keys_of, run_to_success

# loss = q / (step + 1). Trials of q <= 5 report 100 steps at once and end; those of
# q >= 50 report a step every 0.5 s for 50 s unless the median pruner stops them, which
# it does at their next report once the five others completed (its startup trials).
TRIAL = """\
import sys, time
q = float(sys.argv[1])
for step in range(100):
    print("HM_METRIC", '{"step": %d, "loss": %r}' % (step, q / (step + 1)), flush=True)
    if q > 10:
        time.sleep(0.5)
"""

PRUNED = """\
experiments:
  e:
    parameters:
      q: {values: [1, 2, 3, 4, 5, 50, 60]}
    objective: {metric: loss, goal: minimize}
    pruning: median
    pools: [work]
    command: ["python3 trial.py {{q}}"]
"""

TPE = """\
experiments:
  e:
    parameters:
      x: {range: [-4, 4]}
    samples: 6
    sampling: tpe
    objective: {metric: loss, goal: minimize}
    pools: [work]
    command: ["python3 square.py {{x}}"]
"""
SQUARE = """\
import sys
x = float(sys.argv[1])
print("HM_METRIC", '{"loss": %r}' % (x * x))
"""


def large_mesh(mesh: Mesh, watch: str) -> None:
    """node1 (pool ``lead``, one slot) leads; node2 (pool ``work``, 63 slots) runs the
    searches' trials and, with ``--watch own``, sees only its own part."""
    mesh.agent("node1", slots=1, extra=("--watch", watch, "--pool", "lead"))
    wait_for(lambda: [n["name"] for n in mesh.hm_json("nodes") if n["leader"]] == ["node1"],
             30, "node1 to lead")
    mesh.agent("node2", slots=63, extra=("--watch", watch, "--pool", "work"))
    wait_for(lambda: len(mesh.hm_json("nodes")) == 2, 30, "both agents to register")


@WATCH
def test_on_a_large_mesh_pruning_stops_trials_in_blocks(mesh: Mesh, watch: str) -> None:
    large_mesh(mesh, watch)
    (mesh.root / "trial.py").write_text(TRIAL)
    wid, tasks = run_to_success(mesh, PRUNED)
    assert len(tasks) == 7 and {t["node"] for t in tasks} == {"node2"}, tasks
    assert {t["params"]["q"] for t in tasks if t["pruned"]} == {50, 60}, tasks
    rows = mesh.hm_json("best", wid, "--incomplete", "-n", "7", "--json")
    steps = {row["params"]["q"]: len(row["curve"]) for row in rows}
    assert steps == {1: 100, 2: 100, 3: 100, 4: 100, 5: 100, 50: steps[50], 60: steps[60]}
    assert steps[50] < 100 and steps[60] < 100, steps  # stopped before their end
    assert_written_in_blocks(mesh, wid, 7)
    assert keys_of(mesh, "metrics", wid)  # stored, as every metric is


@WATCH
def test_on_a_large_mesh_an_adaptive_search_suggests_one_task_blocks(
    mesh: Mesh, watch: str
) -> None:
    large_mesh(mesh, watch)
    (mesh.root / "square.py").write_text(SQUARE)
    wid, tasks = run_to_success(mesh, TPE)
    assert sorted(t["index"] for t in tasks) == list(range(6))
    assert {t["node"] for t in tasks} == {"node2"}, tasks
    assert_written_in_blocks(mesh, wid, 6)
    best = mesh.hm_json("best", wid, "--json")
    assert best and all(row["value"] == row["params"]["x"] ** 2 for row in best), best
