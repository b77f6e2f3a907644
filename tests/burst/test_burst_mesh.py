"""Bursting end to end with the local provisioner: real etcd, real agents.

A static pool of one agent (1 slot) and a burst pool (``local``, spot, max 3,
short idle timeout). The agents run the ``local`` preset, whose burst timings
are seconds (tick 0.5 s, wait threshold 1 s, drain target 2 s)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import pytest

from hypermesh.local.agents import hypermesh_command, mesh_agents, stop_all
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for
from hypermesh.tls import certificate_name
from tests.conftest import Mesh

SWEEP = """\
experiments:
  sweep:
    parameters:
      i: {{values: [{values}]}}
    command: sleep {seconds}
"""


def burst_processes(mesh: Mesh) -> list[psutil.Process]:
    """Agents of the burst pool (started by the leader, not by the test)."""
    return [p for p in mesh_agents(mesh.etcd.url, mesh.namespace)
            if ("--pool", "burst") in set(itertools.pairwise(p.info["cmdline"]))]


@pytest.fixture
def burst_mesh(mesh: Mesh) -> Iterator[Mesh]:
    mesh.hm("pool", "set", "onprem", "--price", "0.5", check=True)
    mesh.hm("pool", "set", "burst", "--kind", "local", "--price", "1", "--spot-price", "0.25",
            "--spot", "--max", "3", "--idle-timeout", "2s", check=True)
    mesh.agent("node1", slots=1, extra=("--pool", "onprem"))
    try:
        yield mesh
    finally:
        stop_all(burst_processes(mesh), timeout=15)


def burst_nodes(mesh: Mesh) -> list[str]:
    return [n["name"] for n in mesh.hm_json("nodes") if n["pool"] == "burst"]


def events(mesh: Mesh) -> list[dict[str, Any]]:
    out = mesh.hm("events", "--json", check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def pool_row(mesh: Mesh, name: str) -> dict[str, Any]:
    return next(r for r in mesh.hm_json("pool", "ls") if r["name"] == name)


def test_backlog_bursts_then_idle_burst_nodes_leave(burst_mesh: Mesh) -> None:
    mesh = burst_mesh
    wid = mesh.submit(mesh.write_recipe(SWEEP.format(values="0, 1, 2, 3, 4, 5, 6, 7",
                                                     seconds=2)))
    seen: set[str] = set()
    most = 0

    def bursting() -> bool:
        nonlocal most
        row = pool_row(mesh, "burst")
        most = max(most, len(row["nodes"]) + len(row["starting"]))
        seen.update(row["nodes"])
        return len(row["nodes"]) >= 2

    wait_for(bursting, 60, "burst nodes to register", interval=0.3)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded", mesh.logs()
    ran_on = {a["node"] for t in mesh.hm_json("tasks", wid) for a in t["attempts"]}
    assert ran_on & seen, f"no task ran on a burst node: {ran_on} vs {seen}"

    # Idle timeout 2 s: every burst node is released and gone, and its record too.
    def all_gone() -> bool:
        nonlocal most
        row = pool_row(mesh, "burst")
        most = max(most, len(row["nodes"]) + len(row["starting"]))
        return not row["nodes"] and not row["starting"] and not burst_processes(mesh)

    wait_for(all_gone, 60, "burst nodes to be released", interval=0.3)
    assert most <= 3
    log = events(mesh)
    launched = sum(e["count"] for e in log if e["action"] == "launch")
    released = {e["node"] for e in log if e["action"] == "release"}
    assert launched >= 2 and seen <= released
    assert all(e["spot"] for e in log if e["action"] == "launch")
    assert all(e["reason"].startswith("idle for") for e in log if e["action"] == "release")

    # Cost: spot burst nodes at 0.25/h instead of 1/h, static at 0.5/h either way.
    cost = mesh.hm_json("status", wid)["cost"]
    assert cost["node_seconds"] > 0
    assert 0 < cost["cost"] < cost["on_demand_cost"]
    assert cost["pools"]["burst"]["spot_s"] > 0
    (listed,) = mesh.hm_json("status")
    assert listed["id"] == wid and listed["cost"]["cost"] >= cost["cost"]
    plain = mesh.hm("status", wid, check=True).stdout
    assert f"node-s (on-demand: {cost['on_demand_cost']:.4f})" in plain, plain


def test_preempted_burst_node_is_replaced_while_work_remains(burst_mesh: Mesh) -> None:
    mesh = burst_mesh
    wid = mesh.submit(mesh.write_recipe(SWEEP.format(values=", ".join(map(str, range(10))),
                                                     seconds=4)))

    def a_burst_node_runs_a_task() -> str | None:
        for t in mesh.hm_json("tasks", wid):
            if t["state"] == "running" and t["node"] and t["node"].startswith("burst-"):
                return str(t["node"])
        return None

    victim = str(wait_for(a_burst_node_runs_a_task, 60, "a task on a burst node", interval=0.3))
    (proc,) = [p for p in burst_processes(mesh)
               if ("--name", victim) in set(itertools.pairwise(p.cmdline()))]
    killed_at = time.time()
    proc.send_signal(signal.SIGKILL)  # a preemption: no drain, no goodbye

    def replaced() -> bool:
        # Forgotten, and a node launched since the kill: the launch may come a tick
        # before the forget (the lost task is pending again as soon as gossip has the
        # node's lease revoked, before the leader sees the node gone from etcd).
        log = events(mesh)
        forgot = any(e["action"] == "forget" and e["node"] == victim for e in log)
        return forgot and any(e["action"] == "launch" and e["at"] >= killed_at for e in log)

    wait_for(replaced, 30, f"preempted {victim} to be forgotten and replaced", interval=0.3)
    assert mesh.hm_json("status", wid)["state"] != "succeeded"  # work remained
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded", mesh.logs()
    lost = [a for t in mesh.hm_json("tasks", wid) for a in t["attempts"]
            if a["node"] == victim and a["reason"] == "node-lost"]
    assert lost, "the preempted node's task should have run again elsewhere"


def test_nothing_starts_without_a_backlog_that_may_burst(burst_mesh: Mesh) -> None:
    mesh = burst_mesh
    # Work restricted to the static pool never bursts, however long it queues.
    recipe = SWEEP.format(values="0, 1, 2", seconds=1.5) + "    pools: [onprem]\n"
    wid = mesh.submit(mesh.write_recipe(recipe))
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    # Then an idle mesh: the leader keeps ticking (the static node's seconds keep
    # being counted) and starts nothing.
    start = pool_row(mesh, "onprem")["node_seconds"]
    wait_for(lambda: pool_row(mesh, "onprem")["node_seconds"] >= start + 3, 30,
             "the leader to account 3 more node-seconds", interval=0.3)
    assert burst_nodes(mesh) == []
    assert pool_row(mesh, "burst")["starting"] == []
    assert [e for e in events(mesh) if e["action"] == "launch"] == []
    assert not burst_processes(mesh)


def cli_of(env: dict[str, str]) -> Callable[..., str]:
    """The CLI as a user of the mesh whose environment is ``env`` runs it: its stdout."""

    def hm(*args: str) -> str:
        return subprocess.run([*hypermesh_command(), *args], env=env, check=True,
                              capture_output=True, text=True, timeout=60).stdout

    return hm


def test_local_mesh_stops_the_agents_its_leader_started(tmp_path: Path) -> None:
    mesh = LocalMesh(tmp_path, agents=1, slots=1, namespace="burstclose", fsync=False)
    mesh.start()
    try:
        hm = cli_of(dict(os.environ, **mesh.env()))

        hm("pool", "set", "burst", "--kind", "local", "--max", "1", "--idle-timeout", "10m")
        recipe = tmp_path / "r.yaml"
        recipe.write_text(SWEEP.format(values="0, 1, 2, 3", seconds=3))
        hm("submit", str(recipe))
        wait_for(lambda: [n for n in json.loads(hm("nodes", "--json")) if n["pool"] == "burst"],
                 60, "a burst node", interval=0.3)
    finally:
        mesh.close()
    assert mesh_agents(mesh.etcd.url, "burstclose") == []


def test_burst_nodes_of_a_tls_mesh_join_with_certificates_of_their_own(tmp_path: Path) -> None:
    """A mesh on mutual TLS: a pool with no CA starts nothing and says why; given the
    mesh CA's directory, its node gets a certificate for its name and gossips."""
    mesh = LocalMesh(tmp_path, agents=1, slots=1, namespace="bursttls", fsync=False, tls=True)
    mesh.start()
    try:
        hm = cli_of(dict(os.environ, **mesh.env()))

        def burst_rows() -> list[dict[str, Any]]:
            rows = json.loads(hm("nodes", "--json", "--via", "node1"))
            return [n for n in rows if n["pool"] == "burst"]

        pool = ("pool", "set", "burst", "--kind", "local", "--max", "1", "--idle-timeout", "10m")
        hm(*pool)
        recipe = tmp_path / "r.yaml"
        recipe.write_text(SWEEP.format(values="0, 1, 2, 3", seconds=2))
        hm("submit", str(recipe))

        def refusal() -> list[str]:
            out = hm("events", "--json").splitlines()
            return [e["reason"] for e in map(json.loads, out) if e["action"] == "failed"]

        (reason, *_) = wait_for(refusal, 60, "the launch to be refused", interval=0.3)
        assert "pool burst: the mesh uses TLS and the pool names no CA" in reason
        assert not burst_rows()
        hm(*pool, "--option", f"ca_dir={tmp_path / 'tls'}")
        (row,) = wait_for(lambda: [r for r in burst_rows() if r["gossip"] == "alive"], 60,
                          "the burst node to join gossip", interval=0.3)
        name = row["name"]
        pem = (tmp_path / "node1" / "burst" / name / f"{name}.pem").read_bytes()
        assert certificate_name(pem) == name
    finally:
        mesh.close()
    assert mesh_agents(mesh.etcd.url, "bursttls") == []


