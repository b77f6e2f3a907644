"""Gangs end to end: real etcd, real agents, real ``torch.distributed`` (gloo, on CPU).

A gang's members run in the workflow's workdir (the test's folder, shared by every
agent of this host); each rank writes what it saw under ``out/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hypermesh.localmesh import wait_for
from tests.conftest import Mesh

# One training run: every step all-reduces (rank + 1) over the gang; rank 0 keeps the
# next step in $HM_CHECKPOINT_DIR, and a restarted gang resumes from it.
TRAIN = '''
import datetime, json, os, pathlib, sys, time
import torch
import torch.distributed as dist

steps, pause = int(sys.argv[1]), float(sys.argv[2])
rank = int(os.environ["RANK"])
ckpt = pathlib.Path(os.environ["HM_CHECKPOINT_DIR"]) / "step.json"
start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
out = pathlib.Path("out")
out.mkdir(exist_ok=True)
with open(out / f"starts-{rank}.txt", "a") as f:
    f.write(f"{os.environ['HM_ATTEMPT']} {start} {os.environ['HM_NODE']}\\n")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
total = None
for step in range(start, steps):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    total = t.item()
    if rank == 0:
        tmp = ckpt.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step + 1}))
        os.replace(tmp, ckpt)
    time.sleep(pause)
dist.barrier()
names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "HM_GANG_ID",
         "HM_NODE")
(out / f"rank{rank}.json").write_text(
    json.dumps({"sum": total, "env": {k: os.environ[k] for k in names}}))
dist.destroy_process_group()
'''


def gang_recipe(mesh: Mesh, steps: int, pause: float) -> Path:
    (mesh.root / "train.py").write_text(TRAIN)
    return mesh.write_recipe(f"""
experiments:
  train:
    nodes: 2
    command: ["{sys.executable} train.py {steps} {pause}"]
""")


def tasks(mesh: Mesh, wid: str) -> list[dict[str, Any]]:
    return mesh.hm_json("tasks", wid)  # type: ignore[no-any-return]


def test_a_two_node_gang_all_reduces_with_torch_distributed(mesh: Mesh) -> None:
    mesh.agent("node1", slots=1)
    mesh.agent("node2", slots=1)
    wid = mesh.submit(gang_recipe(mesh, steps=2, pause=0.0))
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    ranks = [json.loads((mesh.root / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]  # 1 + 2, on both ranks
    env0, env1 = ranks[0]["env"], ranks[1]["env"]
    assert {env0["HM_NODE"], env1["HM_NODE"]} == {"node1", "node2"}  # two distinct agents
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == "127.0.0.1"
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"]
    assert (env0["WORLD_SIZE"], env0["RANK"], env1["RANK"], env1["LOCAL_RANK"]) == (
        "2", "0", "1", "0")
    assert env0["HM_GANG_ID"] == f"{wid}.train.0.1"
    (task,) = tasks(mesh, wid)
    assert [(a["state"], a["node"]) for a in task["attempts"]] == [
        ("succeeded", env0["HM_NODE"])]


def test_two_gangs_of_two_on_three_agents_both_finish(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=1)
    recipe = mesh.write_recipe("""
experiments:
  pair:
    nodes: 2
    samples: 2
    command: ["echo $RANK/$WORLD_SIZE on $HM_NODE >> out-$HM_TASK_INDEX.txt; sleep 1"]
""")
    wid = mesh.submit(recipe)
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    for index in (0, 1):
        lines = sorted((mesh.root / f"out-{index}.txt").read_text().splitlines())
        assert [line.split(" on ")[0] for line in lines] == ["0/2", "1/2"]
        assert len({line.split(" on ")[1] for line in lines}) == 2
    assert all(len(t["attempts"]) == 1 for t in tasks(mesh, wid))


def test_a_gang_bigger_than_the_mesh_waits_with_a_reason_and_holds_nothing(mesh: Mesh) -> None:
    mesh.agent("node1", slots=1)
    mesh.agent("node2", slots=1)
    recipe = mesh.write_recipe("""
