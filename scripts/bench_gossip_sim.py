#!/usr/bin/env python3
"""Gossip (SWIM + Lifeguard) figures from the in-process simulation, lan preset.

    bench_gossip_sim.py [--sizes 1000,10000] [--seeds 3] [--small-seeds 20]
                        [--loss-nodes 1000] [--loss-periods 1000] [--json]
    bench_gossip_sim.py --cost [--cost-sizes 16,64,256,1024] [--cost-periods 240]
                        [--cost-rows 64,10000000] [--json]
    bench_gossip_sim.py --busy [--busy-sizes 32,256] [--busy-seconds 30] [--json]
    bench_gossip_sim.py --pauses 200 [--pause-sizes 8,32,256] [--json]

Everything runs in ``agent/gossip/simnet.py`` on a virtual clock: one-way latency
uniform in 0.5-2 ms, every member ticked exactly when it asks. Times are in
protocol periods (1 s in the lan preset) unless marked as seconds.

spread: after 3 quiet periods one member changes its meta; periods until every
other member holds the new version.

silent crash: then one member stops answering (a crash, a pulled cable);
periods from the crash until the first member suspects it, until the first
declares it dead, and until every member knows it dead.

refused crash: ten quiet periods later, another member's port refuses
connections (a killed process on a live host); seconds until the first and the
last member know it dead. Quiet: only pings find it, no gossip in flight.

small meshes: the same two crashes at 10 and 50 members (seconds).

loss: 10% of all messages lost, independently; false deaths (a member declared
dead while running) over ``--loss-periods`` periods, and the wall time.

bytes: every message as ``len(json.dumps(message.to_json()))`` (compact
separators), per member per period: quiet (pings and acks only), while the
scenarios above run, and under loss.

Medians over seeds, with every sample in ``--json``.

``--cost`` (issue 23) runs instead: for each mesh size and each ``push_pull_rows``
(10000000: whole tables, the behaviour before the bound), every member starting
with the meta below (so rows are as large as real agents'), the bytes and messages
each member sends per second over ``--cost-periods`` quiet periods after 10 to
settle (median and largest over members; ping, ack and push-pull traffic), and the
largest push-pull message; then seconds until every member knows a silent crash
dead, and, for a new member joining through one seed, seconds until it holds the
whole table and until every member knows it alive.

busy (``--busy``): every member a busy one-slot agent, its task counts (``running``,
``free_slots``) published every 2 s as the agent does (a random 0 or 1, so a member
that missed a version often sees the same counts again), after one loud change of
every member's meta at once; per member per second over ``--busy-seconds`` after
30 s: messages, of them gossip rounds, rows per message, bytes; and how many versions
behind the counts are that 20 members hold of every other.

pauses (``--pauses N``): a SIGSTOP, simulated. N times per mesh size (``--pause-sizes``),
at a random moment, a random member stops (its messages wait, unanswered), until a
member declares it dead; then it resumes and 25 periods pass. Seconds from the stop to
the first suspicion of it and to the first death (median, p95, max), and deaths of the
other members meanwhile (false deaths).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.duty import LOAD_MIN_INTERVAL_S as LOAD_PERIOD_S
from hypermesh.agent.gossip.simnet import SimNet
from hypermesh.agent.gossip.suspicion import (
    expected_confirmations,
    retransmit_limit,
    suspicion_bounds,
)

META = {
    "running": 3,
    "slots": 8,
    "free_slots": 5,
    "gpus": 4,
    "free_gpus": 1.0,
    "chunks": {"v": 17, "d": "9f2c61be04aa7d31"},
}


def bytes_since(net: SimNet, mark: tuple[int, float]) -> float:
    """Bytes per member per period since ``mark`` (bytes, time)."""
    elapsed = (net.now - mark[1]) / net.cfg.protocol_period
    return (net.stats.bytes - mark[0]) / len(net.nodes) / elapsed if elapsed > 0 else 0.0


def run_until_seen(
    net: SimNet, seen: dict[str, float], want: int, limit_periods: float, step: float = 0.25
) -> None:
    end = net.now + limit_periods * net.cfg.protocol_period
    while len(seen) < want and net.now < end:
        net.run_periods(step)


def scenario(n: int, seed: int, cfg: GossipConfig, measure_bytes: bool = True) -> dict[str, Any]:
    """Spread, silent crash and refused crash in one mesh of ``n`` members."""
    period = cfg.protocol_period
    wall = time.perf_counter()
    net = SimNet(n, cfg, seed=seed, measure_bytes=measure_bytes)
    net.run_periods(3)
    quiet = (net.stats.bytes, net.now)
    net.run_periods(4)
    out: dict[str, Any] = {"n": n, "seed": seed, "quiet_bytes": bytes_since(net, quiet)}
    busy = (net.stats.bytes, net.now)

    src = net.names[1]
    watch = net.watch(src)
    start = net.now
    net.set_meta(src, META)
    seen = watch.meta.setdefault(1, {})
    run_until_seen(net, seen, n, 40)
    others = [t for name, t in seen.items() if name != src]
    out["spread"] = (max(others) - start) / period if len(others) == n - 1 else None
    net.run_periods(2)

    victim = net.names[2]
    watch = net.watch(victim)
    crash = net.now
    net.crash(victim)
    dead = watch.states.setdefault("dead", {})
    run_until_seen(net, dead, n - 1, 80, step=1.0)
    suspects = watch.states.get("suspect", {})
    out["first_suspect"] = (min(suspects.values()) - crash) / period if suspects else None
    out["first_dead"] = (min(dead.values()) - crash) / period if dead else None
    out["all_dead"] = (max(dead.values()) - crash) / period if len(dead) == n - 1 else None
    net.run_periods(10)  # let the gossip die down: only pings find the next crash

    victim = net.names[3]
    watch = net.watch(victim)
    crash = net.now
    net.crash(victim, refused=True)
    dead = watch.states.setdefault("dead", {})
    run_until_seen(net, dead, n - 2, 20, step=0.1)
    out["refused_first_s"] = min(dead.values()) - crash if dead else None
    out["refused_all_s"] = max(dead.values()) - crash if len(dead) == n - 2 else None
    out["busy_bytes"] = bytes_since(net, busy)
    out["false_deaths"] = len(net.false_deaths)
    out["periods"] = net.now / period
    out["wall_s"] = time.perf_counter() - wall
    return out


def small_mesh(n: int, seed: int, cfg: GossipConfig) -> dict[str, Any]:
    """Seconds to a death verdict in a small mesh, silent and refused."""
    net = SimNet(n, cfg, seed=seed)
    net.run_periods(4)
    out: dict[str, Any] = {"n": n, "seed": seed}
    for key, victim, refused in (("silent", net.names[1], False), ("refused", net.names[2], True)):
        watch = net.watch(victim)
        crash = net.now
        net.crash(victim, refused=refused)
        dead = watch.states.setdefault("dead", {})
        run_until_seen(net, dead, len(net.up()), 60, step=0.1)
        out[f"{key}_first_s"] = min(dead.values()) - crash if dead else None
        out[f"{key}_all_s"] = max(dead.values()) - crash if len(dead) == len(net.up()) else None
        net.run_periods(10)
    out["false_deaths"] = len(net.false_deaths)
    return out


def loss_run(n: int, periods: int, seed: int, cfg: GossipConfig) -> dict[str, Any]:
    """False deaths at 10% loss; bytes measured over the last tenth of the run."""
    wall = time.perf_counter()
    net = SimNet(n, cfg, seed=seed, loss=0.10)
    net.run_periods(periods * 0.9)
    net.measure_bytes = True
    mark = (net.stats.bytes, net.now)
    msgs = net.stats.messages
    net.run_periods(periods * 0.1)
    tail_periods = (net.now - mark[1]) / cfg.protocol_period
    return {
        "n": n,
        "periods": periods,
        "seed": seed,
        "false_deaths": len(net.false_deaths),
        "false_death_samples": net.false_deaths[:10],
        "suspicions": net.transitions[("alive", "suspect")],
        "refutations": net.transitions[("suspect", "alive")],
        "bytes": bytes_since(net, mark),
        "messages": (net.stats.messages - msgs) / n / tail_periods,
        "wall_s": time.perf_counter() - wall,
    }


def cost(n: int, rows: int, periods: int, seed: int = 1) -> dict[str, Any]:
    """Bytes and messages per member per second in a quiet mesh of ``n``, then a
    silent crash and a join (see ``--cost``)."""
    wall = time.perf_counter()
    cfg = GossipConfig.lan(push_pull_rows=rows)
    net = SimNet(n, cfg, seed=seed, measure_bytes=True, meta=META)
    net.run_periods(10)
    sent, sent_bytes, start = list(net.stats.sent), list(net.stats.sent_bytes), net.now
    net.run_periods(periods)
    seconds = net.now - start
    per_s = [(b - a) / seconds for a, b in zip(sent_bytes, net.stats.sent_bytes, strict=True)]
    msgs = [(b - a) / seconds for a, b in zip(sent, net.stats.sent, strict=True)]
    out: dict[str, Any] = {
        "n": n,
        "rows": rows,
        "bytes_per_s": statistics.median(per_s),
        "bytes_per_s_max": max(per_s),
        "messages_per_s": statistics.median(msgs),
        "largest_push_pull": max(
            net.stats.largest["push_pull"], net.stats.largest["push_pull_reply"]
        ),
    }
    victim = net.names[2]
    dead = net.watch(victim).states.setdefault("dead", {})
    crash = net.now
    net.crash(victim)
    run_until_seen(net, dead, n - 1, 120, step=1.0)
    out["death_all_s"] = max(dead.values()) - crash if len(dead) == n - 1 else None
    net.run_periods(10)
    start = net.now
    joiner = net.add([net.names[0]])
    node = net.nodes[net.index[joiner]]
    alive = net.watch(joiner).states.setdefault("alive", {})
    others = len(net.up()) - 1
    whole = None
    while net.now - start < 120 and (whole is None or len(alive) < others):
        net.run_until(net.now + 0.01 if whole is None else net.now + 0.25)
        if whole is None and node.live_count() == others + 1:
            whole = net.now - start
    out["join_whole_table_s"] = whole
    out["join_known_all_s"] = max(alive.values()) - start if len(alive) >= others else None
    out["wall_s"] = time.perf_counter() - wall
    return out


def busy(n: int, seconds: float, seed: int = 1, warm: float = 30.0,
         make_net: Callable[..., SimNet] = SimNet) -> dict[str, Any]:
    """A busy mesh of ``n`` one-slot members (see ``--busy``), simulated by what
    ``make_net`` makes (``scripts/bench_gossip_decode.py`` times its decoding)."""
    wall = time.perf_counter()
    net = make_net(n, GossipConfig.lan(), seed=seed, measure_bytes=True, meta=META)
    net.run_periods(3)
    rng = random.Random(seed)
    versions = dict.fromkeys(net.names, 2)  # the roster meta, then the loud change
    start = net.now

    def publish(name: str) -> None:
        running = rng.randint(0, 1)
        versions[name] += 1
        net.set_meta(name, META | {"running": running, "free_slots": 1 - running})

    for name in net.names:
        # The first publication adds a key the roster's meta lacks: loud news from
        # every member at once, as when a whole mesh starts working.
        net.set_meta(name, META | {"state": "active"})
        phase = rng.random() * LOAD_PERIOD_S
        k = 1
        while phase + k * LOAD_PERIOD_S < warm + seconds:
            net.at(start + phase + k * LOAD_PERIOD_S, functools.partial(publish, name))
            k += 1
    net.run_until(start + warm)
    sent, sent_bytes = sum(net.stats.sent), sum(net.stats.sent_bytes)
    rounds, rows = net.stats.by_kind.get("gossip", 0), net.stats.updates
    net.run_until(start + warm + seconds)
    behind = []
    for node in net.nodes[:20]:
        for name in net.names:
            seen = node.member(name)
            if seen is not None and name != node.name:
                behind.append(versions[name] - seen.meta_version)
    messages = sum(net.stats.sent) - sent
    member_s = n * seconds
    return {
        "n": n,
        "messages_per_s": messages / member_s,
        "gossip_rounds_per_s": (net.stats.by_kind.get("gossip", 0) - rounds) / member_s,
        "rows_per_message": (net.stats.updates - rows) / max(1, messages),
        "bytes_per_s": (sum(net.stats.sent_bytes) - sent_bytes) / member_s,
        "versions_behind_median": statistics.median(behind),
        "versions_behind_p90": statistics.quantiles(behind, n=10)[-1],
        "wall_s": time.perf_counter() - wall,
    }


def busy_report(opts: argparse.Namespace) -> int:
    results = []
    for n in [int(s) for s in opts.busy_sizes.split(",") if s]:
        row = busy(n, opts.busy_seconds)
        results.append(row)
        print(f"# {row}", file=sys.stderr, flush=True)
    if opts.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"busy mesh, lan preset, simulated: every member's counts change every "
          f"{LOAD_PERIOD_S:g} s; {opts.busy_seconds:g} s measured after 30")
    print()
    print("| members | messages/member/s | of them gossip rounds | rows/message | "
          "B/member/s | versions behind (median, p90) |")
    print("| ---: " * 6 + "|")
    for r in results:
        print(f"| {r['n']} | {r['messages_per_s']:.2f} | {r['gossip_rounds_per_s']:.2f} | "
              f"{r['rows_per_message']:.1f} | {r['bytes_per_s']:.0f} | "
              f"{r['versions_behind_median']:.0f}, {r['versions_behind_p90']:.0f} |")
    return 0


def cost_report(opts: argparse.Namespace) -> int:
    sizes = [int(s) for s in opts.cost_sizes.split(",") if s]
    rows_list = [int(s) for s in opts.cost_rows.split(",") if s]
    results = []
    for rows in rows_list:
        for n in sizes:
            row = cost(n, rows, opts.cost_periods)
            results.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
    if opts.json:
        print(json.dumps(results, indent=2))
        return 0
    cfg = GossipConfig.lan()
    print(
        f"lan preset (period {cfg.protocol_period} s, push-pull interval "
        f"{cfg.push_pull_interval} s), simulated; {opts.cost_periods} quiet periods measured"
    )
    print()
    print(
        "| push_pull_rows | members | B/member/s median | max | messages/member/s | "
        "largest push-pull (B) | crash known everywhere (s) | joiner has table (s) | "
        "joiner known everywhere (s) |"
    )
    print("| ---: " * 9 + "|")
    for r in results:
        print(
            f"| {r['rows']} | {r['n']} | {r['bytes_per_s']:.0f} | {r['bytes_per_s_max']:.0f} | "
            f"{r['messages_per_s']:.2f} | {r['largest_push_pull']} | "
            f"{fmt(r['death_all_s'])} | {fmt(r['join_whole_table_s'], 2)} | "
            f"{fmt(r['join_known_all_s'])} |"
        )
    return 0


def pauses(n: int, count: int, cfg: GossipConfig) -> dict[str, Any]:
    """``count`` pauses of random members in meshes of ``n`` (10 per seed)."""
    period = cfg.protocol_period
    suspected: list[float] = []
    dead_at: list[float] = []
    false_deaths = 0
    for seed in range(1, (count + 9) // 10 + 1):
        net = SimNet(n, cfg, seed=seed)
        rng = random.Random(seed)
        net.run_periods(5)
        for _ in range(min(10, count - len(dead_at))):
            victim = net.names[rng.randrange(n)]
            net.run_until(net.now + rng.random() * period)
            watch = net.watch(victim)
            watch.states.clear()
            net.false_deaths.clear()
            stop = net.now
            net.pause(victim)
            dead = watch.states.setdefault("dead", {})
            while not dead and net.now - stop < 60 * period:
                net.run_until(net.now + 0.02 * period)
            suspects = watch.states.get("suspect", {})
            suspected.append(min(suspects.values()) - stop)
            dead_at.append(min(dead.values()) - stop)
            false_deaths += sum(1 for _, _, m in net.false_deaths if m != victim)
            net.resume(victim)
            net.run_periods(25)

    def summary(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median": statistics.median(xs), "p95": xs[int(0.95 * (len(xs) - 1))],
                "max": xs[-1]}

    return {"n": n, "pauses": len(dead_at), "first_suspect_s": summary(suspected),
            "first_dead_s": summary(dead_at), "false_deaths": false_deaths}


def pause_report(opts: argparse.Namespace) -> int:
    cfg = GossipConfig.lan()
    rows = []
    for n in (int(s) for s in opts.pause_sizes.split(",") if s):
        rows.append(pauses(n, opts.pauses, cfg))
        print(f"# pauses n={n}: {rows[-1]}", file=sys.stderr, flush=True)
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| members | pauses | first suspicion: median / p95 / max (s) "
          "| first death: median / p95 / max (s) | false deaths |")
    print("| ---: " * 5 + "|")
    for r in rows:
        cells = [" / ".join(f"{r[key][q]:.2f}" for q in ("median", "p95", "max"))
                 for key in ("first_suspect_s", "first_dead_s")]
        print(f"| {r['n']} | {r['pauses']} | {cells[0]} | {cells[1]} | {r['false_deaths']} |")
    return 0


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000,10000", help="mesh sizes, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per size")
    parser.add_argument("--small-seeds", type=int, default=20, help="seeds per small mesh")
    parser.add_argument("--loss-nodes", type=int, default=1000)
    parser.add_argument("--loss-periods", type=int, default=1000, help="0 skips the loss run")
    parser.add_argument("--json", action="store_true", help="print every sample as JSON")
    parser.add_argument("--cost", action="store_true", help="gossip cost per member (issue 23)")
    parser.add_argument("--cost-sizes", default="16,64,256,1024")
    parser.add_argument("--cost-periods", type=int, default=240)
    parser.add_argument("--cost-rows", default="64,10000000", help="push_pull_rows values")
    parser.add_argument("--busy", action="store_true",
                        help="gossip cost per member while every member's counts change")
    parser.add_argument("--busy-sizes", default="32,256")
    parser.add_argument("--busy-seconds", type=float, default=30.0)
    parser.add_argument("--pauses", type=int, default=0,
                        help="simulated SIGSTOPs per mesh size (0: the report above)")
    parser.add_argument("--pause-sizes", default="8,32,256")
    opts = parser.parse_args()
    if opts.pauses:
        return pause_report(opts)
    if opts.cost:
        return cost_report(opts)
    if opts.busy:
        return busy_report(opts)
    cfg = GossipConfig.lan()
    sizes = [int(s) for s in opts.sizes.split(",") if s]
    report: dict[str, Any] = {
        "config": cfg.describe(),
        "derived": {},
        "meshes": [],
        "small": [],
        "loss": None,
    }
    for n in sizes:
        low, high = suspicion_bounds(n, cfg)
        report["derived"][n] = {
            "suspicion_min_periods": low / cfg.protocol_period,
            "suspicion_max_periods": high / cfg.protocol_period,
            "confirmations_k": expected_confirmations(n, cfg),
            "retransmit_limit": retransmit_limit(n, cfg),
        }
        for seed in range(1, opts.seeds + 1):
            row = scenario(n, seed, cfg)
            report["meshes"].append(row)
            print(f"# n={n} seed={seed}: {row}", file=sys.stderr, flush=True)
    for n in (10, 50):
        for seed in range(1, opts.small_seeds + 1):
            report["small"].append(small_mesh(n, seed, cfg))
    if opts.loss_periods:
        report["loss"] = loss_run(opts.loss_nodes, opts.loss_periods, 1, cfg)
        print(f"# loss: {report['loss']}", file=sys.stderr, flush=True)
    if opts.json:
        print(json.dumps(report, indent=2, default=str))
        return 0

    print(
        f"lan preset: period {cfg.protocol_period} s, probe timeout {cfg.probe_timeout} s, "
        f"k={cfg.indirect_checks}, alpha={cfg.suspicion_mult}, beta={cfg.suspicion_max_mult}, "
        f"K={cfg.suspicion_confirmations}, lambda={cfg.retransmit_mult}, gossip every "
        f"{cfg.gossip_interval} s to {cfg.gossip_fanout}, {cfg.max_piggyback} updates/msg"
    )
    print()
    print(
        "| members | seeds | spread | first suspect | first dead | all dead | refused first "
        "(s) | refused all (s) | B/member/period quiet | busy | false deaths | wall (s) |"
    )
    print("| ---: " * 12 + "|")
    for n in sizes:
        rows = [r for r in report["meshes"] if r["n"] == n]
        print(
            f"| {n} | {len(rows)} | {fmt(med(rows, 'spread'))} | "
            f"{fmt(med(rows, 'first_suspect'))} | {fmt(med(rows, 'first_dead'))} | "
            f"{fmt(med(rows, 'all_dead'))} | {fmt(med(rows, 'refused_first_s'), 2)} | "
            f"{fmt(med(rows, 'refused_all_s'), 2)} | {fmt(med(rows, 'quiet_bytes'), 0)} | "
            f"{fmt(med(rows, 'busy_bytes'), 0)} | {sum(r['false_deaths'] for r in rows)} | "
            f"{fmt(med(rows, 'wall_s'), 0)} |"
        )
        worst = max((r["all_dead"] or 1e9) for r in rows)
        print(
            f"|   | worst | {fmt(max((r['spread'] or 1e9) for r in rows))} | | | "
            f"{fmt(worst)} | | {fmt(max((r['refused_all_s'] or 1e9) for r in rows), 2)} "
            "| | | | |"
        )
    print()
    print("small meshes (seconds; median / max over seeds)")
    print("| members | silent first | silent all | refused first | refused all | false deaths |")
    print("| ---: " * 6 + "|")
    for n in (10, 50):
        rows = [r for r in report["small"] if r["n"] == n]
        cells = []
        for key in ("silent_first_s", "silent_all_s", "refused_first_s", "refused_all_s"):
            worst_value = max((r[key] if r[key] is not None else 1e9) for r in rows)
            cells.append(f"{fmt(med(rows, key), 2)} / {fmt(worst_value, 2)}")
        print(f"| {n} | " + " | ".join(cells) + f" | {sum(r['false_deaths'] for r in rows)} |")
    loss = report["loss"]
    if loss:
        print()
        print(
            f"10% loss, {loss['n']} members, {loss['periods']} periods: "
            f"{loss['false_deaths']} false deaths, {loss['suspicions']} suspicion events "
            f"(observer x member), {loss['messages']:.1f} messages and "
            f"{loss['bytes']:.0f} bytes per member per period, {loss['wall_s']:.0f} s wall"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
