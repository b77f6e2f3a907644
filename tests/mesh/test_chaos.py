"""The chaos script at a small size: agents (the leader included) are crashed and
restarted while a workflow runs; every task must succeed exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("batch", [[], ["--batch", "1"]], ids=["blocks", "per-task"])
def test_chaos_small(batch: list[str]) -> None:
    """150 tasks on 9 slots: the leader writes them in blocks of 4 unless told 1."""
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
            "0.4",
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
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["succeeded_once"] == 150
    assert len(report["kills"]) >= 3  # the run really was disturbed
