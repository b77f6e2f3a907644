"""One very large workflow of trivial tasks, end to end, on a local mesh (issue 22).

Starts a :class:`~hypermesh.local.mesh.LocalMesh` (a real etcd and ``--agents`` agents
with ``--slots`` slots each, the product's ``lan`` timings), submits one experiment of
``--tasks`` samples whose command is ``true`` (batched: blocks of up to 256 tasks), and
follows it to its end through the summary the leader publishes (``progress/<wid>``,
read from etcd every ``--poll`` seconds). Meanwhile it samples every agent's resident
memory (RSS) and etcd's database size (``etcd_mvcc_db_total_size_in_bytes``). At the end
it times ``hypermesh status WID --json`` (and its peak RSS) and ``hypermesh tasks WID
--limit 10``, the CLI reads a workflow of this size takes.

Prints wall time (submit to the final state), tasks/s, each agent's peak RSS, etcd's
peak and final database size, and the CLI figures; asserts nothing about speed. With
``--deadline`` it stops following after that many seconds and reports how far the
workflow got (a rate to extrapolate from). Every process it starts is stopped before it
returns.

    .venv/bin/python scripts/bench_million.py [--tasks 1000000] [--agents 4] [--slots 4]
        [--deadline 3600] [--poll 5] [--no-fsync] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace

MiB = 1 << 20


def recipe_text(tasks: int) -> str:
    return (
        "name: million\n"
        "experiments:\n"
        "  noop:\n"
        f"    samples: {tasks}\n"
        "    command: ['true']\n"
    )


class Sampler(threading.Thread):
    """Every ``period`` seconds: each agent's RSS and etcd's database size; keeps peaks."""

    def __init__(self, pids: dict[str, int], etcd_url: str, period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.etcd_url = etcd_url
        self.period = period
        self.peak_rss: dict[str, int] = dict.fromkeys(pids, 0)
        self.peak_db = 0
        self.last_db = 0
        self.stop = threading.Event()

    def db_size(self) -> int:
        with urllib.request.urlopen(f"{self.etcd_url}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        found = re.search(r"^etcd_mvcc_db_total_size_in_bytes (\S+)$", text, re.M)
        return int(float(found.group(1))) if found else 0

    def run(self) -> None:
        while not self.stop.wait(self.period):
            for name, proc in self.procs.items():
                with contextlib.suppress(psutil.Error):
                    self.peak_rss[name] = max(self.peak_rss[name], proc.memory_info().rss)
            try:
                self.last_db = self.db_size()
                self.peak_db = max(self.peak_db, self.last_db)
            except OSError:
                pass


def timed_cli(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run the CLI; its wall time, peak RSS (sampled) and exit code."""
    start = time.perf_counter()
    proc = subprocess.Popen([*hypermesh_command(), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    peak = 0
    watched = psutil.Process(proc.pid)
    out: list[bytes] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None and time.perf_counter() - start < timeout:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, watched.memory_info().rss)
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(5)
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss_mib": round(peak / MiB),
            "exit": proc.returncode, "stdout_bytes": len(out[0]) if out else 0,
            "stderr": (proc.stderr.read() if proc.stderr else b"").decode()[-300:]}


async def follow(etcd_url: str, namespace: str, wid: str, deadline: float, poll: float,
                 log: Any) -> dict[str, Any]:
    """Read the leader's published summary until the workflow ends or ``deadline``."""
    ks = Keyspace(namespace)
    summary: dict[str, Any] = {}
    async with Etcd([etcd_url.split("//")[1]]) as etcd:
        while time.monotonic() < deadline:
            got = await etcd.get(ks.progress(wid))
            state = await etcd.get(ks.workflow_state(wid))
            if got is not None:
                summary = json.loads(got[0])
                exp = summary["experiments"]["noop"]
                print(f"  {time.strftime('%H:%M:%S')} {summary['state']}: "
                      f"{exp['succeeded']} succeeded, {exp['running']} running, "
                      f"{exp['failed']} failed", file=log, flush=True)
            if state is not None and json.loads(state[0])["state"] in (
                    "succeeded", "failed", "cancelled"):
                summary["state"] = json.loads(state[0])["state"]
                return summary
            await asyncio.sleep(poll)
    return summary


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hm-bench-million-") as tmp:
        root = Path(tmp)
        recipe = root / "million.yaml"
        recipe.write_text(recipe_text(args.tasks))
        mesh = LocalMesh(root / "mesh", agents=args.agents, slots=args.slots,
                         fsync=not args.no_fsync, agent_args=["--preset", "lan"])
        with mesh:
            env = {**os.environ, **mesh.env()}

            def leader() -> bool:
                out = subprocess.run([*hypermesh_command(), "nodes", "--json"], env=env,
                                     capture_output=True, text=True, timeout=60)
                return out.returncode == 0 and any(
                    n.get("leader") for n in json.loads(out.stdout or "[]"))

            wait_for(leader, 60, "a leader", interval=0.5)
            pids = {a.name: a.proc.pid for a in mesh.agents if a.proc is not None}
            sampler = Sampler(pids, mesh.etcd.url)
            sampler.start()
            start = time.perf_counter()
            done = subprocess.run([*hypermesh_command(), "submit", str(recipe)], env=env,
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"submit failed: {done.stderr}")
            wid = done.stdout.split()[-1]
            print(f"submitted {wid}: {args.tasks} tasks", file=log, flush=True)
            summary = asyncio.run(follow(mesh.etcd.url, mesh.namespace, wid,
                                         time.monotonic() + args.deadline, args.poll, log))
            wall = time.perf_counter() - start
            status = timed_cli(["status", wid, "--json"], env, 600)
            listing = timed_cli(["tasks", wid, "--limit", "10", "--json"], env, 600)
            sampler.stop.set()
            sampler.join(5)
            exp = summary.get("experiments", {}).get("noop", {})
            finished = exp.get("succeeded", 0) + exp.get("failed", 0)
            return {
                "tasks": args.tasks,
                "agents": args.agents,
                "slots": args.slots,
                "state": summary.get("state"),
                "finished": finished,
                "wall_s": round(wall, 1),
                "tasks_per_s": round(finished / wall, 1),
                "peak_rss_mib": {n: round(r / MiB) for n, r in sampler.peak_rss.items()},
                "etcd_db_peak_mib": round(sampler.peak_db / MiB, 1),
                "etcd_db_final_mib": round(sampler.last_db / MiB, 1),
                "status_cli": status,
                "tasks_limit_10_cli": listing,
            }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=1_000_000)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--deadline", type=float, default=3600.0,
                   help="stop following after this many seconds [3600]")
    p.add_argument("--poll", type=float, default=5.0)
    p.add_argument("--no-fsync", action="store_true",
                   help="start etcd with --unsafe-no-fsync (default: fsync on)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    log = sys.stderr if args.json else sys.stdout
    # A SIGTERM (a timeout) stops the mesh too: the context managers run on SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args, log)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
