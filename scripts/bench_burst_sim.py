#!/usr/bin/env python3
"""Simulate a sweep on a static pool plus a burst pool, driven by the real policy.

The leader's policy (``hypermesh.agent.burst.policy.decide``) runs every tick on
a simulated clock; everything around it is simulated: nodes boot after a delay,
spot nodes are preempted at random (a Poisson rate per node-hour; the task they
ran is lost and runs again), spot launches are refused at random (the node then
starts on-demand, as ``launch_with_fallback`` does), and every node is billed
from launch to release at the price table's rate.

Scenarios (same seed each): ``hybrid-spot`` (burst pool asks for spot),
``hybrid-on-demand`` (the same burst pool, on-demand only) and ``static-only``.

    python scripts/bench_burst_sim.py                  # the figures in docs/benchmarks.md
    python scripts/bench_burst_sim.py --json --seeds 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from hypermesh.agent.burst.policy import (
    Backlog,
    BurstConfig,
    Forget,
    Launch,
    NodeState,
    PoolHistory,
    Release,
    Snapshot,
    Starting,
    decide,
)
from hypermesh.state.pools import Pool


@dataclass
class Node:
    name: str
    pool: str
    spot: bool
    launched_at: float
    up_at: float
    task_ends: float | None = None
    idle_since: float = 0.0


@dataclass
class Result:
    scenario: str
    seed: int
    hours: float
    cost: float
    on_demand_cost: float
    node_hours: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    refusals: int = 0
    lost_task_hours: float = 0.0
    peak_burst_nodes: int = 0


def simulate(scenario: str, args: argparse.Namespace, seed: int) -> Result:
    rng = random.Random(seed)
    cfg = BurstConfig.lan(tick_s=args.tick)
    pools = {"onprem": Pool("onprem", price=args.static_price)}
    if scenario != "static-only":
        pools["cloud"] = Pool("cloud", kind="ec2", price=args.on_demand_price,
                              spot_price=args.spot_price, spot=scenario == "hybrid-spot",
                              max_nodes=args.max_burst, idle_timeout=args.idle_timeout,
                              options={"image_id": "ami-sim"})
    nodes: dict[str, Node] = {
        f"onprem-{i}": Node(f"onprem-{i}", "onprem", False, 0.0, 0.0) for i in range(args.static)
    }
    pending, done, now = args.tasks, 0, 0.0
    backlog_since: float | None = None
    preempted_at: list[float] = []
    refused_at: float | None = None
    seq = 0
    result = Result(scenario, seed, 0.0, 0.0, 0.0)
    seconds: dict[tuple[str, bool], float] = {}
    dt = args.tick
    while done < args.tasks:
        now += dt
        vanished: list[tuple[str, str]] = []
        for n in list(nodes.values()):
            key = (n.pool, n.spot)
            seconds[key] = seconds.get(key, 0.0) + dt
            if n.task_ends is not None and n.task_ends <= now:
                done += 1
                n.task_ends, n.idle_since = None, now
            if n.spot and n.up_at <= now and rng.random() < 1 - math.exp(
                -args.preemption_rate * dt / 3600
            ):
                if n.task_ends is not None:
                    pending += 1
                    result.lost_task_hours += (args.task_s - (n.task_ends - now)) / 3600
                del nodes[n.name]
                vanished.append((n.name, n.pool))
                preempted_at.append(now)
                result.preemptions += 1
        up = [n for n in nodes.values() if n.up_at <= now]
        for n in sorted(up, key=lambda n: (n.pool != "onprem", n.name)):
            if pending and n.task_ends is None:
                pending -= 1
                n.task_ends = now + args.task_s
        if pending and backlog_since is None:
            backlog_since = now
        elif not pending:
            backlog_since = None
        snap = Snapshot(
            pools=pools,
            nodes=tuple(
                NodeState(n.name, n.pool, n.spot, 1, int(n.task_ends is not None),
                          0.0 if n.task_ends is not None else now - n.idle_since,
                          n.pool == "cloud")
                for n in up
            ),
            starting=tuple(Starting(n.name, n.pool, n.spot, now - n.launched_at)
                           for n in nodes.values() if n.up_at > now),
            backlog=(Backlog("sweep", pending, now - backlog_since, args.task_s,
                             tuple(pools)),) if pending and backlog_since is not None else (),
            history={"cloud": PoolHistory(
                tuple(now - t for t in preempted_at if now - t < cfg.preemption_window_s),
                None if refused_at is None else now - refused_at)},
            preempted=tuple(vanished),
        )
        for action in decide(snap, cfg):
            if isinstance(action, Launch):
                for _ in range(action.count):
                    spot = action.spot
                    if spot and rng.random() < args.spot_refusal:
                        spot, refused_at = False, now
                        result.refusals += 1
                    seq += 1
                    nodes[f"cloud-{seq}"] = Node(f"cloud-{seq}", "cloud", spot, now,
                                                 now + args.boot_s, idle_since=now + args.boot_s)
            elif isinstance(action, Release):
                nodes.pop(action.node, None)
            elif isinstance(action, Forget):
                pass  # the node is already gone
        result.peak_burst_nodes = max(
            result.peak_burst_nodes, sum(1 for n in nodes.values() if n.pool == "cloud"))
    result.hours = now / 3600
    for (pool, spot), s in seconds.items():
        p = pools[pool]
        result.cost += s / 3600 * p.node_price(spot)
        result.on_demand_cost += s / 3600 * p.price
        label = f"{pool}-{'spot' if spot else 'on-demand'}" if p.provisioned else pool
        result.node_hours[label] = round(s / 3600, 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=4096)
    ap.add_argument("--task-s", type=float, default=600.0, help="seconds per task")
    ap.add_argument("--static", type=int, default=4, help="static nodes (1 slot each)")
    ap.add_argument("--max-burst", type=int, default=64, help="burst pool max nodes")
    ap.add_argument("--static-price", type=float, default=0.50, help="per node-hour")
    ap.add_argument("--on-demand-price", type=float, default=1.00, help="per node-hour")
    ap.add_argument("--spot-price", type=float, default=0.30, help="per node-hour")
    ap.add_argument("--preemption-rate", type=float, default=0.05,
                    help="spot preemptions per node-hour")
    ap.add_argument("--spot-refusal", type=float, default=0.02,
                    help="probability that a spot launch is refused")
    ap.add_argument("--boot-s", type=float, default=120.0, help="launch to registered")
    ap.add_argument("--idle-timeout", type=float, default=300.0)
    ap.add_argument("--tick", type=float, default=10.0, help="policy period, seconds")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for scenario in ("hybrid-spot", "hybrid-on-demand", "static-only"):
        runs = [simulate(scenario, args, seed) for seed in range(args.seeds)]
        rows.append({
            "scenario": scenario,
            "hours": round(statistics.median(r.hours for r in runs), 2),
            "cost": round(statistics.median(r.cost for r in runs), 2),
            "on_demand_cost": round(statistics.median(r.on_demand_cost for r in runs), 2),
            "preemptions": statistics.median(r.preemptions for r in runs),
            "refusals": statistics.median(r.refusals for r in runs),
            "lost_task_hours": round(statistics.median(r.lost_task_hours for r in runs), 1),
            "peak_burst_nodes": max(r.peak_burst_nodes for r in runs),
            "node_hours": runs[0].node_hours,
        })
    if args.json:
        json.dump({"args": vars(args), "results": rows}, sys.stdout, indent=2)
        print()
        return
    print(f"{args.tasks} tasks x {args.task_s:.0f}s, {args.static} static nodes, burst max "
          f"{args.max_burst}; prices static {args.static_price}/h, on-demand "
          f"{args.on_demand_price}/h, spot {args.spot_price}/h; preemption "
          f"{args.preemption_rate}/node-h; medians of {args.seeds} seeds")
    print(f"{'scenario':<18}{'hours':>8}{'cost':>10}{'(on-demand)':>12}{'preempt':>9}"
          f"{'refused':>8}{'lost h':>8}{'peak':>6}  node-hours (seed 0)")
    for r in rows:
        print(f"{r['scenario']:<18}{r['hours']:>8.2f}{r['cost']:>10.2f}{r['on_demand_cost']:>12.2f}"
              f"{r['preemptions']:>9}{r['refusals']:>8}{r['lost_task_hours']:>8.1f}"
              f"{r['peak_burst_nodes']:>6}  {r['node_hours']}")


if __name__ == "__main__":
    main()
