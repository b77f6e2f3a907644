"""etcd's size through many workflows and their deletion: does it come back?

A fresh :class:`~hypermesh.local.mesh.LocalMesh` (a real etcd, ``--agents`` agents with
the test suite's timings, ``--preset local``, whose leader compacts etcd to a revision
60 s old every 5 s and defragments a member with 1 MiB and 30 % of its file free, at
most once a minute) runs ``--workflows`` workflows of ``--tasks`` trivial tasks each
(``true``, batched in blocks by the leader), ``--parallel`` of them submitted at a time. Then one
``hypermesh delete`` removes them all, and the script waits until the leader's
housekeeping has compacted and defragmented etcd.

It prints etcd's database size (on disk and in use, from the member's status) at the
start (agents up, no workflow), at the peak (every workflow done) and at the end, with
the times each phase took. It asserts nothing about the figures.

    .venv/bin/python scripts/bench_cleanup.py [--workflows 100] [--tasks 10000]
        [--agents 4] [--slots 4] [--parallel 4] [--settle 180] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.etcd_size import DbSize, db_size

WORKFLOW_TIMEOUT_S = 3600.0
"""Upper bound on one ``submit --wait``, in seconds."""


def sizes(url: str) -> DbSize:
    """etcd's database size now (on disk, in use, quota)."""

    async def read() -> DbSize:
        async with Etcd([url.split("//")[1]]) as etcd:
            return await db_size(etcd)

    return asyncio.run(read())


def cli(args: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run([*hypermesh_command(), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hypermesh {' '.join(args[:3])}... exited {done.returncode}:\n"
                           f"{done.stderr[-2000:]}")
    return done.stdout


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-cleanup-") as tmp:
        root = Path(tmp)
        recipe = root / "many.yaml"
        recipe.write_text(f"experiments:\n  t: {{samples: {args.tasks}, command: ['true']}}\n")
        with LocalMesh(root / "mesh", agents=args.agents, slots=args.slots,
                       fsync=not args.no_fsync) as mesh:
            env = {**os.environ, **mesh.env()}
            wait_for(lambda: '"leader": true' in cli(["nodes", "--json"], env, 60), 30,
                     "a leader")
            time.sleep(3)  # the agents' first writes settle
            start = sizes(mesh.etcd.url)
            t0 = time.monotonic()
            wids: list[str] = []
            for first in range(0, args.workflows, args.parallel):
                batch = [
                    subprocess.Popen([*hypermesh_command(), "submit", str(recipe), "--wait"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
                    for _ in range(first, min(first + args.parallel, args.workflows))
                ]
                for proc in batch:
                    out, err = proc.communicate(timeout=WORKFLOW_TIMEOUT_S)
                    if proc.returncode != 0:
                        raise RuntimeError(f"submit --wait exited {proc.returncode}:\n{err}")
                    wids.append(out.split()[-1])
                print(f"{len(wids)} workflows done, {time.monotonic() - t0:.0f}s",
                      file=sys.stderr)
            ran_s = time.monotonic() - t0
            peak = sizes(mesh.etcd.url)
            t1 = time.monotonic()
            deleted = json.loads(cli(["delete", *wids, "--json"], env, WORKFLOW_TIMEOUT_S))
            delete_s = time.monotonic() - t1
            t2 = time.monotonic()
            target = max(2 * start.size, start.size + 1024 * 1024)
            end = sizes(mesh.etcd.url)
            while end.size > target and time.monotonic() - t2 < args.settle:
                time.sleep(1)
                end = sizes(mesh.etcd.url)
            settle_s = time.monotonic() - t2
    return {
        "workflows": args.workflows, "tasks": args.tasks, "agents": args.agents,
        "slots": args.slots, "keys_deleted": sum(d["keys"] for d in deleted),
        "start": start.to_json(), "peak": peak.to_json(), "end": end.to_json(),
        "end_over_start": round(end.size / start.size, 3),
        "run_s": round(ran_s, 1), "delete_s": round(delete_s, 1),
        "settle_s": round(settle_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflows", type=int, default=100)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=4,
                        help="workflows submitted (and waited for) at a time")
    parser.add_argument("--settle", type=float, default=180.0,
                        help="longest wait for compaction and defragmentation, seconds")
    parser.add_argument("--no-fsync", action="store_true", help="etcd --unsafe-no-fsync")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    mib = 1024 * 1024
    for phase in ("start", "peak", "end"):
        s = result[phase]
        print(f"{phase:<6} db {s['db_size'] / mib:8.1f} MiB, in use "
              f"{s['db_size_in_use'] / mib:8.1f} MiB")
    print(f"end / start {result['end_over_start']}; ran {result['run_s']}s, delete "
          f"{result['delete_s']}s ({result['keys_deleted']} keys), settled in "
          f"{result['settle_s']}s")


if __name__ == "__main__":
    main()