experiments:
  big:
    nodes: 3
    command: ["true"]
  small:
    samples: 4
    command: ["true"]
""")
    wid = mesh.submit(recipe)

    def small_done() -> dict[str, Any] | None:
        status = mesh.hm_json("status", wid)
        return status if status["experiments"]["small"]["state"] == "succeeded" else None

    status: Any = wait_for(small_done, 30, "the ordinary tasks to finish")
    assert status["state"] == "running"
    assert status["experiments"]["big"]["waiting"] == "waiting for 3 nodes, 2 in mesh"
    (big,) = mesh.hm_json("tasks", wid, "--experiment", "big")
    assert (big["state"], big["waiting"], big["attempts"]) == (
        "pending", "waiting for 3 nodes, 2 in mesh", [])
    text = mesh.hm("status", wid, check=True).stdout
    assert "waiting for 3 nodes, 2 in mesh" in text
    mesh.hm("cancel", wid, check=True)


def test_members_give_their_seats_back_when_the_gang_cannot_fill(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=1)
    blocker = mesh.write_recipe("experiments:\n  hold:\n    command: ['sleep 60']\n", "hold.yaml")
    hold = mesh.submit(blocker)
    wait_for(lambda: tasks(mesh, hold)[0]["state"] == "running", 30, "the blocker to run")
    recipe = mesh.write_recipe("""
experiments:
  trio:
    nodes: 3
    command: ["echo $RANK/$WORLD_SIZE >> ranks.txt"]
""")
    wid = mesh.submit(recipe)

    def waiting(text: str) -> Any:
        def check() -> bool:
            (task,) = tasks(mesh, wid)
            return task.get("waiting") == text

        return check

    wait_for(waiting("waiting for 3 nodes, 2 of 3 ranks held"), 30, "two seats taken")
    # The local preset's waiting bound is 4 s: then both give their seats back.
    wait_for(waiting("waiting for 3 nodes, 0 of 3 ranks held"), 30, "the seats given back")
    mesh.hm("cancel", hold, check=True)  # now all three can sit in the gang
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    assert sorted((mesh.root / "ranks.txt").read_text().split()) == ["0/3", "1/3", "2/3"]


def starts(mesh: Mesh, rank: int) -> list[tuple[int, int, str]]:
    """(attempt, step it started from, node) of each start of ``rank``."""
    lines = (mesh.root / "out" / f"starts-{rank}.txt").read_text().splitlines()
    return [(int(a), int(s), n) for a, s, n in (line.split() for line in lines)]


def test_a_lost_member_restarts_the_gang_from_its_checkpoint(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=1)
    wid = mesh.submit(gang_recipe(mesh, steps=10, pause=0.3))
    ckpt = mesh.root / ".hm-checkpoints" / f"{wid}.train.0" / "step.json"
    wait_for(lambda: ckpt.exists() and json.loads(ckpt.read_text())["step"] >= 3, 60,
             "three steps checkpointed")
    victim = starts(mesh, 1)[0][2]  # the member of rank 1: rank 0 goes on to record
    mesh.agents[victim].crash()
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)["state"] == "succeeded"
    (task,) = tasks(mesh, wid)
    assert [(a["attempt"], a["state"], a["reason"]) for a in task["attempts"]] == [
        (1, "failed", "node-lost"), (2, "succeeded", "exit")]
    assert json.loads(ckpt.read_text())["step"] == 10
    for rank in (0, 1):
        first, *_, last = starts(mesh, rank)
        assert first[:2] == (1, 0)
        assert last[0] == 2 and last[1] >= 3  # the new attempt resumed, not from step 0
        assert last[2] != victim
    assert starts(mesh, 0)[-1][2] != starts(mesh, 1)[-1][2]
    assert [json.loads((mesh.root / "out" / f"rank{r}.json").read_text())["sum"]
            for r in (0, 1)] == [3.0, 3.0]