def test_high_preemption_rate_makes_the_next_launch_on_demand(burst_mesh: Mesh) -> None:
    """Local preset: more than half of the pool's spot nodes of the last 60 s
    preempted makes its next node on-demand; the launch event says why."""
    mesh = burst_mesh
    mesh.hm("pool", "set", "burst", "--kind", "local", "--price", "1", "--spot-price", "0.25",
            "--spot", "--max", "2", "--idle-timeout", "60s", check=True)
    wid = mesh.submit(mesh.write_recipe(SWEEP.format(values=", ".join(map(str, range(12))),
                                                     seconds=4)))

    def burst_runners() -> list[str] | None:
        nodes = {str(t["node"]) for t in mesh.hm_json("tasks", wid)
                 if t["state"] == "running" and str(t["node"]).startswith("burst-")}
        return sorted(nodes) if len(nodes) == 2 else None

    runners = wait_for(burst_runners, 60, "two spot burst nodes running tasks", interval=0.3)
    first, second = cast(list[str], runners)

    def preempt(victim: str) -> dict[str, Any]:
        """SIGKILL ``victim``; the launch that replaces it, once it is forgotten."""
        (proc,) = [p for p in burst_processes(mesh)
                   if ("--name", victim) in set(itertools.pairwise(p.cmdline()))]
        proc.send_signal(signal.SIGKILL)

        def replacement() -> dict[str, Any] | None:
            log = events(mesh)
            forgot = [i for i, e in enumerate(log)
                      if e["action"] == "forget" and e["node"] == victim]
            later = [e for e in log[forgot[0]:] if e["action"] == "launch"] if forgot else []
            return later[0] if later else None

        found = wait_for(replacement, 30, f"{victim} to be forgotten and replaced",
                         interval=0.3)
        return cast(dict[str, Any], found)

    # One of two spot nodes preempted: a rate of 0.5 is not above 0.5, still spot.
    launch = preempt(first)
    assert launch["spot"] is True, launch
    assert launch["reason"].startswith("replace preempted node"), launch
    assert "; spot: preemption rate 0.50 (1 of 2 spot nodes in the last 60s) is at most 0.50" \
        in launch["reason"], launch

    # A second one: 2 of 3 (or of 2, if the replacement has not registered yet).
    launch = preempt(second)
    assert launch["spot"] is False, launch
    assert "; on-demand: preemption rate" in launch["reason"], launch
    assert "is above 0.50" in launch["reason"], launch
    assert mesh.hm_json("status", wid)["state"] == "running"  # work remained

    def on_demand_node() -> list[str]:
        return [n["name"] for n in mesh.hm_json("nodes")
                if n["pool"] == "burst" and n["spot"] is False]

    (node,) = cast(list[str], wait_for(on_demand_node, 60,
                                       "the on-demand burst node to register", interval=0.3))
    (proc,) = [p for p in burst_processes(mesh)
               if ("--name", node) in set(itertools.pairwise(p.cmdline()))]
    assert "--spot" not in proc.cmdline()
