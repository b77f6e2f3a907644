"""Deleting workflows against a real mesh (real etcd, real agents): ``hypermesh delete``,
``--force`` on a running workflow while its leader works, the leader's retention, the
quota warning of ``status`` and ``nodes``, and etcd's size after many workflows were run
and deleted (compaction and defragmentation by the leader)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.agent.leader.compaction import TEST_TIMINGS_ENV
from hypermesh.local.agents import AgentProcess
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.etcd_size import DbSize, db_size
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh, process_gone, task_pid

SLEEPER = "echo $$ > \"$HM_ATTEMPT_DIR/pid\"; exec sleep 120"


def keys_of(mesh: Mesh, wid: str) -> list[str]:
    """Every key of workflow ``wid`` in the mesh's etcd."""
    ks = Keyspace(mesh.namespace)

    async def read() -> list[str]:
        async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
            found = []
            for p in ks.workflow_prefixes(wid):
                if p.endswith("/"):
                    found += [kv.key.decode() for kv in (await etcd.get_prefix(p))[0]]
                elif await etcd.get(p) is not None:
                    found.append(p)
            return found

    return asyncio.run(read())


def size_of(server: EtcdServer) -> DbSize:
    async def read() -> DbSize:
        async with Etcd([server.url.split("//")[1]]) as etcd:
            return await db_size(etcd)

    return asyncio.run(read())


def gone(mesh: Mesh, wid: str) -> bool:
    """``status`` and ``tasks`` say the workflow does not exist (exit 1)."""
    status, tasks = mesh.hm("status", wid), mesh.hm("tasks", wid)
    return status.returncode == tasks.returncode == 1 and "no workflow" in status.stderr


