#!/usr/bin/env python3
"""What telemetry and /metrics cost an agent.

    bench_telemetry.py [--seconds 60] [--agents-per-group 2] [--processes 8]

1. The sampler in this process: CPU per sample with no tasks, and with
   ``--processes`` task process trees (each a shell with a ``sleep`` child).
2. An idle mesh (lan preset) with two groups of agents side by side, so both see
   the same machine load: one samples every 5 s (the default), the other every
   3600 s (telemetry effectively off). The difference of their CPU is what
   sampling costs an idle agent.
3. One ``/metrics`` scrape: wall time and size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from hypermesh.agent.ops.gpus import open_gpus
from hypermesh.agent.ops.telemetry import Sampler, TaskRoot
from hypermesh.local.mesh import LocalMesh


def sampler_cost(processes: int, samples: int = 200) -> tuple[float, float]:
    """CPU milliseconds per sample without tasks and with ``processes`` task trees."""
    sampler = Sampler(Path(tempfile.gettempdir()), open_gpus())
    procs = [
        subprocess.Popen(["/bin/sh", "-c", "sleep 600; :"]) for _ in range(processes)
    ]
    roots = [TaskRoot(f"w.e.{i}", 1, p.pid) for i, p in enumerate(procs)]
    try:
        costs = []
        for task_roots in ([], roots):
            start = time.process_time()
            for _ in range(samples):
                sampler.sample(task_roots)
            costs.append(1000 * (time.process_time() - start) / samples)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        sampler.close()
    return costs[0], costs[1]


def agent_cpu(procs: list[psutil.Process], seconds: float) -> list[float]:
    before = [p.cpu_times() for p in procs]
    time.sleep(seconds)
    after = [p.cpu_times() for p in procs]
    return [
        100 * ((b.user + b.system) - (a.user + a.system)) / seconds
        for a, b in zip(before, after, strict=True)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--agents-per-group", type=int, default=2)
    parser.add_argument("--processes", type=int, default=8)
    opts = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}; load average {os.getloadavg()[0]:.2f}")
    idle, busy = sampler_cost(opts.processes)
    print(f"sampler: {idle:.2f} ms CPU per sample without tasks, {busy:.2f} ms with "
          f"{opts.processes} task process trees")
    root = Path(tempfile.mkdtemp(prefix="hm-telemetry-"))
    with LocalMesh(root, agents=0, agent_args=["--preset", "lan"]) as mesh:
        groups: dict[str, list[psutil.Process]] = {"every 5 s": [], "every 3600 s": []}
        for i in range(opts.agents_per_group):
            for label, period in (("every 5 s", "5"), ("every 3600 s", "3600")):
                a = mesh.add_agent(f"{period}s-{i}", extra=["--telemetry-period", period])
                assert a.proc is not None
                groups[label].append(psutil.Process(a.proc.pid))
        time.sleep(5)  # settle
        everyone = [p for procs in groups.values() for p in procs]
        cpu = dict(zip(everyone, agent_cpu(everyone, opts.seconds), strict=True))
        for label, procs in groups.items():
            values = [cpu[p] for p in procs]
            print(f"idle agents sampling {label}: CPU median {statistics.median(values):.3f} % "
                  f"of a core (each: {', '.join(f'{v:.3f}' for v in values)}) over "
                  f"{opts.seconds:g} s")
        address = (mesh.agents[0].work_dir / "agent.metrics").read_text().strip()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
                body = reply.read()
            times.append(1000 * (time.perf_counter() - start))
        print(f"/metrics scrape: median {statistics.median(times):.1f} ms, {len(body)} bytes")
    shutil.rmtree(root, ignore_errors=True)  # kept when the run failed, for its logs
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
