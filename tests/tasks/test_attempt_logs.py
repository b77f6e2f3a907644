"""Attempt logs outlive their node: copied to the object store while the attempt
runs and when it ends, and read from there by ``hypermesh logs`` once the node is
gone. Real etcd, a real S3 server (SeaweedFS) and real agents."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypermesh.agent.tasks.logs import log_key
from hypermesh.chunkfs.store import open_store
from hypermesh.errors import NoSuchObject
from hypermesh.local.processes import wait_for
from hypermesh.state.keyspace import TaskRef
from tests.conftest import Mesh

GATED = "until [ -f gate ]; do sleep 0.05; done"


def stored(store_url: str, namespace: str, task_id: str, attempt: int = 1) -> bytes:
    try:
        with open_store(store_url) as store:
            return store.get(log_key(namespace, TaskRef.parse(task_id), attempt))
    except NoSuchObject:
        return b""


def test_logs_are_read_from_the_store_after_the_node_died(mesh: Mesh, store_url: str) -> None:
    node = mesh.agent("node1", slots=2, extra=("--store", store_url))
    recipe = mesh.write_recipe(
        f"""
experiments:
  done: {{command: ["echo finished-output"]}}
  live: {{command: ["echo started-output", "{GATED}"]}}
"""
    )
    wid = mesh.submit(recipe)
    done, live = f"{wid}.done.0", f"{wid}.live.0"
    try:
        # The ended attempt's copy is made at its end, the running one's periodically.
        wait_for(lambda: b"finished-output" in stored(store_url, mesh.namespace, done),
                 30, "the finished attempt's log in the store", interval=0.2)
        wait_for(lambda: b"started-output" in stored(store_url, mesh.namespace, live),
                 30, "the running attempt's log in the store", interval=0.2)
        assert "started-output" in mesh.hm("logs", live, check=True).stdout  # from the node
        node.crash()
        env = dict(mesh.env, HYPERMESH_STORE=store_url)
        # An ended attempt, and a follow of one whose node died while it ran.
        for task_id, text, extra in ((done, "finished-output", []),
                                     (live, "started-output", ["--follow"])):
            result = subprocess.run(
                [sys.executable, "-m", "hypermesh", "logs", task_id, *extra],
                env=env, capture_output=True, text=True, timeout=60,
            )
            assert result.returncode == 0, result.stderr
            assert text in result.stdout
            assert "node1" in result.stderr and "copy in the store" in result.stderr
        via_flag = mesh.hm("logs", done, "--store", store_url, check=True)
        assert "finished-output" in via_flag.stdout
        no_store = {k: v for k, v in mesh.env.items() if k != "HYPERMESH_STORE"}
        result = subprocess.run(
            [sys.executable, "-m", "hypermesh", "logs", done],
            env=no_store, capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 1
        assert "only on its disk" in result.stderr and "--store" in result.stderr
        missing = mesh.hm("logs", done, "--attempt", "7", "--store", store_url)
        assert missing.returncode == 1 and "no attempt 7" in missing.stderr
    finally:
        (mesh.root / "gate").touch()  # ends the task the crashed node left behind


def test_agent_without_store_keeps_logs_on_its_disk(mesh: Mesh) -> None:
    mesh.agent("node1")
    recipe = mesh.write_recipe(
        'experiments:\n  say: {command: ["echo hello-disk"]}\n  quiet: {command: ["true"]}\n'
    )
    wid = mesh.submit(recipe, "--wait")
    assert "hello-disk" in mesh.hm("logs", f"{wid}.say.0", check=True).stdout
    # A silent success leaves no file; its log reads as empty, not as missing.
    assert not (mesh.agents["node1"].work_dir / "attempts" / wid / "quiet.0.1.log").exists()
    for extra in ((), ("--attempt", "1")):
        assert mesh.hm("logs", f"{wid}.quiet.0", *extra, check=True).stdout == ""
    as_json = mesh.hm_json("logs", f"{wid}.say.0")
    assert as_json["task"] == f"{wid}.say.0" and as_json["attempt"] == 1
    assert "hello-disk" in as_json["text"]
    lines = mesh.hm("logs", f"{wid}.say.0", "--follow", "--json", check=True).stdout
    assert "hello-disk" in "".join(json.loads(line)["text"] for line in lines.splitlines())
    mesh.agents["node1"].terminate()
    env = {k: v for k, v in mesh.env.items() if k != "HYPERMESH_STORE"}
    result = subprocess.run(
        [sys.executable, "-m", "hypermesh", "logs", f"{wid}.say.0"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1 and "is gone" in result.stderr, result.stderr
    assert os.path.exists(mesh.agents["node1"].work_dir / "attempts" / wid / "say.0.1.log")


def test_a_follow_goes_on_from_the_store_when_the_node_dies(mesh: Mesh, store_url: str) -> None:
    node = mesh.agent("node1", extra=("--store", store_url))
    recipe = mesh.write_recipe(
        f'experiments:\n  live: {{command: ["echo line-one", "echo line-two", "{GATED}"]}}\n'
    )
    wid = mesh.submit(recipe)
    task_id = f"{wid}.live.0"
    wait_for(lambda: mesh.hm_json("tasks", wid)[0]["state"] == "running", 30, "the task to run")
    env = dict(mesh.env, HYPERMESH_STORE=store_url)
    follow = subprocess.Popen(
        [sys.executable, "-m", "hypermesh", "logs", task_id, "--follow"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert follow.stdout is not None
        live = ""
        while "line-two\n" not in live.splitlines(keepends=True):  # live, from the node
            line = follow.stdout.readline()
            assert line, f"the follow ended early: {live!r}"
            live += line
        wait_for(lambda: b"line-two" in stored(store_url, mesh.namespace, task_id),
                 30, "the running attempt's log in the store", interval=0.2)
        assert follow.poll() is None  # still following: the attempt runs
        node.kill()  # SIGKILL the agent alone: its stream ends without an end
        rest = follow.stdout.read()  # to its end: the follow exits by itself (pytest-timeout)
        follow.wait(30)
        assert follow.stderr is not None
        err = follow.stderr.read()
    finally:
        (mesh.root / "gate").touch()  # ends the task the killed agent left running
        follow.kill()
        follow.wait()
    assert follow.returncode == 0, err
    assert "note: node node1" in err and "showing the copy in the store" in err
    # Everything exactly once: what the node had sent, then what the copy has beyond it.
    copy = stored(store_url, mesh.namespace, task_id).decode()
    assert live + rest == copy
    assert copy.count("\nline-one\n") == 1 and copy.count("\nline-two\n") == 1
