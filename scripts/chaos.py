#!/usr/bin/env python3
"""Chaos: kill random agents (the leader included) while a workflow runs, then check
that every task succeeded exactly once and none is stuck.

    chaos.py [--agents 4] [--tasks 2000] [--task-seconds 0.05] [--kill-every 3] [--ttl 3]

Every ``--kill-every`` seconds a random agent is crashed (SIGKILL of the agent and
all its processes, as if its machine vanished) and started again under the same
name. Killing stops when the workflow is done or after ``--max-kills``. The
verdict comes from ``hypermesh tasks --json``; exit 0 only if every task has
exactly one successful attempt and the workflow succeeded within ``--deadline``.
Everything runs on 127.0.0.1 and is stopped at the end. The work directory (etcd's data,
each agent's work directory and log) is removed after a run that passed, and kept, with
its path printed, after one that did not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.mesh import LocalMesh


def cli(env: dict[str, str], *args: str, timeout: float = 60) -> Any:
    out = subprocess.run(
        [*hypermesh_command(), *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(out.stdout)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    root = Path(tempfile.mkdtemp(prefix="hm-chaos-"))
    ok = False
    mesh = LocalMesh(
        root,
        agents=opts.agents,
        slots=opts.slots,
        fsync=False,
        agent_args=["--lease-ttl", str(opts.ttl), "--watch", opts.watch],
    )
    try:
        mesh.start()  # stops what it started if it fails
    except BaseException:
        print(f"chaos: the mesh did not start; work directory kept at {root}", file=sys.stderr)
        raise
    try:
        env = dict(os.environ, **mesh.env())
        recipe = root / "chaos.yaml"
        recipe.write_text(
            "name: chaos\nexperiments:\n  work:\n"
            f"    samples: {opts.tasks}\n"
            + (f"    batch: {opts.batch}\n" if opts.batch else "")
            + (f"    workers: {opts.workers}\n" if opts.workers else "")
            + f"    command: ['sleep {opts.task_seconds}']\n"
        )
        submitted = subprocess.run(
            [*hypermesh_command(), "submit", str(recipe)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        wid = submitted.stdout.split()[-1]
        started = time.monotonic()
        kills: list[dict[str, Any]] = []
        next_kill = started + opts.kill_every
        state = "running"
        while time.monotonic() - started < opts.deadline:
            status = cli(env, "status", wid)
            state = status["state"]
            exp = status["experiments"]["work"]
            if state in ("succeeded", "failed", "cancelled"):
                break
            now = time.monotonic()
            if now >= next_kill and len(kills) < opts.max_kills:
                leader = next((n["name"] for n in cli(env, "nodes") if n["leader"]), None)
                victim = rng.choice(mesh.agents)
                victim.crash()
                kills.append(
                    {
                        "at": round(now - started, 2),
                        "node": victim.name,
                        "leader": victim.name == leader,
                        "done": exp["succeeded"],
                    }
                )
                print(
                    f"[{now - started:6.1f}s] killed {victim.name}"
                    f"{' (leader)' if victim.name == leader else ''}; "
                    f"{exp['succeeded']}/{exp['total']} done",
                    file=sys.stderr,
                )
                victim.start(wait=False)  # the kill cadence must not wait for restarts
                next_kill = now + opts.kill_every
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        tasks = cli(env, "tasks", wid, timeout=120)
        once = sum(1 for t in tasks if sum(a["state"] == "succeeded" for a in t["attempts"]) == 1)
        doubled = [
            t["id"] for t in tasks if sum(a["state"] == "succeeded" for a in t["attempts"]) > 1
        ]
        stuck = [t["id"] for t in tasks if t["state"] != "succeeded"]
        lost = sum(1 for t in tasks for a in t["attempts"] if a["reason"] == "node-lost")
        peak = most_at_once(tasks)
        ok = state == "succeeded" and once == opts.tasks and not doubled and not stuck and (
            not opts.workers or peak <= opts.workers)
        return {
            "workflow": wid,
            "state": state,
            "seconds": round(elapsed, 1),
            "tasks": opts.tasks,
            "succeeded_once": once,
            "succeeded_twice": doubled,
            "not_succeeded": stuck[:20],
            "not_succeeded_count": len(stuck),
            "node_lost_attempts": lost,
            "most_at_once": peak,
            "kills": kills,
            "leader_kills": sum(k["leader"] for k in kills),
            "ok": ok,
        }
    finally:
        mesh.close()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:  # the agents' logs and work directories, to see what went wrong
            print(f"chaos: work directory kept at {root}", file=sys.stderr)


def most_at_once(tasks: list[dict[str, Any]]) -> int:
    """The most attempts that ran at one instant, from their recorded starts and ends;
    attempts closed as lost are left out (a later holder records their end, after the
    attempt that replaced them started)."""
    spans = [(a["started_at"], a["ended_at"]) for t in tasks for a in t["attempts"]
             if a["reason"] != "node-lost" and a["started_at"] and a["ended_at"]]
    level = most = 0
    for _, delta in sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans]):
        level += delta
        most = max(most, level)
    return most


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--task-seconds", type=float, default=0.05)
    parser.add_argument("--kill-every", type=float, default=3.0)
    parser.add_argument("--max-kills", type=int, default=1000)
    parser.add_argument("--ttl", type=int, default=3, help="agents' lease TTL, seconds")
    parser.add_argument("--deadline", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--batch", type=int, default=None,
        help="tasks per block (1: per-task keys; default: chosen by the leader)",
    )
    parser.add_argument("--workers", type=int, default=None,
                        help="the experiment's workers cap; the run fails if more of its "
                        "attempts than that ran at once")
    parser.add_argument("--watch", choices=("all", "own", "auto"), default="all",
                        help="the agents' --watch (own: blocks from the leader's offers)")
    opts = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}", file=sys.stderr)
    report = run(opts)
    print(json.dumps(report, indent=2))
    print(
        f"chaos: {'OK' if report['ok'] else 'FAILED'}: {report['succeeded_once']}/{opts.tasks} "
        f"tasks succeeded exactly once in {report['seconds']}s with {len(report['kills'])} kills "
        f"({report['leader_kills']} of the leader)",
        file=sys.stderr,
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
