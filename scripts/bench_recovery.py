#!/usr/bin/env python3
"""Recovery and leader-failover times of a local mesh with default (lan) settings.

    bench_recovery.py [--kills 20] [--failovers 10] [--agents 3] [--tls]

recovery: crash (SIGKILL the agent and its processes) a node that holds running
tasks; time from the kill to each of those tasks running again on a survivor
(the new attempt's ``started_at``). The crashed node is restarted between kills, and
the next kill waits until every node is alive and healthy in gossip (``--no-settle``:
at once).
The bar: at most one lease TTL (10 s) + 1 s.

failover: crash the leader, submit a one-task workflow at once; time from the
kill to that task's first attempt starting. The bar: 3 s median.

Medians and p95 are printed (and ``--json`` gives every sample). Everything runs
on 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypermesh.cli.common import load_view
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.agents import AgentProcess, hypermesh_command
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace


def tasks_of(env: dict[str, str], wid: str) -> list[dict[str, Any]]:
    """``hypermesh tasks WID --json``, read in-process: polling through a new CLI
    process every 0.25 s would itself load the 2-core machine and skew the timings."""

    async def read() -> list[dict[str, Any]]:
        ks = Keyspace(env["HYPERMESH_NAMESPACE"])
        async with Etcd(parse_endpoints(env["HYPERMESH_ETCD"])) as etcd:
            view = await load_view(etcd, ks, wid)
        return [view.task_json(ref) for ref in view.task_refs(wid)]

    return asyncio.run(read())


def cli(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run(
        [*hypermesh_command(), *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def submit(env: dict[str, str], recipe: Path) -> str:
    out = subprocess.run(
        [*hypermesh_command(), "submit", str(recipe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.split()[-1]


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def settled(env: dict[str, str]) -> bool:
    """Every node listed alive in gossip with a local health of 0."""
    nodes = cli(env, "nodes")
    return all(n["gossip"] == "alive" and (n["load"] or {}).get("health", 0) == 0
               for n in nodes)


def recovery(
    mesh: LocalMesh,
    env: dict[str, str],
    root: Path,
    kills: int,
    rng: random.Random,
    stop: bool = False,
    settle: bool = True,
) -> list[float]:
    recipe = root / "hold.yaml"
    slots = mesh.slots * len(mesh.agents)
    # Leave a node's worth of slots free so a dead node's tasks have somewhere to go.
    recipe.write_text(
        f"experiments:\n  hold:\n    samples: {slots - mesh.slots}\n    command: ['sleep 3600']\n"
    )
    wid = submit(env, recipe)
    wait_for(
        lambda: all(t["state"] == "running" for t in tasks_of(env, wid)), 60, "tasks to run"
    )
    samples: list[float] = []
    for i in range(kills):
        tasks = tasks_of(env, wid)
        busy = sorted({t["node"] for t in tasks if t["state"] == "running"})
        victim_name = rng.choice(busy)
        held = {t["id"]: len(t["attempts"]) for t in tasks if t["node"] == victim_name}
        victim = next(a for a in mesh.agents if a.name == victim_name)
        killed_at = time.time()
        if stop:
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGSTOP)  # silence: nothing is refused
        else:
            victim.crash()

        def moved(
            held: dict[str, int] = held,
            victim_name: str = victim_name,
            killed_at: float = killed_at,
        ) -> list[float] | None:
            now = {t["id"]: t for t in tasks_of(env, wid)}
            starts = []
            for task_id, n in held.items():
                attempts = now[task_id]["attempts"]
                if len(attempts) <= n or attempts[-1]["node"] == victim_name:
                    return None
                starts.append(attempts[-1]["started_at"] - killed_at)
            return starts

        starts = wait_for(moved, 60, f"tasks of {victim_name} to move", interval=0.25)
        samples.extend(starts)  # type: ignore[arg-type]
        print(
            f"kill {i + 1}: {victim_name} held {len(held)}; running again after "
            + ", ".join(f"{s:.2f}s" for s in starts),
            file=sys.stderr,
        )  # type: ignore[union-attr]
        if stop:
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGCONT)

            # Back, it finds its lease revoked, kills its orphans, rejects its own
            # late results and rejoins. The next round starts from a settled mesh, as
            # a real preemption would find it: every member alive and healthy again
            # (the resumed node's local health rose while it was stopped and refuted).
            def rejoined(name: str = victim_name, agent: AgentProcess = victim) -> bool:
                nodes = cli(env, "nodes")
                listed = {n["name"]: n["gossip"] for n in nodes}
                healthy = all((n["load"] or {}).get("health", 0) == 0 for n in nodes)
                return (
                    listed.get(name) == "alive"
                    and healthy
                    and "rejoined" in agent.log_tail(4000)
                )

            wait_for(rejoined, 90, f"{victim_name} to rejoin and the mesh to settle")
        else:
            victim.start()
            if settle:
                # The next crash hits a settled mesh, as a real one would: every member
                # alive and healthy in gossip. Back to back, the restarted agent (70 ms
                # old, still starting) is the one indirect prober the refused fast path
                # waits for, which measures its start-up rather than the recovery.
                wait_for(lambda: settled(env), 60, "the mesh to settle after the restart")
    subprocess.run([*hypermesh_command(), "cancel", wid], env=env, capture_output=True, check=True)
    return samples


def failover(mesh: LocalMesh, env: dict[str, str], root: Path, rounds: int) -> list[float]:
    recipe = root / "one.yaml"
    recipe.write_text("experiments:\n  one:\n    command: ['true']\n")
    samples = []
    for i in range(rounds):
        leader = wait_for(
            lambda: next((n["name"] for n in cli(env, "nodes") if n["leader"]), None),
            30,
            "a leader",
        )
        victim = next(a for a in mesh.agents if a.name == leader)
        killed_at = time.time()
        victim.crash()
        wid = submit(env, recipe)

        def started(wid: str = wid) -> float | None:
            attempts = tasks_of(env, wid)
            if attempts and attempts[0]["attempts"]:
                return float(attempts[0]["attempts"][0]["started_at"])
            return None

        first = wait_for(started, 60, "the new workflow's task to start", interval=0.1)
        samples.append(first - killed_at)  # type: ignore[operator]
        print(
            f"failover {i + 1}: leader {leader} killed; new task running after {samples[-1]:.2f}s",
            file=sys.stderr,
        )
        victim.start()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--signal",
        choices=["kill", "stop"],
        default="kill",
        help="kill: SIGKILL the node and its processes; stop: SIGSTOP it (silence), then SIGCONT",
    )
    parser.add_argument("--no-settle", dest="settle", action="store_false",
                        help="kill the next node right after restarting the last one "
                             "(the method before 2026-11-26), not once the mesh settled")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS on every gRPC connection (a mesh CA made for the run)")
    parser.add_argument("--watch", choices=("all", "own", "auto"), default="all",
                        help="the agents' --watch (own: blocks from the leader's offers)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true",
                        help="keep the mesh's folder (agents' logs) after a run that finished; "
                        "one that failed always keeps it")
    opts = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="hm-recovery-"))
    # Default settings: the lan preset (lease TTL 10 s, leader TTL 2 s).
    mesh = LocalMesh(root, agents=opts.agents, slots=opts.slots,
                     agent_args=["--preset", "lan", "--watch", opts.watch], tls=opts.tls)
    mesh.start()
    finished = False
    try:
        env = dict(os.environ, **mesh.env())
        rng = random.Random(opts.seed)
        stop = opts.signal == "stop"
        rec = recovery(mesh, env, root, opts.kills, rng, stop, opts.settle) if opts.kills else []
        fail = failover(mesh, env, root, opts.failovers) if opts.failovers else []
        finished = True
    finally:
        mesh.close()
        if finished and not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:  # the agents' logs, to see why a round was slow or what went wrong
            print(f"work directory kept at {root}", file=sys.stderr)
    report: dict[str, Any] = {"tls": opts.tls}
    if rec:
        report["recovery"] = {
            "signal": opts.signal,
            "samples": len(rec),
            "median_s": statistics.median(rec),
            "p95_s": p95(rec),
            "max_s": max(rec),
            "all": [round(s, 3) for s in rec],
        }
        print(
            f"recovery after SIG{opts.signal.upper()} over {len(rec)} tasks of {opts.kills} "
            f"rounds: median {statistics.median(rec):.2f}s, p95 {p95(rec):.2f}s, "
            f"max {max(rec):.2f}s"
        )
    if fail:
        report["failover"] = {
            "samples": len(fail),
            "median_s": statistics.median(fail),
            "p95_s": p95(fail),
            "all": [round(s, 3) for s in fail],
        }
        print(
            f"leader failover over {len(fail)} kills: median {statistics.median(fail):.2f}s, "
            f"p95 {p95(fail):.2f}s (bar: 3 s median)"
        )
    if opts.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
