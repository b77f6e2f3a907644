"""``scripts/local_mesh.py`` stops everything it started on SIGTERM, as on Ctrl-C: while
the mesh is up, while it runs a recipe, and while it is still starting."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hypermesh.local.processes import stop_started_under, wait_for

ROOT = Path(__file__).resolve().parents[2]
GATED = "experiments:\n  wait: {command: ['until [ -f gate ]; do sleep 0.05; done']}\n"


def _started_under(root: Path) -> list[psutil.Process]:
    """Live processes whose command line names a path under ``root`` (etcd's data
    directory, the agents' work directories, their mount processes)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
            str(root) in arg for arg in proc.info["cmdline"] or []
        ):
            found.append(proc)
    return found


def _terminated_at(args: list[str], marker: str, root: Path) -> tuple[int, str]:
    """Run ``local_mesh.py ARGS``, send it SIGTERM once a line of its stderr holds
    ``marker``; its exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/local_mesh.py"), *args, "--agents", "2",
         "--dir", str(root), "--namespace", "sigterm"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not any(marker in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            # Once seen under a loaded suite: the mesh stopped one agent, never signalled
            # the other, and hung. Say what each agent last logged.
            logs = {log.parent.name: log.read_text(errors="replace")[-3000:]
                    for log in sorted(root.glob("*/agent.log"))}
            raise AssertionError(f"the local mesh did not exit 90 s after SIGTERM; its "
                                 f"agents' logs: {logs}\n{''.join(lines)}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            stop_started_under(root, timeout=10)  # what the killed mesh left running
    return proc.returncode, "".join(lines) + err


@pytest.mark.parametrize(
    ("args", "marker", "code", "last"),
    [
        (["up"], "local mesh: up; Ctrl-C or SIGTERM stops it", 0, "local mesh: stopped"),
        (["run", "RECIPE"], " running: ", 130,
         "local mesh: interrupted; everything it started is stopped"),
        (["up"], "local mesh: starting", 130,
         "local mesh: interrupted; everything it started is stopped"),
    ],
    ids=["up", "running-a-recipe", "starting"],
)
def test_sigterm_stops_the_local_mesh_and_everything_it_started(
    tmp_path: Path, args: list[str], marker: str, code: int, last: str
) -> None:
    recipe = tmp_path / "gated.yaml"
    recipe.write_text(GATED)
    root = tmp_path / "mesh"
    returncode, err = _terminated_at([str(recipe) if a == "RECIPE" else a for a in args],
                                     marker, root)
    assert returncode == code, err
    assert err.rstrip().endswith(last) and "Traceback" not in err, err
    try:
        wait_for(lambda: not _started_under(root), 30, "every process of the mesh to end")
    except TimeoutError:
        left = [" ".join(p.info["cmdline"] or []) for p in _started_under(root)]
        raise AssertionError(f"still running 30 s after the mesh exited: {left}\n{err}") from None
