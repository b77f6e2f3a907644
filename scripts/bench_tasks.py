"""``hypermesh tasks`` of a large finished workflow: before and after paging (issue 22).

Starts a real etcd, writes one workflow of ``--tasks`` succeeded tasks straight into it
(blocks of 256 with one batch each, as agents leave them; no agent runs), then times
``tasks WID --limit 10`` and ``tasks WID --json > /dev/null`` ``--runs`` times each, in a
child process whose peak RSS it reports: "after" is the command as it is, "before" the
way it read before (the whole workflow into one view, then the rows cut). Prints the
medians; asserts nothing.

    .venv/bin/python scripts/bench_tasks.py [--tasks 200000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypermesh.local.etcd import EtcdServer
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace
from hypermesh.state.txns import expand_experiment

NAMESPACE = "bench"


def child(mode: str, wid: str, limit: int) -> None:
    """Run one listing (stdout to /dev/null) and print its peak RSS in KiB on stderr."""
    from hypermesh.cli.main import main

    if mode == "after":
        args = ["tasks", wid, "--json"] + (["--limit", str(limit)] if limit else [])
        try:
            main(args, standalone_mode=False)
        finally:
            sys.stderr.write(f"\nRSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\n")
        return
    from hypermesh.cli.common import load_view, print_json

    async def old() -> None:
        async with Etcd([os.environ["HYPERMESH_ETCD"].split("//")[1]]) as etcd:
            view = await load_view(etcd, Keyspace(NAMESPACE), wid)
        rows = view.task_rows(wid)
        print_json(rows[:limit] if limit else rows)

    asyncio.run(old())
    sys.stderr.write(f"\nRSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\n")


async def populate(url: str, tasks: int) -> str:
    from hypermesh.recipe.recipe import load_recipe
    from hypermesh.state.records import WorkflowRecord
    from hypermesh.state.txns import new_workflow_id, submit_workflow

    ks = Keyspace(NAMESPACE)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"name: big\nexperiments:\n  noop: {{samples: {tasks}, command: ['true']}}\n")
    wf = WorkflowRecord(id=new_workflow_id("big"), name="big", recipe=load_recipe(f.name, ()),
                        seed=1, submitted_at=time.time(), workdir="/tmp", source=f.name)
    async with Etcd([url.split("//")[1]]) as etcd:
        await submit_workflow(etcd, ks, wf)
        params = [{"x": i} for i in range(tasks)]
        assert await expand_experiment(etcd, ks, wf.id, "noop", params, block=256)
        now = time.time()
        ops = []
        for first in range(0, tasks, 256):
            rows = range(first, min(tasks, first + 256))
            batch = {"node": "node1",
                     "a": [[i, 1, "succeeded", 0, "exit", now, now] for i in rows],
                     "r": [[i, "succeeded", 1, 0, now] for i in rows]}
            key = ks.block_batch(BlockRef(wf.id, "noop", first), 1, 0)
            ops.append(etcd.op_put(key, json.dumps(batch).encode()))
            if len(ops) == 40:
                await etcd.txn([], ops)
                ops = []
        if ops:
            await etcd.txn([], ops)
        await etcd.put(ks.workflow_state(wf.id), json.dumps({"state": "succeeded"}).encode())
    return wf.id


def measure(mode: str, wid: str, limit: int, env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", mode, wid, str(limit)],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, check=True)
    wall = time.perf_counter() - start
    return wall, int(done.stderr.rsplit("RSS ", 1)[1])


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(Path(tmp), fsync=False) as etcd:
        wid = asyncio.run(populate(etcd.url, args.tasks))
        env = dict(os.environ, HYPERMESH_ETCD=etcd.url, HYPERMESH_NAMESPACE=NAMESPACE)
        for limit in (10, 0):
            for mode in ("before", "after"):
                runs = [measure(mode, wid, limit, env) for _ in range(args.runs)]
                wall = statistics.median(r[0] for r in runs)
                rss = statistics.median(r[1] for r in runs) / 1024
                what = f"--limit {limit}" if limit else "--json (all)"
                print(f"{args.tasks} tasks  {what:<13} {mode:<6} wall {wall:7.2f} s  "
                      f"peak RSS {rss:7.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
