"""What the burst policy sees, derived from the mesh's mirror. Pure: no I/O, no clock.

The burst duty hands in the view, the time and what it remembers between ticks
(since when each experiment has had a backlog, when each node was last busy);
these functions turn that into the policy's ``Snapshot`` pieces and the
node-seconds to add to the usage counters.
"""

from __future__ import annotations

from collections import Counter
from statistics import fmean

from hypermesh.agent.burst.policy import Backlog, NodeState, Starting
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.fit import fits
from hypermesh.state.pools import Pool
from hypermesh.state.records import TERMINAL, NodeRecord
from hypermesh.state.view import MeshView

BIG = 1e12  # a provisioned node's CPUs and memory are not declared: assume they fit


def pools_in_use(view: MeshView, declared: dict[str, Pool]) -> dict[str, Pool]:
    """The declared pools, plus an undeclared static pool (free, never scaled) for
    every pool a registered node names without a declaration."""
    pools = dict(declared)
    for node in view.nodes.values():
        pools.setdefault(node.pool, Pool(node.pool))
    return pools


def pool_fits(exp: Experiment, pool: Pool, view: MeshView) -> bool:
    """Whether a node of ``pool`` could run ``exp``'s tasks: for a provisioned pool
    the node it would start, for a static pool any of its registered nodes."""
    if pool.provisioned:
        shape = NodeRecord("new", "", pool=pool.name, slots=pool.slots, gpus=pool.gpus,
                           gpu_type=pool.gpu_type, cpus=BIG, memory=0)
        return fits(exp.hardware, shape)
    return any(n.pool == pool.name and fits(exp.hardware, n) for n in view.nodes.values())


def runnable_pending(view: MeshView, wid: str, exp: Experiment) -> int:
    """Open tasks of an experiment that could start now: at most its free ``workers``."""
    pending = len(view.open.get((wid, exp.name), ()))
    if exp.workers is not None:
        pending = min(pending, exp.workers - len(view.slots.get((wid, exp.name), ())))
    return max(0, pending)


def mean_task_s(view: MeshView, wid: str, exp: str, default: float) -> float:
    """Mean duration of the experiment's successful attempts so far, else ``default``."""
    durations = [
        a.ended_at - a.started_at
        for ref, attempts in view.attempts.items()
        if ref.workflow == wid and ref.experiment == exp
        for a in attempts.values()
        if a.state == "succeeded" and a.ended_at is not None and a.started_at is not None
    ]
    return max(0.001, fmean(durations)) if durations else default


def backlog(
    view: MeshView,
    pools: dict[str, Pool],
    backlog_since: dict[str, float],
    now: float,
    default_task_s: float,
) -> tuple[tuple[Backlog, ...], dict[str, float]]:
    """The backlog per experiment, and the updated ``backlog_since`` (key -> when
    that experiment's backlog became non-empty; keys whose backlog emptied drop out)."""
    items: list[Backlog] = []
    since: dict[str, float] = {}
    for wid, wf in view.workflows.items():
        if view.workflow_state(wid) in TERMINAL:
            continue
        for exp in wf.recipe.experiments:
            if (wid, exp.name) not in view.expanded:
                continue
            pending = runnable_pending(view, wid, exp)
            if pending == 0:
                continue
            key = f"{wid}/{exp.name}"
            since[key] = backlog_since.get(key, now)
            names = exp.pools or tuple(sorted(pools))
            eligible = tuple(p for p in names if p in pools and pool_fits(exp, pools[p], view))
            preferred = tuple(p for p in exp.prefer_pools if p in eligible)
            eligible = preferred + tuple(p for p in eligible if p not in preferred)
            task_s = mean_task_s(view, wid, exp.name, default_task_s)
            items.append(Backlog(key, pending, now - since[key], task_s, eligible, preferred))
    return tuple(sorted(items, key=lambda b: b.key)), since


def nodes(
    view: MeshView, busy_at: dict[str, float], now: float
) -> tuple[tuple[NodeState, ...], dict[str, float]]:
    """Live registered nodes with their load and idle time, and the updated
    ``busy_at`` (node -> last time it was seen running something, or first seen)."""
    running = Counter(c.node for c in view.claims.values())
    states: list[NodeState] = []
    seen: dict[str, float] = {}
    for name, n in sorted(view.nodes.items()):
        seen[name] = now if running[name] else busy_at.get(name, now)
        if n.state != "alive":
            continue  # draining: it is going away and takes no work
        states.append(NodeState(name, n.pool, n.spot, n.slots, running[name],
                                now - seen[name], name in view.instances))
    return tuple(states), seen


def starting(view: MeshView, now: float) -> tuple[Starting, ...]:
    """Provisioned nodes that were asked for and have not registered yet."""
    return tuple(
        Starting(name, str(i.get("pool")), bool(i.get("spot")),
                 now - float(i.get("requested_at", now)))
        for name, i in sorted(view.instances.items())
        if i.get("state") == "starting" and not registered(view, name)
    )


def leaving(view: MeshView) -> tuple[tuple[str, str], ...]:
    """(node, pool) of provisioned nodes on their way out: released and not yet
    forgotten, or registered and draining (a spot notice, a drain)."""
    return tuple(
        (name, str(i.get("pool")))
        for name, i in sorted(view.instances.items())
        if i.get("state") == "releasing"
        or (name in view.nodes and view.nodes[name].state != "alive")
    )


def registered(view: MeshView, name: str) -> bool:
    """Whether provisioned node ``name`` registered: it is, or the view saw it (a node
    preempted between two burst ticks registered without the leader marking it)."""
    return name in view.nodes or name in view.booted


def vanished(view: MeshView) -> tuple[tuple[str, str], ...]:
    """(node, pool) of provisioned nodes that had registered and are gone although
    no one released them: preempted (or crashed, which is the same to us)."""
    return tuple(
        (name, str(i.get("pool")))
        for name, i in sorted(view.instances.items())
        if name not in view.nodes and (
            i.get("state") == "running" or (i.get("state") == "starting" and name in view.booted)
        )
    )


def node_seconds(
    view: MeshView, dt: float
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict[str, float]]]]:
    """Node-seconds of the last ``dt`` seconds: per pool (every registered node, and
    every provisioned node still booting or going away, which the provider bills
    too), and per workflow and pool (each running task's share of its node: dt / slots)."""
    per_pool: dict[str, dict[str, float]] = {}
    per_wf: dict[str, dict[str, dict[str, float]]] = {}
    billed = [(n.pool, n.spot) for n in view.nodes.values()] + [
        (str(i.get("pool")), bool(i.get("spot")))
        for name, i in view.instances.items()
        if name not in view.nodes and i.get("state") in ("starting", "releasing")
    ]
    for pool, spot in billed:
        market = "spot_s" if spot else "on_demand_s"
        bucket = per_pool.setdefault(pool, {})
        bucket[market] = bucket.get(market, 0.0) + dt
    for claim_ref, claim in view.claims.items():
        runner = view.nodes.get(claim.node)
        if runner is None:
            continue
        market = "spot_s" if runner.spot else "on_demand_s"
        bucket = per_wf.setdefault(claim_ref.workflow, {}).setdefault(runner.pool, {})
        bucket[market] = bucket.get(market, 0.0) + dt / max(1, runner.slots)
    return per_pool, per_wf
