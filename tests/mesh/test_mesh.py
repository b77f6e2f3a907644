"""Many agents, one workflow: deaths, a leader's death, pauses, spot notices, etcd trouble.

Real etcd, real agent processes; a "machine death" is SIGKILL of the agent and of
every process it started, with no drain and no lease revoke.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.etcd import EtcdCluster, EtcdServer
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh, process_gone, task_pid
from tests.tcp_proxy import CuttingProxy


def successes(task: dict) -> int:
    return sum(1 for a in task["attempts"] if a["state"] == "succeeded")


@pytest.mark.parametrize(
    ("batch", "watch"),
    [("", "all"), ("    batch: 3\n", "all"), ("    batch: 3\n", "own")],
    ids=["per-task", "blocks", "offered-blocks"],
)
def test_three_agents_survive_the_death_of_one(mesh: Mesh, batch: str, watch: str) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=2, extra=("--watch", watch))
    recipe = mesh.write_recipe(
        f"experiments:\n  work:\n    samples: 12\n{batch}    command: ['sleep 3']\n"
    )
    wid = mesh.submit(recipe)

    def busy_node() -> str | None:
        running = [t["node"] for t in mesh.hm_json("tasks", wid) if t["state"] == "running"]
        return running[0] if running else None

    victim = wait_for(busy_node, 30, "a running task")
    mesh.agents[victim].crash()  # type: ignore[index]
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded"
    tasks = {t["id"]: t for t in mesh.hm_json("tasks", wid)}
    assert all(successes(t) == 1 for t in tasks.values())
    # What the victim held when it died (read afterwards: reading before the kill
    # races tasks that end in between) was lost and ran again elsewhere.
    held = {
        task_id
        for task_id, t in tasks.items()
        if any(a["node"] == victim and a["reason"] == "node-lost" for a in t["attempts"])
    }
    assert held
    for task_id in held:
        first, *rest = tasks[task_id]["attempts"]
        assert (first["node"], first["state"], first["reason"]) == (victim, "failed", "node-lost")
        assert rest and rest[-1]["node"] != victim and rest[-1]["state"] == "succeeded"
        assert first["attempt"] + 1 == rest[0]["attempt"]


def test_a_new_leader_takes_over(mesh: Mesh) -> None:
    mesh.agent("node1", slots=2)
    mesh.agent("node2", slots=2)
    leader = next(n["name"] for n in mesh.hm_json("nodes") if n["leader"])
    recipe = mesh.write_recipe(
        """
experiments:
  first:
    samples: 2
    # Each waits for the test's go-ahead (or 20 s), so it is still running when the
    # leader dies, however slowly the test's CLI calls come on a loaded machine.
    command: ['for i in $(seq 400); do [ -e go ] && break; sleep 0.05; done']
  second:
    after: [first]
    samples: 2
    command: ['true']
"""
    )
    wid = mesh.submit(recipe)
    wait_for(
        lambda: any(t["state"] == "running" for t in mesh.hm_json("tasks", wid)), 30, "first to run"
    )
    mesh.agents[leader].crash()
    survivor = "node2" if leader == "node1" else "node1"
    wait_for(
        lambda: [n["name"] for n in mesh.hm_json("nodes") if n["leader"]] == [survivor],
        15,
        "the survivor to lead",
    )
    (recipe.parent / "go").touch()
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded"  # the second experiment was expanded by the new leader
    again = mesh.hm("submit", str(recipe), "--wait", timeout=60)
    assert again.returncode == 0, again.stderr


def test_nodes_that_watch_their_own_part_run_offered_blocks_through_a_failover(
    mesh: Mesh,
) -> None:
    """``--watch own`` everywhere: the nodes claim the blocks the leader offers them; when
    the leader dies holding blocks, a follower widens its watch and leads, and every
    task succeeds exactly once."""
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=2, extra=("--watch", "own"))
    leader = next(n["name"] for n in mesh.hm_json("nodes") if n["leader"])
    recipe = mesh.write_recipe(
        """
experiments:
  first:
    samples: 12
    batch: 2
    command: ['for i in $(seq 400); do [ -e go ] && break; sleep 0.05; done']
  second:
    after: [first]
    samples: 6
    batch: 3
    command: ['true']