def test_a_finished_workflow_is_deleted_with_every_key(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe("experiments:\n  a: {samples: 3, command: ['true']}\n"
                               "  b: {after: [a], command: ['true']}\n")
    wid, other = mesh.submit(recipe), mesh.submit(recipe)
    mesh.wait_state(wid, {"succeeded"})
    mesh.wait_state(other, {"succeeded"})
    assert keys_of(mesh, wid)

    out = mesh.hm_json("delete", wid)

    assert out == [{"workflow": wid, "state": "succeeded", "keys": out[0]["keys"]}]
    assert out[0]["keys"] >= 10
    assert gone(mesh, wid)
    assert keys_of(mesh, wid) == []
    assert [s["id"] for s in mesh.hm_json("status")] == [other]
    again = mesh.hm("delete", wid)
    assert again.returncode == 1 and "no workflow" in again.stderr
    assert mesh.hm("delete", "nope-123456").returncode == 1


def test_a_running_workflow_is_refused_unless_forced_and_its_tasks_stop(mesh: Mesh) -> None:
    """Without --force nothing is deleted (exit 2), not even a finished workflow named
    beside it. With --force the workflow is cancelled, its tasks stop, and once it is
    deleted the leader, which keeps leading, writes nothing of it again."""
    node = mesh.agent(slots=2)
    done = mesh.submit(mesh.write_recipe("experiments:\n  a: {command: ['true']}\n", "t.yaml"))
    mesh.wait_state(done, {"succeeded"})
    recipe = mesh.write_recipe(f"experiments:\n  slow: {{samples: 2, command: ['{SLEEPER}']}}\n"
                               "  after: {after: [slow], command: ['true']}\n")
    wid = mesh.submit(recipe)
    pids = [task_pid(node, f"{wid}.slow.{i}") for i in range(2)]

    refused = mesh.hm("delete", done, wid)

    assert refused.returncode == 2
    assert "cancel it first" in refused.stderr and "--force" in refused.stderr
    assert mesh.hm_json("status", wid)["state"] == "running"
    assert mesh.hm_json("status", done)["state"] == "succeeded"

    watch = subprocess.Popen([sys.executable, "-m", "hypermesh", "status", wid, "--watch"],
                             env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        # The follower is following before the delete (a loaded machine starts it late):
        # its first progress line (on stderr, stdout not being a terminal) says so.
        assert watch.stderr is not None
        started, _, _ = select.select([watch.stderr], [], [], 30)
        assert started and watch.stderr.readline(), "status --watch printed nothing in 30 s"
        forced = mesh.hm("delete", "--force", wid, "--drain", "20", timeout=90)
        _, watched = watch.communicate(timeout=30)
    finally:
        watch.kill()
        watch.wait()

    assert forced.returncode == 0, forced.stderr
    assert f"deleted {wid} (was cancelled)" in forced.stderr
    # A follower ends: the workflow either ended (cancelled) or vanished under it.
    assert watch.returncode == 1
    assert "was deleted" in watched or "cancelled" in watched, watched
    wait_for(lambda: all(process_gone(p) for p in pids), 20, "the tasks to stop")
    assert gone(mesh, wid)
    time.sleep(3)  # the leader keeps leading: a write fenced on the deleted state fails
    assert keys_of(mesh, wid) == []
    assert node.alive and "scheduling round failed" not in node.log_tail(100_000)


def test_a_deletion_racing_the_leaders_expansion_leaves_no_key(mesh: Mesh) -> None:
    """Deleted right after submit, while the leader expands its four experiments task by
    task (about 140 transactions, each fenced on the state key; on a loaded 2-core machine
    the cancel usually lands while the third or fourth experiment is written) and the
    agent runs the first tasks: once ``delete`` is done, no key of the workflow is written
    again, and the leader's round does not trip over the workflow vanishing from its
    view."""
    node = mesh.agent(slots=1)
    recipe = mesh.write_recipe(
        "experiments:\n"
        + "".join(f"  e{i}: {{samples: 4000, batch: 1, command: ['true']}}\n" for i in range(4))
    )
    wid = mesh.submit(recipe)
    forced = mesh.hm("delete", "--force", wid, "--drain", "0", timeout=120)
    assert forced.returncode == 0, forced.stderr
    for _ in range(3):
        assert keys_of(mesh, wid) == []
        time.sleep(1)
    assert gone(mesh, wid)
    assert node.alive and "Traceback" not in node.log_tail(1_000_000)


def test_the_leader_deletes_finished_workflows_after_the_retention(mesh: Mesh) -> None:
    mesh.hm("settings", "retention=0", check=True)  # keep forever
    node = mesh.agent(slots=2)
    recipe = mesh.write_recipe("experiments:\n  a: {samples: 2, command: ['true']}\n")
    wid = mesh.submit(recipe)
    mesh.wait_state(wid, {"succeeded"})
    time.sleep(3)  # three checks of the leader's housekeeping (local preset: every 1 s)
    assert mesh.hm_json("status", wid)["state"] == "succeeded"

    mesh.hm("settings", "retention=2s", check=True)

    wait_for(lambda: gone(mesh, wid), 30, "the leader to delete the workflow", interval=0.5)
    assert keys_of(mesh, wid) == []
    assert f"deleted workflow {wid} (succeeded" in node.log_tail(100_000)
    young = mesh.submit(recipe)  # ended just now: kept until 2 s have passed
    mesh.wait_state(young, {"succeeded"})
    wait_for(lambda: gone(mesh, young), 30, "the second workflow to go", interval=0.5)


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of its own with a quota of 1 MiB."""
    server = EtcdServer(tmp_path / "etcd", fsync=False,
                        extra_args=["--quota-backend-bytes", str(1024 * 1024)])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_status_and_nodes_warn_when_etcd_nears_its_quota(
    small_etcd: EtcdServer, tmp_path: Path
) -> None:
    mesh = Mesh(small_etcd, tmp_path)
    try:
        mesh.agent(slots=1)
        wid = mesh.submit(mesh.write_recipe("experiments:\n  a: {command: ['true']}\n"))
        mesh.wait_state(wid, {"succeeded"})
        assert "etcd_warning" not in mesh.hm_json("status", wid)
        assert "quota" not in mesh.hm("nodes").stderr

        async def fill() -> None:  # ballast beside the mesh, up to 80 % of 1 MiB
            async with Etcd([small_etcd.url.split("//")[1]]) as etcd:
                for i in range(220):
                    if (await db_size(etcd)).size >= 0.8 * 1024 * 1024:
                        return
                    await etcd.put(f"/ballast/{i}", b"x" * 4000)
                    await asyncio.sleep(0.01)

        asyncio.run(fill())
        wait_for(lambda: size_of(small_etcd).size >= 0.8 * 1024 * 1024, 10, "etcd to grow")

        text = mesh.hm("status", wid)
        assert text.returncode == 0 and "warning: etcd's database" in text.stderr
        assert "of its quota (1 MiB)" in text.stderr
        one = mesh.hm_json("status", wid)
        assert "hypermesh delete" in one["etcd_warning"]
        assert all("etcd_warning" in s for s in mesh.hm_json("status"))
        assert all("etcd_warning" in n for n in mesh.hm_json("nodes"))
        assert "warning: etcd's database" in mesh.hm("nodes").stderr
    finally:
        mesh.close()


@pytest.mark.timeout(900)
def test_etcd_returns_to_its_size_after_many_workflows_are_deleted(tmp_path: Path) -> None:
    """6 workflows of 1,000 trivial tasks run, then are deleted: the leader compacts
    etcd and defragments it, back to about the size it had with no workflow. (The issue's
    100 x 10,000 runs in ``scripts/bench_cleanup.py``; docs/benchmarks.md.) This etcd is
    the test's own: the leader keeps seconds of history, not the local preset's minute."""
    server = EtcdServer(tmp_path / "etcd", fsync=False)
    server.start()
    mesh = Mesh(server, tmp_path)
    try:
        node = AgentProcess("node1", server.url, mesh.namespace, tmp_path / "node1", slots=4,
                            env=dict(os.environ, **{TEST_TIMINGS_ENV:
                                                    "compact_keep_s=3,defrag_every_s=3"}))
        mesh.agents[node.name] = node
        node.start()
        wait_for(lambda: any(n["leader"] for n in mesh.hm_json("nodes")), 30,
                 "the agent to register and lead")  # its first writes are in
        start = size_of(server)
        recipe = mesh.write_recipe("experiments:\n  t: {samples: 1000, command: ['true']}\n")
        submits = [
            subprocess.Popen([sys.executable, "-m", "hypermesh", "submit", str(recipe), "--wait"],
                             env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for _ in range(6)
        ]
        wids = []
        for proc in submits:
            out, err = proc.communicate(timeout=800)
            assert proc.returncode == 0, err
            wids.append(out.split()[-1])
        peak = size_of(server)
        assert peak.size > 10 * start.size

        deleted = json.loads(mesh.hm("delete", *wids, "--json", check=True, timeout=120).stdout)

        assert sorted(d["workflow"] for d in deleted) == sorted(wids)
        assert mesh.hm_json("status") == []
        bound = max(2 * start.size, start.size + 256 * 1024)
        try:
            wait_for(lambda: size_of(server).size <= bound, 300,
                     f"etcd back to {bound} bytes (start {start.size}, peak {peak.size})",
                     interval=1)
        except TimeoutError:
            print(size_of(server), "\n".join(
                line for line in node.log_tail(1_000_000).splitlines()
                if "defrag" in line or "compact" in line or "housekeeping" in line))
            raise
        log = node.log_tail(1_000_000)
        assert "defragmented etcd member" in log
    finally:
        mesh.close()
        server.stop()
