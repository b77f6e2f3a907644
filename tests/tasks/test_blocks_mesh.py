"""Batched experiments on real agents and a real etcd: tasks claimed block by block and
recorded in fenced batches keep every per-task guarantee (hypermesh/state/blocks.py). The death
of a block's holder and a spot notice are tested beside the per-task case in test_mesh.py.

Each test forces blocks with the recipe's ``batch``; deaths are SIGKILL of an agent and
of every process it started, pauses SIGSTOP past the lease."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import pytest

from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.processes import wait_for
from hypermesh.state.blocks import Batch
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh, process_gone, task_pid
from tests.mesh.test_mesh import successes

# Every test with both kinds of node: one that watches the blocks and chooses one itself,
# and one that claims the blocks the leader offers it (``--watch own``).
WATCH = pytest.mark.parametrize("watch", ["all", "own"])


def keys_of(mesh: Mesh, kind: str, wid: str) -> list[str]:
    async def read() -> list[str]:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            kvs, _ = await etcd.get_prefix(Keyspace(mesh.namespace).kind_prefix(kind, wid))
        return sorted(kv.key.decode() for kv in kvs)

    return asyncio.run(read())


def run_to_success(mesh: Mesh, recipe_text: str) -> tuple[str, list[dict[str, Any]]]:
    """Submit ``recipe_text``, wait for its workflow to succeed: its id and tasks."""
    wid = mesh.submit(mesh.write_recipe(recipe_text))
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded", status
    return wid, mesh.hm_json("tasks", wid)


def assert_written_in_blocks(mesh: Mesh, wid: str, blocks: int) -> None:
    """``wid`` was written as ``blocks`` blocks and no per-task key, and every block's
    claim was given back."""
    assert len(keys_of(mesh, "block", wid)) == blocks
    assert keys_of(mesh, "task", wid) == [] and keys_of(mesh, "claim", wid) == []
    wait_for(lambda: keys_of(mesh, "bclaim", wid) == [], 15, "every block to be given back")


@WATCH
def test_a_batched_experiment_runs_every_task_once_in_blocks(mesh: Mesh, watch: str) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=2, extra=("--watch", watch))
    wid, tasks = run_to_success(mesh, """
experiments:
  sweep:
    parameters: {x: {values: [a, 'b c', '$(touch /tmp/hm-pwned)']}}
    samples: 30
    batch: 4
    command: ['test "$HM_PARAM_X" = {{x}} && echo {{task_index}} {{x}} > "$HM_ATTEMPT_DIR/out"']
  after:
    after: [sweep]
    samples: 5
    batch: 2
    command: ['true']
""")
    assert len(tasks) == 35
    assert all(t["state"] == "succeeded" and successes(t) == 1 for t in tasks), tasks
    assert all(len(t["attempts"]) == 1 and t["attempts"][0]["reason"] == "exit" for t in tasks)
    # The work spread over the agents, and parameters reached the tasks as data.
    assert len({t["node"] for t in tasks}) >= 2
    assert not os.path.exists("/tmp/hm-pwned")
    assert_written_in_blocks(mesh, wid, 8 + 3)


@WATCH
def test_a_small_experiment_on_a_large_mesh_runs_in_one_task_blocks(
    mesh: Mesh, watch: str
) -> None:
    """From 64 slots on, an experiment of fewer than 2 tasks per slot is written as
    one-task blocks rather than per-task keys (``block_size``): its keys reach only the
    holder and the leader, and each task still runs once, a failed one retried."""
    for name in ("node1", "node2"):
        mesh.agent(name, slots=32, extra=("--watch", watch))
    wid, listed = run_to_success(mesh, """
experiments:
  few:
    samples: 12
    retries: 1
    command: ['[ $((HM_TASK_INDEX % 3)) != 0 ] || [ "$HM_ATTEMPT" = 2 ]']
""")
    tasks = {t["index"]: t for t in listed}
    assert sorted(tasks) == list(range(12))
    assert all(successes(t) == 1 for t in tasks.values()), tasks
    for index, task in tasks.items():  # every third failed once, then passed on its retry
        want = ["failed", "succeeded"] if index % 3 == 0 else ["succeeded"]
        assert [a["state"] for a in task["attempts"]] == want, task
    assert_written_in_blocks(mesh, wid, 12)


@WATCH
def test_a_paused_holder_loses_its_block_and_its_late_results(mesh: Mesh, watch: str) -> None:
    paused = mesh.agent("node1", extra=("--watch", watch))
    recipe = mesh.write_recipe(
        """
experiments:
  one:
    samples: 2
    batch: 2
    command: ['if [ "$HM_NODE" = node1 ]; then echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 60; fi']
