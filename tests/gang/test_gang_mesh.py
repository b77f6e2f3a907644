"""Gangs end to end: real etcd, real agents, real ``torch.distributed`` (gloo, on CPU).

A gang's members run in the workflow's workdir (the test's folder, shared by every
agent of this host, as is the gangs' checkpoint folder in it). Only the first test
runs torch (its import takes seconds on this machine); the others run shell members.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone

# Each rank all-reduces (rank + 1) over the gang with gloo and writes what it got.
ALL_REDUCE = """
import json, os, pathlib
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "HM_GANG_ID",
         "HM_NODE")
out = pathlib.Path("out")
out.mkdir(exist_ok=True)
(out / f"rank{dist.get_rank()}.json").write_text(
    json.dumps({"sum": t.item(), "env": {k: os.environ[k] for k in names}}))
dist.destroy_process_group()
"""


def tasks(mesh: Mesh, wid: str) -> list[dict[str, Any]]:
    return mesh.hm_json("tasks", wid)  # type: ignore[no-any-return]


def test_a_two_node_gang_all_reduces_with_torch_distributed(mesh: Mesh) -> None:
    mesh.agent("node1", slots=1)
    mesh.agent("node2", slots=1)
    (mesh.root / "all_reduce.py").write_text(ALL_REDUCE)
    wid = mesh.submit(mesh.write_recipe(
        f"experiments:\n  train:\n    nodes: 2\n    command: ['{sys.executable} all_reduce.py']\n"))
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


# Rank 0 counts to 20 in its checkpoint, resuming from it; rank 1 runs until it is there.
COUNT = '''
f="$HM_CHECKPOINT_DIR/n"
echo "$HM_ATTEMPT $RANK $(cat "$f" 2>/dev/null || echo 0) $HM_NODE" >> starts.txt
if [ "$RANK" = 0 ]; then
  n=$(cat "$f" 2>/dev/null || echo 0)
  while [ "$n" -lt 20 ]; do n=$((n + 1)); echo $n > "$f.tmp"; mv "$f.tmp" "$f"; sleep 0.1; done
else
  while [ "$(cat "$f" 2>/dev/null || echo 0)" -lt 20 ]; do sleep 0.1; done
fi
'''


@pytest.mark.parametrize("victim_rank", [1, 0])
def test_a_lost_member_restarts_the_gang_from_its_checkpoint(
    mesh: Mesh, victim_rank: int
) -> None:
    """Rank 1 lost: rank 0 stops and records the attempt node-lost. Rank 0 lost (with
    the claim): rank 1 stops, and the next start closes the attempt node-lost."""
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=1)
    (mesh.root / "count.sh").write_text(COUNT)
    wid = mesh.submit(mesh.write_recipe(
        "experiments:\n  count:\n    nodes: 2\n    command: ['bash count.sh']\n"))
    counter = mesh.root / ".hm-checkpoints" / f"{wid}.count.0" / "n"
    starts = mesh.root / "starts.txt"
    wait_for(lambda: counter.exists() and int(counter.read_text() or 0) >= 5
             and len(starts.read_text().splitlines()) == 2, 30, "rank 0 to count to 5")
    rows = [line.split() for line in starts.read_text().splitlines()]
    first = {row[1]: row[3] for row in rows}  # rank -> node of attempt 1
    (task,) = tasks(mesh, wid)
    assert task["node"] == first["0"]  # rank 0 holds the claim
    victim = first[str(victim_rank)]
    mesh.agents[victim].crash()
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    (task,) = tasks(mesh, wid)
    assert [(a["attempt"], a["state"], a["reason"], a["node"]) for a in task["attempts"]] == [
        (1, "failed", "node-lost", first["0"]), (2, "succeeded", "exit", task["node"])]
    rows = [line.split() for line in starts.read_text().splitlines()]
    second = {row[1]: row for row in rows if row[0] == "2"}
    assert int(second["0"][2]) >= 5  # the new attempt resumed from the checkpoint
    assert victim not in {second["0"][3], second["1"][3]}
    assert second["0"][3] != second["1"][3]
    assert int(counter.read_text()) == 20


def test_cancelling_a_running_gang_stops_every_member(mesh: Mesh) -> None:
    for name in ("node1", "node2"):
        mesh.agent(name, slots=1, extra=("--telemetry-period", "0.3"))
    wid = mesh.submit(mesh.write_recipe(
        "experiments:\n  long:\n    nodes: 2\n    command: ['echo $$ > pid-$RANK; sleep 60']\n"))
    pids = [mesh.root / f"pid-{rank}" for rank in (0, 1)]
    wait_for(lambda: all(p.exists() and p.read_text().strip() for p in pids), 30,
             "both members to run")

    def both_in_top() -> bool:  # each member's processes, on its own node
        rows = mesh.hm_json("top")
        return len(rows) == 2 and all(
            row["telemetry"]
            and any(t["task_id"] == f"{wid}.long.0" for t in row["telemetry"]["tasks"])
            for row in rows
        )

    wait_for(both_in_top, 15, "both members in `hypermesh top`", interval=0.3)
    mesh.hm("cancel", wid, check=True)
    assert mesh.wait_state(wid, {"cancelled"}, timeout=30)["state"] == "cancelled"
    members = [int(p.read_text()) for p in pids]
    wait_for(lambda: all(process_gone(pid) for pid in members), 15, "both members to end")
    def recorded() -> Any:
        (task,) = tasks(mesh, wid)
        return task if task["attempts"][0]["state"] != "running" else None

    task: Any = wait_for(recorded, 15, "rank 0 to record the attempt")
    assert [(a["state"], a["reason"]) for a in task["attempts"]] == [("cancelled", "cancelled")]


SPAN = 'echo "$HM_NODE $HM_TASK_ID [$CUDA_VISIBLE_DEVICES] $(date +%s.%N) {what}" >> spans.txt'


def test_members_book_their_gpus_like_ordinary_tasks(mesh: Mesh) -> None:
    for name in ("node1", "node2"):
        mesh.agent(name, slots=4, extra=("--gpus", "2", "--gpu-type", "Tesla T4"))
    start, end = SPAN.format(what="start"), SPAN.format(what="end")
    wid = mesh.submit(mesh.write_recipe(f"""
experiments:
  solo:
    samples: 4
    hardware: {{gpus: 1}}
    command: ['{start}; sleep 1; {end}']
  pair:
    nodes: 2
    hardware: {{gpus: 2}}
    command: ['{start}; sleep 1; {end}']
"""))
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    spans: dict[tuple[str, str], list[Any]] = {}
    for line in (mesh.root / "spans.txt").read_text().splitlines():
        node, task, devices, at, what = line.split()
        spans.setdefault((node, task), [devices, 0.0, 0.0])[1 if what == "start" else 2] = (
            float(at))
    pair = {node: span for (node, task), span in spans.items() if ".pair." in task}
    assert sorted(pair) == ["node1", "node2"] and all(s[0] == "[0,1]" for s in pair.values())
    for (node, task), (devices, begin, finish) in spans.items():
        if ".solo." in task:  # never beside the gang member that holds both GPUs
            assert devices in ("[0]", "[1]")
            assert finish <= pair[node][1] or begin >= pair[node][2]
