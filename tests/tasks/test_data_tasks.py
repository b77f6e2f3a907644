"""Tasks that read data sets: agents mount what a recipe names, and checkpoints
written by one attempt are found by the next one on another node.

Real etcd, real SeaweedFS, real FUSE mounts, real agent processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.processes import unmount_under, wait_for
from tests.conftest import Mesh, process_gone, task_pid


def _dataset(store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "shard-0").mkdir(parents=True)
    (src / "shard-0" / "part.txt").write_text("hello from shard 0\n")
    (src / "big.bin").write_bytes(os.urandom(3 << 20))
    put_dataset(store, src, "toy", chunk_size=4 << 20)


def test_a_task_reads_its_data_and_resumes_from_its_checkpoint_elsewhere(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    _dataset(store, tmp_path)
    extra = ("--store", store_url, "--cache-size", "256MiB")
    first = mesh.agent("node1", extra=extra)
    recipe = mesh.write_recipe(
        """
experiments:
  train:
    data: {toy: toy}
    command:
      - test "$HM_DATA" = "$HM_DATA_TOY"
      - cat "$HM_DATA_TOY/shard-0/part.txt"
      - cmp -n 4096 "$HM_DATA_TOY/big.bin" "$HM_DATA_TOY/big.bin"
      - |
        if [ -f "$HM_CHECKPOINT_DIR/step" ]; then
          echo "resumed at step $(cat "$HM_CHECKPOINT_DIR/step") on $HM_NODE"; exit 0
        fi
        echo 7 > "$HM_CHECKPOINT_DIR/step"
        echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 120
"""
    )
    wid = mesh.submit(recipe)
    task_pid(first, f"{wid}.train.0", timeout=60)  # checkpoint written, then it runs on
    first.crash()  # the spot machine vanishes, its mount with it
    mesh.agent("node2", extra=extra)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded", mesh.logs()
    (task,) = mesh.hm_json("tasks", wid)
    assert [(a["node"], a["reason"]) for a in task["attempts"]] == [
        ("node1", "node-lost"),
        ("node2", "exit"),
    ]
    log = mesh.hm("logs", f"{wid}.train.0", check=True).stdout
    assert "hello from shard 0" in log
    assert "resumed at step 7 on node2" in log
    # the checkpoint is durable in the store, not on either node
    assert store.get(f"outputs/checkpoints/{wid}.train.0/step") == b"7\n"

    def node2_cached() -> int:  # what its chunk cache holds reaches gossip (every 10 s)
        rows = {r["name"]: r for r in mesh.hm_json("nodes")}
        return rows["node2"]["cached_bytes"] or 0

    # part.txt's chunk (cmp of a file with itself reads nothing)
    wait_for(lambda: node2_cached() == len("hello from shard 0\n"), 40, "node2's cached bytes")


def test_a_task_whose_data_cannot_be_mounted_fails_with_reason_data(
    mesh: Mesh, store_url: str
) -> None:
    mesh.agent("node1", extra=("--store", store_url))
    recipe = mesh.write_recipe(
        "experiments:\n  e:\n    data: {x: no-such-set}\n    command: ['true']\n"
    )
    wid = mesh.submit(recipe)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "failed"
    (task,) = mesh.hm_json("tasks", wid)
    assert [a["reason"] for a in task["attempts"]] == ["data"]
    log = mesh.hm("logs", f"{wid}.e.0", check=True).stdout
    assert "no-such-set" in log


def test_an_agent_without_a_store_says_so(mesh: Mesh) -> None:
    mesh.agent("node1")
    recipe = mesh.write_recipe("experiments:\n  e:\n    data: {x: toy}\n    command: ['true']\n")
    wid = mesh.submit(recipe)
    wait_for(
        lambda: mesh.hm_json("status", wid)["state"] == "failed", 60, "the workflow to fail"
    )
    log = mesh.hm("logs", f"{wid}.e.0", check=True).stdout
    assert "no object store" in log


def test_a_mount_started_by_a_program_ends_when_that_program_dies(
    store: S3Store, store_url: str, tmp_path: Path
) -> None:
    _dataset(store, tmp_path)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    starter = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from hypermesh.chunkfs.mount import MountProcess\n"
        f"m = MountProcess('toy', Path({str(mountpoint)!r}), "
        f"cache_dir=Path({str(tmp_path / 'cache')!r}), store_url={store_url!r}).start()\n"
        "print(m.proc.pid, flush=True)\n"
        "os._exit(0)  # dies without stopping its mount\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", starter], capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(out.stdout.split()[-1])
    try:
        wait_for(lambda: process_gone(pid), 30, "the orphaned mount process to exit")
        wait_for(lambda: not os.path.ismount(mountpoint), 30, "the mount point to be unmounted")
    finally:
        unmount_under(tmp_path)
