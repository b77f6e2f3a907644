"""The README's first command: the example pipeline on a local mesh with an object
store, its raw data set read through the agents' chunkfs mounts; and its container variant
(every experiment in the local Python image, with podman). Then the mesh's etcd, started
again on the data the run left, and an agent on it: ``hypermesh best`` and the dashboard's
trials view rank the sweep by its objective, each trial with its val_acc curve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hypermesh.local.agents import AgentProcess
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("variant", [(), ("--in-container",)], ids=["processes", "containers"])
def test_the_example_pipeline_runs_on_a_local_mesh_with_its_data_set(
    tmp_path: Path, variant: tuple[str, ...]
) -> None:
    raw = tmp_path / "raw"
    subprocess.run(
        [sys.executable, str(ROOT / "examples/pipeline/make_raw.py"), str(raw), "--rows", "500"],
        check=True,
        capture_output=True,
    )
    result = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts/local_mesh.py"), "run",
            str(ROOT / "examples/pipeline/pipeline.yaml"),
            "--agents", "2", "--dir", str(tmp_path / "mesh"),
            "--namespace", "example", "--data", f"pipeline-raw={raw}", *variant,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    wid = result.stdout.split()[0].rstrip(":")
    runs = ROOT / "examples/pipeline/runs" / wid
    try:
        shards = sorted(p.name for p in (runs / "shards").iterdir())
        assert shards == [f"{i}.json" for i in range(4)]
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    assert not list((tmp_path / "mesh").glob("node*/chunkfs/mnt/*/shard-0.csv"))  # unmounted
    ran_in = {line.rsplit(" with ", 1)[-1]
              for log in (tmp_path / "mesh").glob("node*/agent.log")
              for line in log.read_text().splitlines() if ": image " in line}
    assert ran_in == ({"podman"} if variant else set())
    check_best_trials(tmp_path, wid)


def check_best_trials(tmp_path: Path, wid: str) -> None:
    """The sweep's 8 trials (objective val_acc, maximize; train.py reports val_acc every
    5 epochs and at the end) ranked best first by ``best --json``, each with its curve,
    and the same rows in an agent's trials view: read from the run's etcd data."""
    etcd = EtcdServer(tmp_path / "mesh" / "etcd").start()
    agent = AgentProcess("viewer", etcd.url, "example", tmp_path / "viewer")
    try:
        env = dict(os.environ, HYPERMESH_ETCD=etcd.url, HYPERMESH_NAMESPACE="example")
        best = json.loads(subprocess.run(
            [sys.executable, "-m", "hypermesh", "best", wid, "-n", "8", "--json"],
            env=env, capture_output=True, text=True, check=True, timeout=60).stdout)
        assert [r["rank"] for r in best] == list(range(1, 9))
        assert {(r["experiment"], r["metric"], r["goal"], r["state"]) for r in best} == {
            ("sweep", "val_acc", "maximize", "complete")}
        values = [r["value"] for r in best]
        assert values == sorted(values, reverse=True) and all(0 < v <= 1 for v in values)
        for r in best:
            steps = [step for step, _ in r["curve"]]
            epochs = int(r["params"]["epochs"])
            # every 5th epoch, then the final value at step `epochs`
            assert steps == [*range(0, epochs, 5), epochs], r
            assert r["curve"][-1][1] == r["value"]
        assert len({r["task"] for r in best}) == 8

        agent.start()

        def trials() -> dict[str, Any] | None:
            url = f"http://{agent.http_address}/api/workflows/{wid}/trials"
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    return json.loads(resp.read())  # type: ignore[no-any-return]
            except OSError:  # not serving yet, or not yet seen the workflow (404)
                return None

        body = wait_for(trials, 30, "the trials view of the sweep", interval=0.2)
        assert isinstance(body, dict)
        assert body["experiment"] == "sweep"
        assert body["objective"] == {"metric": "val_acc", "goal": "maximize"}
        assert body["total"] == 8 and body["states"]["complete"] == 8
        assert [{k: v for k, v in r.items() if k not in ("index", "metrics")}
                for r in body["trials"]] == best
    finally:
        agent.terminate(timeout=15)
        etcd.stop()
