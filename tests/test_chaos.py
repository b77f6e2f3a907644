"""The chaos script at a small size: agents (the leader included) are crashed and
restarted while a workflow runs; every task must succeed exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_chaos_small() -> None:
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
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["succeeded_once"] == 150
    assert len(report["kills"]) >= 3  # the run really was disturbed
