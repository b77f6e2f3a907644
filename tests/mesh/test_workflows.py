"""End to end: real etcd, real agent processes, recipes submitted through the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import yaml

from hypermesh.local.etcd import EtcdServer
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh, process_gone, task_pid


def attempts_of(tasks: list[dict], experiment: str) -> list[dict]:
    return [a for t in tasks if t["experiment"] == experiment for a in t["attempts"]]


def peak(attempts: list[dict]) -> int:
    """The most of ``attempts`` that ran at one instant (a sweep over starts and ends)."""
    events = sorted([(a["started_at"], 1) for a in attempts]
                    + [(a["ended_at"], -1) for a in attempts])
    level = most = 0
    for _, delta in events:
        level += delta
        most = max(most, level)
    return most


def test_dag_runs_in_dependency_order(mesh: Mesh) -> None:
    mesh.agent(slots=3)
    recipe = mesh.write_recipe(
        """
name: dag
experiments:
  prep:
    parameters: {shard: {values: [a, b, c]}}
    command: ["echo prep {{shard}}"]
  train:
    after: [prep]
    parameters: {lr: {range: 0.1-0.3}}
    samples: 3
    command: ["echo train {{lr}}"]
  infer:
    after: [train]
    command: ["echo infer"]
"""
    )
    result = mesh.hm("submit", str(recipe), "--wait", timeout=90)
    assert result.returncode == 0, result.stderr
    wid = result.stdout.split()[-1]
    status = mesh.hm_json("status", wid)
    assert status["state"] == "succeeded"
    assert {n: e["succeeded"] for n, e in status["experiments"].items()} == {
        "prep": 3,
        "train": 3,
        "infer": 1,
    }
    tasks = mesh.hm_json("tasks", wid)
    prep, train, infer = (attempts_of(tasks, e) for e in ("prep", "train", "infer"))
    assert max(a["ended_at"] for a in prep) <= min(a["started_at"] for a in train)
    assert max(a["ended_at"] for a in train) <= min(a["started_at"] for a in infer)
    assert sorted(t["params"]["shard"] for t in tasks if t["experiment"] == "prep") == [
        "a",
        "b",
        "c",
    ]
    assert all(0.1 <= t["params"]["lr"] <= 0.3 for t in tasks if t["experiment"] == "train")
    # No pool declared: no prices and no node-seconds recorded, and the table says so
    # rather than showing a cost of 0.
    assert status["cost"]["pools"] == {}
    assert "cost: none recorded" in mesh.hm("status", wid, check=True).stdout


def test_task_environment_and_logs(mesh: Mesh) -> None:
    mesh.agent()
    recipe = mesh.write_recipe(
        """
experiments:
  show:
    parameters: {lr: {values: [0.5]}}
    env: {GREETING: hi}
    command:
      - echo "$GREETING $HM_WORKFLOW_ID $HM_EXPERIMENT $HM_TASK_ID"
      - echo "$HM_TASK_INDEX $HM_ATTEMPT $HM_PARAM_LR"
      - echo to-stderr >&2
"""
    )
    wid = mesh.submit(recipe, "--wait")
    out = mesh.hm("logs", f"{wid}.show.0", check=True).stdout
    assert f"hi {wid} show {wid}.show.0\n" in out
    assert "0 1 0.5\n" in out
    assert "to-stderr" in out


def test_workers_caps_concurrency(mesh: Mesh) -> None:
    mesh.agent("node1", slots=4)
    mesh.agent("node2", slots=4)
    recipe = mesh.write_recipe(
        """
experiments:
  capped:
    samples: 8
    workers: 2
    command: ["sleep 0.6"]
"""
    )
    result = mesh.hm("submit", str(recipe), "--wait", timeout=120)
    assert result.returncode == 0, result.stderr
    tasks = mesh.hm_json("tasks", result.stdout.split()[-1])
    attempts = attempts_of(tasks, "capped")
    assert len(attempts) == 8
    # the cap is reached and never exceeded, with 8 free slots in the mesh
    assert peak(attempts) == 2


def test_failing_task_retries_then_fails_workflow(mesh: Mesh) -> None:
    mesh.agent()
    recipe = mesh.write_recipe(
        """
experiments:
  flaky:
    retries: 2
    command: ["echo attempt $HM_ATTEMPT", "exit 3"]
  after_flaky:
    after: [flaky]
    command: ["echo never"]
