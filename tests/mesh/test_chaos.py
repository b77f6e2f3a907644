"""The chaos script at a small size: agents (the leader included) are crashed and
restarted while a workflow runs; every task must succeed exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "batch", [[], ["--batch", "1"], ["--watch", "own"]],
    ids=["blocks", "per-task", "offered-blocks"],
)
def test_chaos_small(batch: list[str], tmp_path: Path) -> None:
    """150 tasks on 9 slots: the leader writes them in blocks of 4 unless told 1 (and
    with ``--watch own`` offers the blocks). A run that passed leaves no work directory
    behind."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "chaos.py"),
            "--agents",
            "3",
            "--slots",
            "3",
            "--tasks",
            "150",
            "--task-seconds",
            "0.8",
            "--kill-every",
            "1.5",
            "--max-kills",
            "5",
            "--seed",
            "7",
            "--deadline",
            "120",
            *batch,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["succeeded_once"] == 150
    assert list(tmp_path.iterdir()) == []  # the work directory went with the mesh
    assert len(report["kills"]) >= 3  # the run really was disturbed


def test_a_failed_chaos_run_keeps_its_work_directory_and_says_where(tmp_path: Path) -> None:
    """No time to finish (deadline 0): the run fails, and its logs are kept."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--agents", "1", "--tasks", "1",
         "--deadline", "0"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert result.returncode == 1 and not json.loads(result.stdout)["ok"]
    (kept,) = tmp_path.iterdir()
    assert f"chaos: work directory kept at {kept}\n" in result.stderr
    assert (kept / "node1" / "agent.log").exists()
