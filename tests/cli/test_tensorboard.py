"""``hypermesh tensorboard``: trials write real event files (torch's SummaryWriter) to
``$HM_TENSORBOARD_DIR``, and the command serves them, a run per trial.

Real etcd, real SeaweedFS, a real chunkfs mount under a real agent, and a real
TensorBoard server queried over HTTP. The trial without data is served from the store
alone, its workdir folder removed: its agent copied it there when the attempt ended.
"""

from __future__ import annotations

import json
import logging
import re
import selectors
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from hypermesh.agent.tasks.logs import copy_event_files
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.cli.tensorboard import run_name
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone

WRITER = """\
import os
from torch.utils.tensorboard import SummaryWriter

lr = float(os.environ.get("HM_PARAM_LR", "0.5"))
writer = SummaryWriter(os.environ["HM_TENSORBOARD_DIR"])
for step in range(5):
    writer.add_scalar("train/loss", 1.0 / (1.0 + lr * step), step)
writer.close()
"""

RECIPE = f"""
experiments:
  sweep:                      # with data: event files go to the object store
    data: {{toy: toy}}
    parameters:
      lr: {{values: [0.01, 0.1]}}
    command:
      - {sys.executable} writer.py
  plain:                      # without data: the workdir's .hm-tensorboard/, then the store
    command:
      - {sys.executable} writer.py
"""


@pytest.mark.parametrize(("experiment", "index", "params", "name"), [
    ("sweep", 3, {"lr": 0.01, "l2": 0}, "sweep.3 lr=0.01,l2=0"),
    ("plain", 0, {}, "plain.0"),
    ("e", 1, {"path": "a/../b", "s": "x;y*"}, "e.1 path=a_.._b,s=x_y_"),
    ("e", 2, {"x": "y" * 300}, "e.2 x=" + "y" * 194),
])
def test_a_run_is_named_by_the_trial_and_is_one_safe_folder_name(
    experiment: str, index: int, params: dict[str, Any], name: str
) -> None:
    assert run_name(experiment, index, params) == name


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first line ``proc`` writes on stdout, within ``timeout`` seconds."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise TimeoutError(f"no URL within {timeout:g}s: {proc.communicate()[1]}")
    return proc.stdout.readline().strip()


