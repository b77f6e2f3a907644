"""Gossip between real agents: agreement on a death, no false death on a short stall,
and a node declared dead cannot record results afterwards."""

from __future__ import annotations

import os
import signal
import time

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone, task_pid


def gossip_state(mesh: Mesh, via: str, member: str) -> str | None:
    rows = mesh.hm_json("nodes", "--all", "--via", via)
    return next((r["gossip"] for r in rows if r["name"] == member), None)


def test_nodes_show_gossip_state_and_load(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=3)

    def everyone_alive() -> list[dict] | None:
        rows = mesh.hm_json("nodes")
        ok = len(rows) == 3 and all(r["gossip"] == "alive" for r in rows)
        return rows if ok else None

    rows = wait_for(everyone_alive, 20, "all three alive in gossip")
    for r in rows:  # type: ignore[union-attr]
        assert r["incarnation"] is not None and r["seen_by"] == "node1"
        assert r["load"]["slots"] == 3 and r["load"]["free_slots"] == 3
        assert r["cached_bytes"] == 0


def test_sigkill_the_others_agree_it_is_dead(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3", "node4"):
        mesh.agent(name)
    wait_for(
        lambda: all(gossip_state(mesh, v, "node4") == "alive" for v in ("node1", "node2")),
        20,
        "node4 alive in gossip",
    )
    mesh.agents["node4"].crash()
    for via in ("node1", "node2", "node3"):
        wait_for(lambda v=via: gossip_state(mesh, v, "node4") == "dead", 15, f"{via} to agree")
    # The verdict became a lease revocation: node4 is gone from the registry.
    assert "node4" not in {r["name"] for r in mesh.hm_json("nodes")}


def test_a_short_stall_is_not_a_death(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name)
    stalled = mesh.agents["node3"]
    wait_for(lambda: gossip_state(mesh, "node1", "node3") == "alive", 20, "node3 alive")
    recipe = mesh.write_recipe(
        "experiments:\n  steady:\n    samples: 6\n    command: ['sleep 3']\n"
    )
    wid = mesh.submit(recipe)
    wait_for(
        lambda: sum(t["state"] == "running" for t in mesh.hm_json("tasks", wid)) == 6,
        30,
        "all tasks running",
    )
    assert stalled.proc is not None
    os.kill(stalled.proc.pid, signal.SIGSTOP)
    time.sleep(0.6)  # shorter than the lan suspicion timeout (at least 1 s)
    os.kill(stalled.proc.pid, signal.SIGCONT)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded"
    tasks = mesh.hm_json("tasks", wid)
    assert all(len(t["attempts"]) == 1 for t in tasks)  # nothing re-ran
    for agent in mesh.agents.values():
        assert "node3 is dead" not in agent.log_tail(50000)
    assert gossip_state(mesh, "node1", "node3") == "alive"


def test_a_node_declared_dead_cannot_record_results(mesh: Mesh) -> None:
    mesh.agent("node1")
    mesh.agent("node2")
    # A long lease: only gossip can get node3 declared dead within the test.
    cut_off = mesh.agent("node3", extra=("--lease-ttl", "120", "--gpus", "1"))
    recipe = mesh.write_recipe(
        """
experiments:
  one:
    hardware: {gpus: 1}
    command: ['echo $$ > "$HM_ATTEMPT_DIR/pid"; if [ "$HM_NODE" = node3 ]; then sleep 8; fi']
"""
    )
    wid = mesh.submit(recipe)
    pid = task_pid(cut_off, f"{wid}.one.0")
    assert cut_off.proc is not None
    os.kill(cut_off.proc.pid, signal.SIGSTOP)  # silent, as if cut off from the network
    try:
        wait_for(lambda: gossip_state(mesh, "node1", "node3") == "dead", 20, "node3 declared dead")
        mesh.agent("node4", extra=("--gpus", "1"))
        status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=40)
        assert status["state"] == "succeeded"
    finally:
        os.kill(cut_off.proc.pid, signal.SIGCONT)
    wait_for(lambda: "result rejected" in cut_off.log_tail(50000), 20, "node3's result rejected")
    wait_for(
        lambda: process_gone(pid),
        15,
        "node3's orphaned task to be killed",
    )
    (task,) = mesh.hm_json("tasks", wid)
    assert [(a["node"], a["state"], a["reason"]) for a in task["attempts"]] == [
        ("node3", "failed", "node-lost"),
        ("node4", "succeeded", "exit"),
    ]
    # node3 comes back: a new lease, and gossip takes it back as alive.
    wait_for(lambda: gossip_state(mesh, "node1", "node3") == "alive", 30, "node3 to rejoin")
