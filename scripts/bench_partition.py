#!/usr/bin/env python3
"""Recovery across hosts when one is partitioned: etcd, a CLI host and agents each in a
network namespace of their own (``hypermesh/local/netns.py``), the agents listening on
their own 10.x addresses; the rounds are ``hypermesh/local/partitions.py``'s. Needs root.

    bench_partition.py [--runs 20] [--scenarios whole,etcd,peers] [--agents 3]
                       [--preset lan] [--tasks 4] [--seconds 6] [--no-settle] [--json]
                       [--logs]

Scenarios (``--scenarios``, comma-separated; the default is the first three):

- whole: the host's switch port down (nothing in or out);
- etcd: blackhole routes between the host and etcd (its peers and the CLI reach it);
- peers: blackhole routes between the host and every other agent (etcd reaches it);
- leader: the leader's host cut off while a two-stage workflow runs (a first stage of
  AGENTS x SLOTS tasks of 3 s, so the leader runs some, then 3 tasks of 0.5 s);
- etcd-member: on a mesh of its own with a three-member etcd cluster (started only for
  this scenario), the host of the member leading raft cut off while 2 x AGENTS x SLOTS
  tasks of 2 s run.

Each of whole, etcd and peers submits TASKS tasks of SECONDS each, cuts the agent holding
most of them, waits for the workflow to finish, heals and waits for the agent to rejoin.
Printed per scenario: the time from the cut to each moved task's new attempt start
(``started_at`` in ``hypermesh tasks --json``), median and p95; when the cut agent's own
task processes were all gone; held tasks that never moved.

leader: when the client host first saw another leader (median, p95, max, and the rounds
over the leader TTL + 1 s); in how many rounds the old leader had both lost its node lease
and let its candidacy lapse before the heal (it could write nothing stale after it); and
rounds where it did not rejoin as a follower.

etcd-member: when the client host saw the other members' new leader (median, max); failed
tasks, attempts run again, agents that lost their lease or exited.

Before each round the bench waits until every agent is alive and healthy in gossip
(``--no-settle``: it does not): the members whose probes a cut failed carry a raised
Lifeguard local health for several seconds after the heal, which stretches their probes.

Every scenario counts lost (not succeeded) and doubly-succeeded tasks; the exit status is
1 when there is any. Each round prints one line to stderr; ``--json`` prints every round.
Everything is torn down at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypermesh.config import AgentConfig
from hypermesh.local.netns import NetLab, NetMesh, sweep_leftovers, unavailable
from hypermesh.local.partitions import (
    SCENARIOS,
    LeaderResult,
    MemberResult,
    RoundResult,
    leader_round,
    member_round,
    partition_round,
    settled,
)
from hypermesh.local.processes import wait_for

AGENT_NAMES = ("onprem", "cloud-a", "cloud-b", "cloud-c", "cloud-d", "cloud-e")
ALL_SCENARIOS = (*SCENARIOS, "leader", "etcd-member")
PRESETS: dict[str, Callable[[], AgentConfig]] = {"lan": AgentConfig.lan,
                                                 "local": AgentConfig.local}


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"median": None, "p95": None, "max": None}
    return {"median": statistics.median(xs), "p95": p95(xs), "max": max(xs)}


def fmt(d: dict[str, float | None]) -> str:
    return ("n/a" if d["median"] is None else
            f"median {d['median']:.2f}s p95 {d['p95']:.2f}s max {d['max']:.2f}s")


def secs(t: float | None, sign: str = "") -> str:
    return "never" if t is None else f"{t:{sign}.2f}s"


def summary(rounds: list[RoundResult]) -> dict[str, Any]:
    moved = [t for r in rounds for t in r.moved.values()]
    stopped = [r.stopped for r in rounds if r.stopped is not None]
    rejoined = [r.rejoined for r in rounds if r.rejoined is not None]
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


def leader_summary(rounds: list[LeaderResult], leader_ttl: float) -> dict[str, Any]:
    elected = [r.elected for r in rounds if r.elected is not None]
    return {
        "runs": len(rounds),
        "leader_ttl": leader_ttl,
        "elected_s": stats(elected),
        # no other leader seen, or seen later than the bar
        "over_ttl_plus_1": sum(r.elected is None or r.elected > leader_ttl + 1
                               for r in rounds),
        "stopped_before_heal": sum(r.stopped_before_heal for r in rounds),
        "not_rejoined": sum(r.rejoined is None for r in rounds),
        "lost": sum(len(r.lost) for r in rounds),
        "doubled": sum(len(r.doubled) for r in rounds),
    }


def member_summary(rounds: list[MemberResult]) -> dict[str, Any]:
    return {
        "runs": len(rounds),
        "reelected_s": stats([r.reelected for r in rounds]),
        "failed": sum(len(r.failed) for r in rounds),
        "rerun": sum(r.rerun for r in rounds),
        "leases_lost": sum(len(r.leases_lost) for r in rounds),
        "exited": sum(len(r.exited) for r in rounds),
        "lost": sum(len(r.lost) for r in rounds),
        "doubled": sum(len(r.doubled) for r in rounds),
    }


def run_round(mesh: NetMesh, scenario: str, args: argparse.Namespace
              ) -> tuple[RoundResult | LeaderResult | MemberResult, str, list[str]]:
    """One round of ``scenario``: its result, its line, and the log lines ``--logs``
    shows (the cut agent's; for etcd-member, every agent's warnings)."""
    slots = args.agents * args.slots
    if scenario == "leader":
        lr = leader_round(mesh, tasks=slots)
        shown = next((end for _, end, who in lr.polls if who == lr.new), None)
        return lr, (
            f"{lr.old} -> {lr.new} seen after {secs(lr.elected)}, named by `nodes` after "
            f"{secs(shown)}; old leader lost its lease at {secs(lr.lost_lease, '+')}, "
            f"candidacy lapsed at {secs(lr.lapsed, '+')}, healed at {secs(lr.healed, '+')}: "
            f"stopped leading before the heal: {'yes' if lr.stopped_before_heal else 'NO'}; "
            f"workflow {lr.state}; lost {len(lr.lost)}, doubled {len(lr.doubled)}; rejoined "
            f"as follower {secs(lr.rejoined)} after the heal"), lr.log
    if scenario == "etcd-member":
        mr = member_round(mesh, tasks=2 * slots, running=slots)
        return mr, (
            f"{mr.member} (raft leader) -> {mr.after} seen after {mr.reelected:.2f}s; "
            f"workflow {mr.state} at +{mr.finished:.1f}s; failed {len(mr.failed)}, run again "
            f"{mr.rerun}, lost {len(mr.lost)}, doubled {len(mr.doubled)}; leases lost: "
            f"{', '.join(mr.leases_lost) or 'none'}; exited: {', '.join(mr.exited) or 'none'}; "
            f"back {mr.back:.1f}s after the heal, {len(mr.refused)} CLI calls refused"
        ), [f"{n}: {line}" for n, lines in mr.trouble.items() for line in lines]
    r = partition_round(mesh, scenario, tasks=args.tasks, seconds=args.seconds)
    moved = ", ".join(f"{t:.2f}s" for t in sorted(r.moved.values()))
    return r, (
        f"{r.victim} held {len(r.held)}; moved after [{moved}], kept {len(r.kept)}; its "
        f"tasks stopped after {secs(r.stopped)}; lost {len(r.lost)}, doubled "
        f"{len(r.doubled)}; listed {' -> '.join(r.seen)}; revokes: "
        f"{'; '.join(r.revokes) or 'none'}; rejoined {secs(r.rejoined)} after the heal; "
        f"later life reached by {'; '.join(r.reached) or 'none'}"), r.log


def run_mesh(root: Path, etcd_members: int, scenarios: list[str], args: argparse.Namespace,
             results: dict[str, list[Any]]) -> None:
    """Start a mesh in a lab of its own, run every round of ``scenarios`` on it, tear
    it all down (also when a round fails)."""
    with NetLab() as lab:
        mesh = NetMesh(lab, root, preset=args.preset, etcd_members=etcd_members)
        try:
            mesh.start_etcd()
            for name in AGENT_NAMES[: args.agents]:
                mesh.add_agent(name, slots=args.slots)
            for scenario in scenarios:
                for i in range(args.runs):
                    if args.settle:  # each cut hits a settled mesh, as a real one would
                        wait_for(lambda: settled(mesh), 90, "the mesh to settle", interval=0.3)
                    result, line, log = run_round(mesh, scenario, args)
                    results[scenario].append(result)
                    print(f"{scenario} {i + 1}: {line}", file=sys.stderr)
                    if args.logs:
                        print("\n".join(f"    {x}" for x in log), file=sys.stderr)
        finally:
            mesh.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20, help="rounds per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"any of {', '.join(ALL_SCENARIOS)}")
    parser.add_argument("--agents", type=int, default=3, choices=range(2, 7))
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--preset", choices=tuple(PRESETS), default="lan")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0, help="each task's length")
    parser.add_argument("--json", action="store_true", help="every round, as JSON")
    parser.add_argument("--work-dir", type=Path,
                        help="keep every log here (default: a temporary directory)")
    parser.add_argument("--no-settle", dest="settle", action="store_false",
                        help="start each round as soon as the last one ended (before "
                             "2026-11-26 morning), not once every agent is alive and "
                             "healthy in gossip again")
    parser.add_argument("--logs", action="store_true",
                        help="print the cut agent's log lines of each round (stderr)")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in ALL_SCENARIOS:
            parser.error(f"--scenarios: {s!r} is not one of {', '.join(ALL_SCENARIOS)}")
    reason = unavailable()
    if reason is not None:
        print(f"bench_partition: {reason}", file=sys.stderr)
        return 2
    sweep_leftovers()
    leader_ttl = float(PRESETS[args.preset]().leader_ttl)

    results: dict[str, list[Any]] = {s: [] for s in scenarios}
    with tempfile.TemporaryDirectory(prefix="hm-partition-") as tmp:
        root = args.work_dir or Path(tmp)
        single = [s for s in scenarios if s != "etcd-member"]
        if single:
            run_mesh(root, 1, single, args, results)
        if "etcd-member" in scenarios:
            run_mesh(root / "etcd-member", 3, ["etcd-member"], args, results)

    summaries: dict[str, dict[str, Any]] = {}
    for s, rs in results.items():
        summaries[s] = (leader_summary(rs, leader_ttl) if s == "leader" else
                        member_summary(rs) if s == "etcd-member" else summary(rs))
    if args.json:
        print(json.dumps({
            "preset": args.preset, "agents": args.agents, "slots": args.slots,
            "tasks": args.tasks, "seconds": args.seconds, "summary": summaries,
            "rounds": {s: [dataclasses.asdict(r) for r in rs] for s, rs in results.items()},
        }, indent=2))
    else:
        for s, sm in summaries.items():
            if s == "leader":
                print(f"leader: {sm['runs']} runs, new leader seen {fmt(sm['elected_s'])}, "
                      f"{sm['over_ttl_plus_1']} over the leader TTL + 1 s "
                      f"({leader_ttl + 1:g}s); old leader stopped leading before the heal "
                      f"in {sm['stopped_before_heal']}; lost {sm['lost']}, doubled "
                      f"{sm['doubled']}, not rejoined {sm['not_rejoined']}")
            elif s == "etcd-member":
                d = sm["reelected_s"]
                reelected = ("n/a" if d["median"] is None
                             else f"median {d['median']:.2f}s max {d['max']:.2f}s")
                print(f"etcd-member: {sm['runs']} runs, re-elected {reelected}; failed "
                      f"{sm['failed']}, attempts run again {sm['rerun']}, leases lost "
                      f"{sm['leases_lost']}, agents exited {sm['exited']}; lost {sm['lost']}, "
                      f"doubled {sm['doubled']}")
            else:
                print(f"{s}: {sm['runs']} runs, {sm['held']} held, {sm['moved']} moved "
                      f"({fmt(sm['moved_s'])}), {sm['kept']} kept; own tasks stopped "
                      f"{fmt(sm['stopped_s'])}; lost {sm['lost']}, doubled {sm['doubled']}, "
                      f"not rejoined {sm['not_rejoined']}, revokes of uncut nodes "
                      f"{sm['revokes_of_others']}")
    bad = any(sm["lost"] or sm["doubled"] for sm in summaries.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
