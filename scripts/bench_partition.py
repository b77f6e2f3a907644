#!/usr/bin/env python3
"""Recovery across hosts when one is partitioned: etcd, a CLI host and agents each in a
network namespace of their own (``hypermesh/local/netns.py``), the agents listening on
their own 10.x addresses. Needs root.

    bench_partition.py [--runs 20] [--scenarios whole,etcd,peers] [--agents 3]
                       [--preset lan] [--tasks 4] [--seconds 6] [--json] [--logs]

Each run submits TASKS tasks of SECONDS each, cuts the agent holding most of them, waits
for the workflow to finish, heals and waits for the agent to rejoin:

- whole: the host's switch port down (nothing in or out);
- etcd: blackhole routes between the host and etcd (its peers and the CLI reach it);
- peers: blackhole routes between the host and every other agent (etcd reaches it).

Printed per scenario: the time from the cut to each moved task's new attempt start
(``started_at`` in ``hypermesh tasks --json``), median and p95; when the cut agent's own
task processes were all gone; held tasks that never moved; and the counts of lost and
doubly-succeeded tasks. ``--json`` prints every round. Everything is torn down at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypermesh.local.netns import (
    SCENARIOS,
    NetLab,
    NetMesh,
    RoundResult,
    partition_round,
    sweep_leftovers,
    unavailable,
)

AGENT_NAMES = ("onprem", "cloud-a", "cloud-b", "cloud-c", "cloud-d", "cloud-e")


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summary(rounds: list[RoundResult]) -> dict[str, Any]:
    moved = [t for r in rounds for t in r.moved.values()]
    stopped = [r.stopped for r in rounds if r.stopped is not None]
    rejoined = [r.rejoined for r in rounds if r.rejoined is not None]

    def stats(xs: list[float]) -> dict[str, float | None]:
        if not xs:
            return {"median": None, "p95": None, "max": None}
        return {"median": statistics.median(xs), "p95": p95(xs), "max": max(xs)}

    return {
        "runs": len(rounds),
        "held": sum(len(r.held) for r in rounds),
        "moved": len(moved),
        "kept": sum(len(r.kept) for r in rounds),
        "lost": sum(len(r.lost) for r in rounds),
        "doubled": sum(len(r.doubled) for r in rounds),
        "not_rejoined": sum(r.rejoined is None for r in rounds),
        # revokes of a node that was never cut: false deaths
        "revokes_of_others": sum(not rv.split(" -> ")[1].startswith(f"{r.victim} ")
                                 for r in rounds for rv in r.revokes),
        "moved_s": stats(moved),
        "stopped_s": stats(stopped),
        "rejoined_s": stats(rejoined),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20, help="rounds per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--agents", type=int, default=3, choices=range(2, 7))
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--preset", choices=("lan", "local"), default="lan")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0, help="each task's length")
    parser.add_argument("--json", action="store_true", help="every round, as JSON")
    parser.add_argument("--work-dir", type=Path,
                        help="keep every log here (default: a temporary directory)")
    parser.add_argument("--logs", action="store_true",
                        help="print the cut agent's log lines of each round (stderr)")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            parser.error(f"--scenarios: {s!r} is not one of {', '.join(SCENARIOS)}")
    reason = unavailable()
    if reason is not None:
        print(f"bench_partition: {reason}", file=sys.stderr)
        return 2
    sweep_leftovers()

    results: dict[str, list[RoundResult]] = {s: [] for s in scenarios}
    with tempfile.TemporaryDirectory(prefix="hm-partition-") as tmp, NetLab() as lab:
        mesh = NetMesh(lab, args.work_dir or Path(tmp), preset=args.preset)
        try:
            mesh.start_etcd()
            for name in AGENT_NAMES[: args.agents]:
                mesh.add_agent(name, slots=args.slots)
            for scenario in scenarios:
                for i in range(args.runs):
                    r = partition_round(mesh, scenario, tasks=args.tasks, seconds=args.seconds)
                    results[scenario].append(r)
                    moved = ", ".join(f"{t:.2f}s" for t in sorted(r.moved.values()))
                    stopped = "never" if r.stopped is None else f"{r.stopped:.2f}s"
                    print(f"{scenario} {i + 1}: {r.victim} held {len(r.held)}; moved after "
                          f"[{moved}], kept {len(r.kept)}; its tasks stopped after {stopped}; "
                          f"lost {len(r.lost)}, doubled {len(r.doubled)}; listed "
                          f"{' -> '.join(r.seen)}; revokes: {'; '.join(r.revokes) or 'none'}",
                          file=sys.stderr)
                    if args.logs:
                        print("\n".join(f"    {line}" for line in r.log), file=sys.stderr)
        finally:
            mesh.close()

    summaries = {s: summary(rs) for s, rs in results.items()}
    if args.json:
        print(json.dumps({
            "preset": args.preset, "agents": args.agents, "slots": args.slots,
            "tasks": args.tasks, "seconds": args.seconds, "summary": summaries,
            "rounds": {s: [dataclasses.asdict(r) for r in rs] for s, rs in results.items()},
        }, indent=2))
    else:
        for s, sm in summaries.items():
            def fmt(d: dict[str, float | None]) -> str:
                return ("n/a" if d["median"] is None else
                        f"median {d['median']:.2f}s p95 {d['p95']:.2f}s max {d['max']:.2f}s")
            print(f"{s}: {sm['runs']} runs, {sm['held']} held, {sm['moved']} moved "
                  f"({fmt(sm['moved_s'])}), {sm['kept']} kept; own tasks stopped "
                  f"{fmt(sm['stopped_s'])}; lost {sm['lost']}, doubled {sm['doubled']}, "
                  f"not rejoined {sm['not_rejoined']}, revokes of uncut nodes "
                  f"{sm['revokes_of_others']}")
    bad = any(sm["lost"] or sm["doubled"] for sm in summaries.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
