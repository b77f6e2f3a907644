"""The committed gRPC stubs are exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_stale_stubs_are_detected(tmp_path: Path) -> None:
    # Run the checker against a copy of the repository whose proto changed.
    for part in ("proto", "scripts", "hypermesh/_proto"):
        src, dst = ROOT / part, tmp_path / part
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file():
                (dst / f.name).write_bytes(f.read_bytes())
    proto = tmp_path / "proto" / "agent.proto"
    proto.write_text(
        proto.read_text().replace(
            "message DrainReply {", "message DrainReply {\n  string note = 9;"
        )
    )
    result = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "stale" in result.stderr
