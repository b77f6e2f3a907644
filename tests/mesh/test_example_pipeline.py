"""The README's first command: the example pipeline on a local mesh with an object
store, its raw data set read through the agents' chunkfs mounts; and its container variant
(every experiment in the local Python image, with podman)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