"""
    )
    wid = mesh.submit(recipe)

    def leader_runs() -> bool:
        return any(t["state"] == "running" and t["node"] == leader
                   for t in mesh.hm_json("tasks", wid))

    wait_for(leader_runs, 30, "the leader to run a task of a block")
    mesh.agents[leader].crash()
    wait_for(lambda: any(n["leader"] and n["name"] != leader for n in mesh.hm_json("nodes")),
             15, "a new leader")
    (recipe.parent / "go").touch()
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded"
    tasks = mesh.hm_json("tasks", wid)
    assert len(tasks) == 18 and all(successes(t) == 1 for t in tasks)
    lost = [t for t in tasks if any(a["node"] == leader and a["reason"] == "node-lost"
                                   for a in t["attempts"])]
    assert lost and all(t["attempts"][-1]["node"] != leader for t in lost)
    logs = mesh.logs()
    assert "elected: watching the whole namespace" in logs
    assert sum(f"{n}: claimed block" in logs for n in ("node1", "node2", "node3")) >= 2


def candidacies(mesh: Mesh) -> list[str]:
    """The nodes holding a leader candidacy (``elect/`` keys) in etcd now."""

    async def read() -> list[str]:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            kvs, _ = await etcd.get_prefix(Keyspace(mesh.namespace).election)
        return sorted(json.loads(kv.value)["node"] for kv in kvs)

    return asyncio.run(read())


def test_only_the_leader_holds_a_candidacy_and_a_survivor_takes_its_place(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=1)

    def leader() -> str | None:
        leaders = [n["name"] for n in mesh.hm_json("nodes") if n["leader"]]
        return leaders[0] if len(leaders) == 1 else None

    first = wait_for(leader, 15, "a leader")
    # The followers keep no second lease alive: they stand only when no live node leads.
    assert candidacies(mesh) == [first]
    mesh.agents[first].crash()
    successor = wait_for(lambda: leader() not in (None, first) and leader(), 15, "a new leader")
    # The crashed leader's candidacy (its lease would live on for up to the leader
    # TTL) went in the transaction that made the successor stand.
    assert candidacies(mesh) == [successor]
    recipe = mesh.write_recipe("experiments:\n  one:\n    command: ['true']\n")
    done = mesh.hm("submit", str(recipe), "--wait", timeout=60)
    assert done.returncode == 0, done.stderr


def test_paused_agent_loses_its_claim_and_its_processes(mesh: Mesh) -> None:
    paused = mesh.agent("node1")
    recipe = mesh.write_recipe(
        """
experiments:
  one:
    command: ['if [ "$HM_NODE" = node1 ]; then echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 60; fi']
"""
    )
    wid = mesh.submit(recipe)
    pid = task_pid(paused, f"{wid}.one.0")
    assert paused.proc is not None
    os.kill(paused.proc.pid, signal.SIGSTOP)  # the node freezes past its 3 s lease
    try:
        mesh.agent("node2")
        status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
        assert status["state"] == "succeeded"
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    # Back from the pause, node1 finds its lease gone and kills its orphaned process...
    wait_for(
        lambda: process_gone(pid),
        15,
        "the orphaned process to be killed",
    )
    # ...its late result is rejected, and it rejoins the mesh.
    wait_for(lambda: "result rejected" in paused.log_tail(20000), 15, "the rejection")
    wait_for(lambda: {n["name"] for n in mesh.hm_json("nodes")} == {"node1", "node2"}, 15, "rejoin")
    (task,) = mesh.hm_json("tasks", wid)
    assert successes(task) == 1
    assert [(a["node"], a["reason"]) for a in task["attempts"]] == [
        ("node1", "node-lost"),
        ("node2", "exit"),
    ]


class _Metadata(http.server.BaseHTTPRequestHandler):
    notice: bytes | None = None

    def do_PUT(self) -> None:  # an IMDSv2 token
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"token")

    def do_GET(self) -> None:
        if self.path.endswith("spot/instance-action") and self.notice is not None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(self.notice)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata() -> Iterator[tuple[str, type[_Metadata]]]:
    handler = type("Handler", (_Metadata,), {"notice": None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield (
            f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action",
            handler,
        )
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("batch", ["1", "2"], ids=["per-task", "blocks"])
def test_spot_notice_drains_and_work_moves_at_once(
    mesh: Mesh, metadata: tuple[str, type[_Metadata]], batch: str
) -> None:
    url, handler = metadata
    spot = mesh.agent(
        "spot1", extra=("--spot", "--spot-notice-url", url, "--lease-ttl", "30", "--grace", "1")
    )
    recipe = mesh.write_recipe(
        f"""
experiments:
  move:
    samples: 2
    batch: {batch}
    command: ['if [ "$HM_NODE" = spot1 ]; then exec sleep 120; fi; echo moved']