def test_trials_event_files_are_served_one_run_per_trial(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    put_dataset(store, src, "toy", chunk_size=4 << 20)
    mesh.agent("node1", slots=3, extra=("--store", store_url, "--cache-size", "64MiB"))
    (mesh.root / "writer.py").write_text(WRITER)
    wid = mesh.submit(mesh.write_recipe(RECIPE))
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded", mesh.logs()
    runs = {f"{t['experiment']}.{t['index']}": run_name(t["experiment"], t["index"], t["params"])
            for t in mesh.hm_json("tasks", wid)}
    assert sorted(runs.values()) == ["plain.0", "sweep.0 lr=0.01", "sweep.1 lr=0.1"]

    # The trials with data wrote through the mount: durable in the store, not on the node.
    stored = {k: store.get(k) for k in store.list(f"outputs/tensorboard/{wid}.sweep.")
              if not k.endswith("/.chunkfs-dir")}  # a folder's marker object
    assert {k.split("/")[2] for k in stored} == {f"{wid}.sweep.0", f"{wid}.sweep.1"}
    assert all("/events.out.tfevents." in k for k in stored), sorted(stored)
    local = list((mesh.root / ".hm-tensorboard" / f"{wid}.plain.0").iterdir())
    assert [p.name.startswith("events.out.tfevents.") for p in local] == [True]

    # --logdir-only: one folder per trial, each with that trial's event file, byte for byte.
    logdir = tmp_path / "logdir"
    out = mesh.hm_json("tensorboard", wid, "--store", store_url, "--logdir", str(logdir),
                       "--logdir-only")
    assert out == {"logdir": str(logdir), "runs": sorted(runs.values())}
    assert sorted(p.name for p in logdir.iterdir()) == sorted(runs.values())
    for key, data in stored.items():
        task = key.split("/")[2].removeprefix(f"{wid}.")
        assert (logdir / runs[task] / key.split("/")[3]).read_bytes() == data
    assert (logdir / "plain.0" / local[0].name).read_bytes() == local[0].read_bytes()
    only = mesh.hm("tensorboard", wid, "--store", store_url, "--experiment", "plain",
                   "--logdir", str(tmp_path / "only"), "--logdir-only", check=True)
    assert [p.name for p in Path(only.stdout.strip()).iterdir()] == ["plain.0"]

    # The trial without data: its agent (which has a store) copied its event file to the
    # store where the mount stores the others', when the attempt ended (in the background,
    # after the attempt's end was recorded). With the workdir's folder gone, as on a node
    # that is gone, the command serves it from the store alone, byte for byte.
    plain_key = f"outputs/tensorboard/{wid}.plain.0/{local[0].name}"
    wait_for(lambda: store.size(plain_key) == local[0].stat().st_size, 20,
             "the agent to copy plain.0's event file to the store", interval=0.1)
    assert store.get(plain_key) == local[0].read_bytes()
    shutil.rmtree(mesh.root / ".hm-tensorboard")
    gone = tmp_path / "from-store"
    out = mesh.hm_json("tensorboard", wid, "--store", store_url, "--logdir", str(gone),
                       "--logdir-only")
    assert out == {"logdir": str(gone), "runs": sorted(runs.values())}
    assert (gone / "plain.0" / local[0].name).read_bytes() == store.get(plain_key)

    # TensorBoard has no login: beyond loopback it needs --insecure.
    refused = mesh.hm("tensorboard", wid, "--host", "0.0.0.0")
    assert refused.returncode == 2 and "--insecure" in refused.stderr

    # The real server (the workdir's folder still gone): every trial a run, with its
    # scalar; SIGTERM stops it all and cleans up.
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypermesh", "tensorboard", wid, "--store", store_url,
         "--port", "0"],
        env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = _first_line(proc, 30).rstrip("/")
        assert url.startswith("http://127.0.0.1:"), url

        def tags() -> dict[str, Any] | None:
            found = _get_json(f"{url}/data/plugin/scalars/tags")
            return found if len(found) == 3 else None

        found = wait_for(tags, 20, "TensorBoard to load the 3 runs", interval=0.2)
        assert isinstance(found, dict)
        assert sorted(found) == sorted(runs.values())
        assert all("train/loss" in t for t in found.values())
        assert sorted(_get_json(f"{url}/data/runs")) == sorted(runs.values())
        # TensorBoard's data server (tensorboard-data-server), started with it
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert children
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    said = re.search(r"TensorBoard on \S+ with 3 run\(s\) from (.+); Ctrl-C", stderr)
    assert said, stderr
    temp = Path(said[1])
    assert temp.name.startswith(f"hm-tensorboard-{wid}-")
    wait_for(lambda: all(process_gone(pid) for pid in children), 5, "its children to end")
    assert not temp.exists()


def test_an_attempts_event_files_are_copied_to_the_store_up_to_a_cap(
    store: S3Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What an agent does at an attempt's end for a task without data, against the real
    store: files under the cap are stored where a mount stores a task's event files, a
    file already stored at its size is not sent again, and what is past the cap stays
    out, with a warning that names it."""
    folder = tmp_path / "tb"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.tfevents").write_bytes(b"a" * 300)
    (folder / "sub" / "b.tfevents").write_bytes(b"b" * 300)
    (folder / "z.tfevents").write_bytes(b"z" * 600)
    task = f"w{tmp_path.name[-8:]}.plain.0"
    with caplog.at_level(logging.WARNING, logger="hypermesh.agent.tasks.logs"):
        copied, left_out = copy_event_files(store, folder, task, limit=1000)
    assert (copied, left_out) == (600, ["z.tfevents"])
    prefix = f"outputs/tensorboard/{task}/"
    assert sorted(store.list(prefix)) == [prefix + "a.tfevents", prefix + "sub/b.tfevents"]
    assert store.get(prefix + "sub/b.tfevents") == b"b" * 300
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "1 file(s) not copied to the store" in said[0], said
    assert "z.tfevents" in said[0] and "EVENT_FILES_MAX" in said[0]

    # The next attempt's end: only what grew is sent again.
    with open(folder / "a.tfevents", "ab") as f:
        f.write(b"a" * 100)
    assert copy_event_files(store, folder, task, limit=1 << 20) == (1000, [])
    assert store.get(prefix + "a.tfevents") == b"a" * 400
    assert sorted(store.list(prefix)) == [
        prefix + "a.tfevents", prefix + "sub/b.tfevents", prefix + "z.tfevents"]