"""
    )
    result = mesh.hm("submit", str(recipe), "--wait", timeout=90)
    assert result.returncode == 1
    wid = result.stdout.split()[-1]
    status = mesh.hm_json("status", wid)
    assert status["state"] == "failed"
    assert status["experiments"]["flaky"]["state"] == "failed"
    assert status["experiments"]["after_flaky"]["state"] == "cancelled"
    dependent, task = mesh.hm_json("tasks", wid)  # in id order; the dependent never ran
    assert (dependent["id"], dependent["state"], dependent["attempts"]) == (
        f"{wid}.after_flaky.0", "cancelled", [])
    assert task["state"] == "failed"
    assert [(a["attempt"], a["state"], a["exit_code"], a["reason"]) for a in task["attempts"]] == [
        (1, "failed", 3, "exit"),
        (2, "failed", 3, "exit"),
        (3, "failed", 3, "exit"),
    ]


def test_timeout_kills_task(mesh: Mesh) -> None:
    mesh.agent()
    recipe = mesh.write_recipe(
        """
experiments:
  slow:
    timeout: 1s
    command: ["sleep 30"]
"""
    )
    started = time.monotonic()
    result = mesh.hm("submit", str(recipe), "--wait", timeout=60)
    assert result.returncode == 1
    assert time.monotonic() - started < 25
    (task,) = mesh.hm_json("tasks", result.stdout.split()[-1])
    assert task["attempts"][0]["reason"] == "timeout"


def test_cancel_stops_running_tasks(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe(
        """
experiments:
  long:
    samples: 4
    command: ['echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 120']
"""
    )
    wid = mesh.submit(recipe)

    def two_running() -> list[dict] | None:
        tasks = mesh.hm_json("tasks", wid)
        running = [t for t in tasks if t["state"] == "running"]
        return running if len(running) == 2 else None

    running = wait_for(two_running, 30, "two running tasks", interval=0.2)
    pids = [task_pid(mesh.agents["node1"], t["id"]) for t in running]  # type: ignore[union-attr]
    assert not any(process_gone(pid) for pid in pids)

    result = mesh.hm("cancel", wid, check=True)
    assert "cancelled" in result.stderr
    status = mesh.wait_state(wid, {"cancelled"})
    assert status["experiments"]["long"]["cancelled"] == 4

    def all_stopped() -> bool:
        tasks = mesh.hm_json("tasks", wid)
        return all(t["state"] == "cancelled" for t in tasks) and all(
            process_gone(pid) for pid in pids
        )

    wait_for(all_stopped, 20, "cancelled tasks to stop")
    tasks = mesh.hm_json("tasks", wid)
    ran = [a for t in tasks for a in t["attempts"]]
    assert len(ran) == 2  # the two pending tasks never started
    assert all((a["state"], a["reason"]) == ("cancelled", "cancelled") for a in ran)
    # Cancelling again reports the workflow already ended.
    assert "already ended" in mesh.hm("cancel", wid, check=True).stderr


def test_parameter_value_is_data_not_shell(mesh: Mesh, tmp_path: Path) -> None:
    mesh.agent()
    marker = tmp_path / "pwned"
    values = [
        f"1; touch {marker}",
        f"$(touch {marker})",
        f"`touch {marker}`",
        "a b  c",
        'it\'s "q"',
    ]
    recipe = mesh.write_recipe(
        yaml.safe_dump(
            {
                "experiments": {
                    "inject": {
                        "parameters": {"v": {"values": values}},
                        "command": ["printf '%s|' {{v}} > \"$HM_ATTEMPT_DIR/argv\""],
                    }
                }
            }
        )
    )
    result = mesh.hm("submit", str(recipe), "--wait", timeout=60)
    assert result.returncode == 0, result.stderr
    wid = result.stdout.split()[-1]
    work = mesh.agents["node1"].work_dir
    seen = sorted(
        (work / "attempts" / wid / f"inject.{i}.1" / "argv").read_text()
        for i in range(len(values))
    )
    assert seen == sorted(f"{v}|" for v in values)  # each value arrived as exactly one argument
    assert not marker.exists()


def test_invalid_recipe_submits_nothing(mesh: Mesh) -> None:
    recipe = mesh.write_recipe(
        """