"""
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: "running" in [t["state"] for t in mesh.hm_json("tasks", wid)], 30,
             "a task to run")
    mesh.agent("ondemand1")
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    handler.notice = json.dumps({"action": "terminate", "time": deadline}).encode()
    noticed = time.time()
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=30)
    assert status["state"] == "succeeded"
    tasks = mesh.hm_json("tasks", wid)
    assert all(successes(t) == 1 for t in tasks)
    moved = [t for t in tasks if t["attempts"][0]["node"] == "spot1"]
    assert moved
    for t in moved:
        first, second = t["attempts"]
        assert (first["reason"], second["node"]) == ("preempted", "ondemand1")
        # Released at once (a block given back): far sooner than the 30 s lease.
        assert second["started_at"] - noticed < 10
    assert spot.terminate(timeout=30) == 0  # it had already drained and exited


def test_etcd_cluster_loses_a_member_and_no_task_fails(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", size=3).start()
    mesh = Mesh(cluster, tmp_path)  # type: ignore[arg-type]
    try:
        mesh.agent("node1", slots=3)
        mesh.agent("node2", slots=3)
        recipe = mesh.write_recipe(
            "experiments:\n  steady:\n    samples: 30\n    command: ['sleep 0.3']\n"
        )
        wid = mesh.submit(recipe)
        wait_for(
            lambda: mesh.hm_json("status", wid)["experiments"]["steady"]["succeeded"] >= 5,
            30,
            "some progress",
        )
        cluster.members[0].stop()
        status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
        assert status["state"] == "succeeded"
        tasks = mesh.hm_json("tasks", wid)
        assert all(successes(t) == 1 for t in tasks)
        assert not any(a["state"] == "failed" for t in tasks for a in t["attempts"])
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.close()
        cluster.stop()


@pytest.mark.parametrize("batch", ["    batch: 1\n", "    batch: 4\n"], ids=["per-task", "blocks"])
def test_connections_to_etcd_cut_again_and_again_lose_no_task(
    etcd_server: EtcdServer, tmp_path: Path, batch: str
) -> None:
    """Every connection from the agents to etcd is reset, again and again, while they
    claim and record tasks: some transactions commit and lose their answer. None may
    leave a task claimed by nobody, and every task succeeds exactly once."""
    with CuttingProxy("127.0.0.1", int(etcd_server.url.rsplit(":", 1)[1])) as proxy:
        cli = Mesh(etcd_server, tmp_path / "cli")
        agents = Mesh(SimpleNamespace(url=proxy.url), tmp_path)  # type: ignore[arg-type]
        agents.namespace = cli.namespace
        try:
            agents.agent("node1", slots=4)
            agents.agent("node2", slots=4)
            recipe = agents.write_recipe(
                f"experiments:\n  steady:\n    samples: 200\n{batch}"
                "    command: ['sleep 0.2']\n"
            )
            wid = cli.submit(recipe)
            done = threading.Event()

            def cutter() -> None:  # at most 30 cuts, 0.4 s apart, while the run lasts
                while proxy.cuts < 30 and not done.wait(0.4):
                    proxy.cut()

            cutting = threading.Thread(target=cutter, daemon=True)
            cutting.start()
            try:
                status = cli.wait_state(wid, {"succeeded", "failed"}, timeout=120)
            finally:
                done.set()
                cutting.join(timeout=5)
            assert status["state"] == "succeeded"
            tasks = cli.hm_json("tasks", wid)
            assert len(tasks) == 200 and all(successes(t) == 1 for t in tasks)
            assert proxy.cuts >= 5  # the run really was disturbed (it lasts 5 s at least)
        except BaseException:
            print(agents.logs())
            with contextlib.suppress(Exception):  # where the run stands, for the record
                print(cli.hm("status", wid, "--json").stdout)
                stuck = [t for t in cli.hm_json("tasks", wid) if t["state"] != "succeeded"]
                print(json.dumps(stuck[:20], indent=1))
            raise
        finally:
            agents.close()


def test_leader_revokes_a_silent_node_before_its_lease_expires(mesh: Mesh) -> None:
    mesh.agent("leader1")  # leads (first to stand); has no GPU, so it never runs the task
    recipe = mesh.write_recipe(
        """
experiments:
  gpu_task:
    hardware: {gpus: 1}
    command: ['if [ "$HM_NODE" = node2 ]; then exec sleep 120; fi']
"""
    )
    wid = mesh.submit(recipe)
    mesh.agent("node2", extra=("--lease-ttl", "60", "--gpus", "1"))
    wait_for(lambda: [t["state"] for t in mesh.hm_json("tasks", wid)] == ["running"], 30,
             "the task on node2")
    crashed = time.time()
    mesh.agents["node2"].crash()
    mesh.agent("node3", extra=("--gpus", "1"))
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=40)
    assert status["state"] == "succeeded"
    (task,) = mesh.hm_json("tasks", wid)
    assert [(a["node"], a["reason"]) for a in task["attempts"]] == [
        ("node2", "node-lost"),
        ("node3", "exit"),
    ]
    # Far sooner than node2's 60 s lease: gossip found it dead and the leader revoked it.
    assert task["attempts"][1]["started_at"] - crashed < 15
    assert "gossip: node2 is dead; revoking its lease" in mesh.agents["leader1"].log_tail(20000)
