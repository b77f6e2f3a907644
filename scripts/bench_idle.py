#!/usr/bin/env python3
"""Resource use of idle agents: RSS and CPU of each agent in an idle N-agent mesh.

    bench_idle.py [--agents 5] [--seconds 30]

Starts etcd and N agents (default lan settings, gossip on), lets them settle,
then samples each agent's CPU time over ``--seconds`` and its RSS at the end.
The gossip issue's bar: RSS <= 80 MB and CPU <= 0.5 % of a core per agent.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from hypermesh.local.mesh import LocalMesh


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="hm-idle-"))
    with LocalMesh(root, agents=opts.agents, slots=2, agent_args=["--preset", "lan"]) as mesh:
        time.sleep(opts.settle)
        procs = [psutil.Process(a.proc.pid) for a in mesh.agents if a.proc is not None]
        before = [p.cpu_times() for p in procs]
        time.sleep(opts.seconds)
        after = [p.cpu_times() for p in procs]
        rss = [p.memory_info().rss / 2**20 for p in procs]
    shutil.rmtree(root, ignore_errors=True)  # kept when the run failed, for its logs
    cpu = [
        100 * ((b.user + b.system) - (a.user + a.system)) / opts.seconds
        for a, b in zip(before, after, strict=True)
    ]
    for agent, r, c in zip(mesh.agents, rss, cpu, strict=True):
        print(f"{agent.name}: RSS {r:.1f} MB, CPU {c:.2f} % of a core")
    print(
        f"median RSS {statistics.median(rss):.1f} MB (max {max(rss):.1f}), "
        f"median CPU {statistics.median(cpu):.2f} % (max {max(cpu):.2f}) over {opts.seconds:g} s"
    )
    if opts.json:
        print(json.dumps({"rss_mb": rss, "cpu_percent": cpu, "seconds": opts.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
