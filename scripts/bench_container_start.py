"""A trivial task in a container (image cached) against the same task as a plain process (issue 25).

Starts a local mesh (a real etcd and one agent with one slot), then submits, in alternating
rounds, one experiment of ``--tasks`` tasks running ``true``: once as processes, once with
``image:`` the local Python image (``hypermesh.local.images``, already in podman's store). With
``workers: 1`` the tasks run one at a time, each its own claim and record, so an attempt's span
(its ``started_at`` to its ``ended_at``, as the agent records them) is what starting, running
and reaping one trivial task costs. Prints, per mode, the median span and the workflow's wall
time per task over all rounds, and their ratios; asserts nothing.

    .venv/bin/python scripts/bench_container_start.py [--tasks 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.images import python_image
from hypermesh.local.mesh import LocalMesh

RECIPE = """\
name: start-{mode}
experiments:
  noop:
    parameters:
      i: {{range: [0, {last}], sampling: int}}
    samples: {tasks}
    workers: 1
{image}    command: ["true"]
"""


def run_round(env: dict[str, str], folder: Path, mode: str, tasks: int, image: str) -> tuple[
        list[float], float]:
    """One workflow of ``tasks`` trivial tasks; the attempts' spans and the wall time."""
    recipe = folder / f"{mode}.yaml"
    recipe.write_text(RECIPE.format(mode=mode, last=tasks - 1, tasks=tasks,
                                    image=f"    image: {image}\n" if mode == "container" else ""))
    started = time.monotonic()
    submit = subprocess.run([*hypermesh_command(), "submit", str(recipe), "--wait"], env=env,
                            capture_output=True, text=True, check=True)
    wall = time.monotonic() - started
    wid = submit.stdout.split()[-1]
    rows = json.loads(subprocess.run([*hypermesh_command(), "tasks", wid, "--json"], env=env,
                                     capture_output=True, text=True, check=True).stdout)
    spans = [a["ended_at"] - a["started_at"] for r in rows for a in r["attempts"]
             if a.get("ended_at") and a.get("started_at")]
    if any(r["state"] != "succeeded" for r in rows):
        raise SystemExit(f"{mode}: not every task succeeded: {[r['state'] for r in rows]}")
    return spans, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    image = python_image()
    spans: dict[str, list[float]] = {"process": [], "container": []}
    walls: dict[str, list[float]] = {"process": [], "container": []}
    with tempfile.TemporaryDirectory(prefix="hm-bench-start-") as tmp:
        folder = Path(tmp)
        mesh = LocalMesh(folder / "mesh", agents=1, slots=1, fsync=False).start()
        try:
            env = dict(os.environ, **mesh.env())
            run_round(env, folder, "container", 2, image)  # warm: the runtime probe, caches
            for n in range(opts.rounds):
                for mode in ("process", "container") if n % 2 == 0 else ("container", "process"):
                    s, wall = run_round(env, folder, mode, opts.tasks, image)
                    spans[mode] += s
                    walls[mode].append(wall / opts.tasks)
                    median = statistics.median(s) * 1e3
                    print(f"round {n + 1} {mode:9}: median span {median:7.1f} ms, "
                          f"wall per task {wall / opts.tasks * 1e3:7.1f} ms", file=sys.stderr)
        finally:
            mesh.close()
    span = {m: statistics.median(v) for m, v in spans.items()}
    wall = {m: statistics.median(v) for m, v in walls.items()}
    print(f"tasks per round {opts.tasks}, rounds {opts.rounds}, image {image}")
    for mode in ("process", "container"):
        print(f"{mode:9}: median attempt span {span[mode] * 1e3:7.1f} ms, "
              f"wall per task {wall[mode] * 1e3:7.1f} ms")
    print(f"container / process: span {span['container'] / span['process']:.1f}x, "
          f"wall {wall['container'] / wall['process']:.1f}x; "
          f"added per task {(span['container'] - span['process']) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