experiments:
  a:
    command: ["echo {{nope}}"]
    wokers: 3
  b:
    after: [missing]
    command: ["true"]
"""
    )
    result = mesh.hm("submit", str(recipe))
    assert result.returncode == 2
    assert result.stdout == ""
    err = result.stderr
    assert "recipe.yaml:4" in err and "nope" in err
    assert "recipe.yaml:5" in err and "wokers" in err and "workers" in err
    assert "recipe.yaml:7" in err and "missing" in err
    assert mesh.hm_json("status") == []


def test_nodes_lists_agents_and_leader(mesh: Mesh) -> None:
    mesh.agent(
        "node1",
        slots=3,
        extra=("--pool", "onprem", "--gpus", "2", "--gpu-type", "k80", "--label", "rack=r1"),
    )
    mesh.agent("node2", extra=("--spot",))
    nodes = mesh.hm_json("nodes")
    by_name = {n["name"]: n for n in nodes}
    assert set(by_name) == {"node1", "node2"}
    for n in nodes:
        assert {
            "name",
            "address",
            "state",
            "pool",
            "spot",
            "slots",
            "running",
            "gpus",
            "leader",
        } <= set(n)
    assert by_name["node1"]["pool"] == "onprem" and by_name["node1"]["gpus"] == 2
    assert by_name["node1"]["slots"] == 3 and by_name["node2"]["spot"] is True
    assert by_name["node1"]["address"] == mesh.agents["node1"].address
    assert [n["name"] for n in nodes if n["leader"]] == ["node1"]  # the first to register leads


def test_gpu_requirements_route_tasks(mesh: Mesh) -> None:
    mesh.agent("cpu1")
    mesh.agent("gpu1", extra=("--gpus", "1", "--gpu-type", "Tesla K80"))
    recipe = mesh.write_recipe(
        """
experiments:
  needs_gpu:
    samples: 2
    hardware: {gpu: k80, gpus: 1}
    command: ["true"]
"""
    )
    result = mesh.hm("submit", str(recipe), "--wait", timeout=60)
    assert result.returncode == 0, result.stderr
    tasks = mesh.hm_json("tasks", result.stdout.split()[-1])
    assert {t["node"] for t in tasks} == {"gpu1"}


def test_sigterm_drains_and_work_moves_to_another_node(mesh: Mesh) -> None:
    first = mesh.agent("node1")
    recipe = mesh.write_recipe(
        """
experiments:
  resumable:
    command: ['if [ "$HM_ATTEMPT" = 1 ]; then exec sleep 120; fi; echo done on $HM_NODE']
"""
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: [t["state"] for t in mesh.hm_json("tasks", wid)] == ["running"], 30,
             "task to run")
    assert first.proc is not None
    first.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert first.terminate(timeout=30) == 0
    assert time.monotonic() - started < 15  # grace (2 s in the local preset) plus clean-up
    (task,) = mesh.hm_json("tasks", wid)
    assert task["state"] == "pending"  # claim released; nothing lost
    assert [(a["state"], a["reason"]) for a in task["attempts"]] == [("failed", "preempted")]
    assert mesh.hm_json("nodes") == []  # drained node deregistered

    mesh.agent("node2")
    status = mesh.wait_state(wid, {"succeeded", "failed"})
    assert status["state"] == "succeeded"
    (task,) = mesh.hm_json("tasks", wid)
    assert [a["node"] for a in task["attempts"]] == ["node1", "node2"]


def test_killed_agent_task_reruns_as_node_lost(mesh: Mesh) -> None:
    first = mesh.agent("node1")
    recipe = mesh.write_recipe(
        """
experiments:
  survive:
    retries: 0
    command: ['if [ "$HM_NODE" = node1 ]; then echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 120; fi']