"""
    )
    wid = mesh.submit(recipe)
    pid = task_pid(paused, f"{wid}.one.0")
    # The start is recorded with the next flush: wait for it before the pause.
    wait_for(lambda: any(t["state"] == "running" for t in mesh.hm_json("tasks", wid)), 15,
             "the start to be recorded")
    assert paused.proc is not None
    os.kill(paused.proc.pid, signal.SIGSTOP)  # the node freezes past its 3 s lease
    try:
        mesh.agent("node2", extra=("--watch", watch))
        status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
        assert status["state"] == "succeeded"
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    wait_for(lambda: process_gone(pid), 15, "the orphaned process to be killed")
    wait_for(lambda: {n["name"] for n in mesh.hm_json("nodes")} == {"node1", "node2"}, 15, "rejoin")
    tasks = mesh.hm_json("tasks", wid)
    assert all(successes(t) == 1 for t in tasks)
    first = next(t for t in tasks if t["index"] == 0)
    assert [(a["node"], a["reason"]) for a in first["attempts"]] == [
        ("node1", "node-lost"),
        ("node2", "exit"),
    ]


@WATCH
def test_failed_tasks_retry_in_their_block_and_retry_reopens_them(mesh: Mesh, watch: str) -> None:
    mesh.agent("node1", slots=2, extra=("--watch", watch))
    marker = mesh.root / "fixed"
    recipe = mesh.write_recipe(
        f"""
experiments:
  flaky:
    samples: 6
    batch: 3
    retries: 1
    command: ['[ "$HM_TASK_INDEX" != 4 ] || [ -e {marker} ]']
"""
    )
    wid = mesh.submit(recipe)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "failed"
    tasks = {t["index"]: t for t in mesh.hm_json("tasks", wid)}
    assert [a["state"] for a in tasks[4]["attempts"]] == ["failed", "failed"]  # retried once
    assert all(tasks[i]["state"] == "succeeded" for i in (0, 1, 2, 3, 5))
    marker.touch()
    done = mesh.hm("retry", wid)
    assert done.returncode == 0, done.stderr
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded"
    (task,) = [t for t in mesh.hm_json("tasks", wid) if t["index"] == 4]
    assert [a["state"] for a in task["attempts"]] == ["failed", "failed", "succeeded"]


@WATCH
def test_cancel_stops_a_held_block(mesh: Mesh, watch: str) -> None:
    agent = mesh.agent("node1", slots=2, extra=("--watch", watch))
    recipe = mesh.write_recipe(
        "experiments:\n  long:\n    samples: 8\n    batch: 4\n"
        "    command: ['echo $$ > \"$HM_ATTEMPT_DIR/pid\"; exec sleep 60']\n"
    )
    wid = mesh.submit(recipe)
    pid = task_pid(agent, f"{wid}.long.0")
    done = mesh.hm("cancel", wid)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: process_gone(pid), 15, "the cancelled task's process to end")
    wait_for(lambda: keys_of(mesh, "bclaim", wid) == [], 15, "the block to be given back")
    states = {t["state"] for t in mesh.hm_json("tasks", wid)}
    assert states == {"cancelled"}


def test_a_nodes_results_wait_members_over_flush_rate_seconds_to_share_a_write(
    mesh: Mesh,
) -> None:
    """``flush_window``: in a mesh of two with ``flush-rate=2``, a node writes its
    results at most once a second, so the result of a task that ends while the next of
    its block runs reaches etcd about a second after it ended (50 ms with the default
    rate, or if either the members or the rate were left out)."""
    for name in ("node1", "node2"):
        mesh.agent(name, slots=1)
    mesh.hm("settings", "flush-rate=2", check=True)
    recipe = mesh.write_recipe(
        "experiments:\n  two:\n    samples: 2\n    batch: 2\n"
        "    command: ['sleep $(( 4 * HM_TASK_INDEX ))']\n"
    )
    wid = mesh.submit(recipe)

    async def first_result() -> tuple[float, float]:
        """When this test first read task 0's result, and when the task ended."""
        prefix = Keyspace(mesh.namespace).kind_prefix("bdone", wid)
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            async with asyncio.timeout(30):
                while True:
                    kvs, _ = await etcd.get_prefix(prefix)
                    read_at = time.time()
                    for kv in kvs:
                        batch = Batch.from_json(json.loads(kv.value))
                        for r in batch.results:
                            if r.index == 0:
                                return read_at, r.ended_at
                    await asyncio.sleep(0.02)

    read_at, ended_at = asyncio.run(first_result())
    assert read_at - ended_at >= 0.7, (read_at, ended_at)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded", status