"""
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: [t["state"] for t in mesh.hm_json("tasks", wid)] == ["running"], 30,
             "task to run")
    pid = task_pid(first, f"{wid}.survive.0")
    first.kill()  # the machine died: no drain, no lease revoke
    with contextlib.suppress(ProcessLookupError):  # its lifeline may have been first
        os.kill(pid, signal.SIGKILL)  # and its processes with it
    mesh.agent("node2")
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded"  # a node loss does not count against retries: 0
    (task,) = mesh.hm_json("tasks", wid)
    assert [(a["node"], a["state"], a["reason"]) for a in task["attempts"]] == [
        ("node1", "failed", "node-lost"),
        ("node2", "succeeded", "exit"),
    ]


def test_agent_carries_on_after_etcd_restart(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd", fsync=False).start()
    m = Mesh(server, tmp_path)
    try:
        m.agent("node1")
        recipe = m.write_recipe("experiments:\n  one:\n    command: ['echo one']\n")
        m.submit(recipe, "--wait")
        server.stop()
        server.start()
        result = m.hm("submit", str(recipe), "--wait", timeout=90)
        assert result.returncode == 0, result.stderr + m.logs()
        assert m.agents["node1"].alive
    finally:
        m.close()
        server.stop()


def test_logs_follow_streams_until_the_attempt_ends(mesh: Mesh) -> None:
    mesh.agent()
    recipe = mesh.write_recipe(
        """
experiments:
  chatty:
    command: ['for i in 1 2 3 4 5; do echo line $i; sleep 0.3; done']
"""
    )
    wid = mesh.submit(recipe)
    task = f"{wid}.chatty.0"
    wait_for(lambda: any(t["attempts"] for t in mesh.hm_json("tasks", wid)), 30,
             "the task to start")
    result = mesh.hm("logs", task, "--follow", timeout=60, check=True)
    assert [f"line {i}" for i in range(1, 6)] == [
        ln for ln in result.stdout.splitlines() if ln.startswith("line")
    ]
    assert mesh.hm_json("tasks", wid)[0]["state"] == "succeeded"


def test_unknown_objects_are_clear_errors(mesh: Mesh) -> None:
    for args in (("status", "nope-123456"), ("tasks", "nope-123456"), ("cancel", "nope-123456")):
        result = mesh.hm(*args)
        assert result.returncode == 1
        assert "no workflow 'nope-123456'" in result.stderr
    result = mesh.hm("logs", "nope-123456.exp.0")
    assert result.returncode == 1 and "no workflow 'nope-123456'" in result.stderr
    result = mesh.hm("logs", "not-a-task-id")
    assert result.returncode == 2 and "WORKFLOW.EXPERIMENT.INDEX" in result.stderr
    result = mesh.hm("submit", str(mesh.root / "missing.yaml"))
    assert result.returncode == 2 and "missing.yaml" in result.stderr


def test_set_overrides_recipe_fields(mesh: Mesh) -> None:
    mesh.agent(slots=4)
    recipe = mesh.write_recipe(
        """
experiments:
  sweep:
    parameters: {lr: {range: 0.1-0.3}}
    samples: 100
    command: ["echo {{lr}}"]
"""
    )
    result = mesh.hm(
        "submit",
        str(recipe),
        "--set",
        "sweep.samples=3",
        "--set",
        "sweep.parameters.lr.range=[5, 6]",
        "--seed",
        "7",
        "--wait",
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    tasks = mesh.hm_json("tasks", result.stdout.split()[-1])
    assert len(tasks) == 3 and all(5 <= t["params"]["lr"] <= 6 for t in tasks)
    bad = mesh.hm("submit", str(recipe), "--set", "nosuch.samples=3")
    assert bad.returncode == 2 and "nosuch" in bad.stderr


def test_lost_lease_stops_tasks_and_rejoins(mesh: Mesh) -> None:
    agent = mesh.agent()
    recipe = mesh.write_recipe(
        """
experiments:
  fenced:
    command: ['if [ "$HM_ATTEMPT" = 1 ]; then echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 120; fi']
"""
    )
    wid = mesh.submit(recipe)
    pid = task_pid(agent, f"{wid}.fenced.0")

    async def revoke() -> None:
        async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
            found = await etcd.get(Keyspace(mesh.namespace).node("node1"))
            assert found is not None
            await etcd.revoke(json.loads(found[0])["lease"])

    asyncio.run(revoke())  # what the leader does to a node it believes dead
    status = mesh.wait_state(wid, {"succeeded", "failed"})
    assert status["state"] == "succeeded"
    assert process_gone(pid)
    (task,) = mesh.hm_json("tasks", wid)
    assert [(a["attempt"], a["state"], a["reason"]) for a in task["attempts"]] == [
        (1, "failed", "node-lost"),
        (2, "succeeded", "exit"),
    ]
    assert [n["name"] for n in mesh.hm_json("nodes")] == ["node1"]  # re-registered
