"""The leader's bursting policy. Pure: a snapshot in, actions out; no I/O, no clock.

The leader's burst duty (``agent/burst/duty.py``) builds a ``Snapshot`` from etcd
(pools, nodes, starting nodes, the backlog) and from what it remembers (recent
preemptions and spot refusals), calls ``decide``, and carries out the actions.
The simulation in ``scripts/bench_burst_sim.py`` calls the same ``decide`` with a
simulated clock.

What ``decide`` guarantees, whatever the snapshot:

- free capacity first: pending work is matched against the free and
  starting slots of every pool it may use (the pools its experiment prefers
  before the others, static before provisioned within each), and only the
  shortfall is asked of provisioners, preferred pools first;
- a pool is scaled only for work that has waited ``wait_threshold_s`` (or
  that a preempted node of the pool left behind), by enough nodes to drain
  that backlog within ``target_drain_s``;
- nodes are never started when nothing is pending, and a pool never has more
  than ``max_nodes`` running, starting or on their way out (released or
  draining: they exist until gone);
- spot first, on-demand when the pool recently refused spot capacity or when
  its recent preemption fraction (counting the preemptions seen this tick) is
  too high; every launch says why (``Launch.market``);
- an idle provisioned node is released after its pool's idle timeout, never
  below ``min_nodes``, and never in a tick that scales its pool up;
- a node that does not register within ``boot_timeout_s`` is released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypermesh.errors import UsageError
from hypermesh.state.pools import Pool


@dataclass(frozen=True)
class BurstConfig:
    """Timings of the burst duty. Construct with ``lan()`` or ``local()``."""

    tick_s: float = 5.0
    """Seconds between two runs of the policy (0.05-600). Lower reacts sooner and
    costs the leader a little CPU per run."""

    wait_threshold_s: float = 60.0
    """Pending work must have waited this long (0-86400) before a pool is scaled
    for it. Higher: short spikes that static machines absorb never start cloud
    nodes; lower: less queueing when the backlog is real."""

    target_drain_s: float = 1800.0
    """Scale so that the backlog would be done within this many seconds
    (1-604800); see ``slots_to_drain``. Lower: more nodes, sooner done."""

    default_task_s: float = 600.0
    """Task duration assumed for an experiment none of whose tasks has finished
    yet (0.001-604800)."""

    boot_timeout_s: float = 900.0
    """A started node that has not registered after this long is released
    (1-86400)."""

    preemption_window_s: float = 3600.0
    """Preemptions older than this no longer count (1-604800)."""

    max_preemption_fraction: float = 0.5
    """Above this fraction of a pool's recent spot nodes preempted, new nodes of
    the pool are on-demand (0-1); see ``preemption_fraction``."""

    refusal_backoff_s: float = 600.0
    """After the provider refused spot capacity for a pool, its new nodes are
    on-demand for this long (0-86400)."""

    usage_flush_s: float = 30.0
    """Seconds between writes of the node-seconds counters to etcd (0.1-3600);
    they are integrated in memory every tick. A new leader loses at most this."""

    events_kept: int = 1000
    """How many burst decisions the event log in etcd keeps (10-100000)."""

    def __post_init__(self) -> None:
        for name, low, high in (
            ("tick_s", 0.05, 600), ("wait_threshold_s", 0, 86400),
            ("target_drain_s", 1, 604800), ("default_task_s", 0.001, 604800),
            ("boot_timeout_s", 1, 86400), ("preemption_window_s", 1, 604800),
            ("max_preemption_fraction", 0, 1), ("refusal_backoff_s", 0, 86400),
            ("usage_flush_s", 0.1, 3600), ("events_kept", 10, 100000),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise UsageError(f"burst {name} {value} is out of range: allowed {low}..{high}")

    @classmethod
    def lan(cls, **overrides: float) -> BurstConfig:
        """Defaults for real meshes (minutes matter, seconds do not)."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def local(cls, **overrides: float) -> BurstConfig:
        """Tight timings for tests and the local mesh: seconds instead of minutes."""
        base = {
            "tick_s": 0.5, "wait_threshold_s": 1.0, "target_drain_s": 2.0,
            "default_task_s": 2.0, "boot_timeout_s": 60.0, "preemption_window_s": 60.0,
            "refusal_backoff_s": 30.0, "usage_flush_s": 1.0,
        }
        return cls(**(base | overrides))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Backlog:
    """Pending tasks of one experiment that could start now if a slot were free.

    ``pools`` are the pools whose nodes could run them, in the recipe's order of
    preference (every fitting pool when the recipe names none); ``preferred`` those
    of them the recipe prefers (``prefer_pools``), which are drawn on and scaled
    first."""

    key: str
    pending: int
    oldest_wait_s: float
    task_s: float
    pools: tuple[str, ...]
    preferred: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeState:
    """A registered node. ``owned``: a provisioner started it and may release it."""

    name: str
    pool: str
    spot: bool
    slots: int
    running: int
    idle_s: float
    owned: bool


@dataclass(frozen=True)
class Starting:
    """A node asked of a provisioner that has not registered yet."""

    name: str
    pool: str
    spot: bool
    waited_s: float


@dataclass(frozen=True)
class PoolHistory:
    """What happened to a pool recently (kept by the duty, not in etcd)."""

    preempted_s_ago: tuple[float, ...] = ()
    """Ages of preemptions of the pool's nodes."""

    refused_s_ago: float | None = None
    """Age of the last spot capacity refusal, if any."""


@dataclass(frozen=True)
class Snapshot:
    pools: dict[str, Pool]
    nodes: tuple[NodeState, ...] = ()
    starting: tuple[Starting, ...] = ()
    backlog: tuple[Backlog, ...] = ()
    history: dict[str, PoolHistory] = field(default_factory=dict)
    preempted: tuple[tuple[str, str], ...] = ()
    """(node, pool) of owned nodes that vanished since the last tick."""
    on_demand_lost: frozenset[str] = frozenset()
    """Those of ``preempted`` that were on-demand: lost (crashed), replaced like the
    others, but no part of the pool's spot preemption rate."""
    leaving: tuple[tuple[str, str], ...] = ()
    """(node, pool) of owned nodes on their way out (released, or draining): no
    capacity, but they exist until gone and count against the pool's max."""


# ---------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Launch:
    """Start ``count`` nodes of ``pool``: ``reason`` says why nodes are needed,
    ``market`` why they are spot or on-demand (see ``market``)."""

    pool: str
    count: int
    spot: bool
    reason: str
    market: str = field(default="", compare=False)


@dataclass(frozen=True)
class Release:
    node: str
    pool: str
    reason: str


@dataclass(frozen=True)
class Forget:
    """Drop the record of an owned node that is gone (preempted)."""

    node: str
    pool: str
    reason: str


Action = Launch | Release | Forget


# ---------------------------------------------------------------------- formulas
def slots_to_drain(pending: int, task_s: float, target_s: float) -> int:
    """Slots that must work in parallel to finish ``pending`` tasks of ``task_s``
    seconds each within ``target_s``: ceil(pending * task_s / target_s), never
    more than ``pending`` (one slot per task is the most that helps) and 0 when
    nothing is pending."""
    if pending <= 0:
        return 0
    return min(pending, math.ceil(pending * task_s / target_s - 1e-9))


def nodes_for_slots(slots: int, slots_per_node: int) -> int:
    """Nodes of ``slots_per_node`` slots that give at least ``slots`` slots."""
    return -(-max(0, slots) // slots_per_node)


def preemption_fraction(preemptions: int, spot_nodes: int) -> float:
    """Recent preemptions over the pool's spot nodes that could have been
    preempted (those alive now plus those preempted): 0 with no preemption, 1
    when every recent spot node was preempted."""
    if preemptions <= 0:
        return 0.0
    return preemptions / (spot_nodes + preemptions)


def market(pool: Pool, spot_nodes: int, history: PoolHistory,
           cfg: BurstConfig) -> tuple[bool, str]:
    """Whether new nodes of ``pool`` should be spot, and why: the pool asks for spot,
    the provider has not refused spot within ``refusal_backoff_s``, and the recent
    preemption fraction (preemptions within ``preemption_window_s`` over the pool's
    registered spot nodes plus those preemptions) is at most
    ``max_preemption_fraction``."""
    if not pool.spot:
        return False, "on-demand: the pool is on-demand"
    refused = history.refused_s_ago
    if refused is not None and refused < cfg.refusal_backoff_s:
        return False, (f"on-demand: spot capacity refused {refused:.0f}s ago "
                       f"(backoff {cfg.refusal_backoff_s:.0f}s)")
    recent = sum(1 for age in history.preempted_s_ago if age < cfg.preemption_window_s)
    rate = preemption_fraction(recent, spot_nodes)
    over = rate > cfg.max_preemption_fraction
    return not over, (
        f"{'on-demand' if over else 'spot'}: preemption rate {rate:.2f} "
        f"({recent} of {recent + spot_nodes} spot nodes in the last "
        f"{cfg.preemption_window_s:.0f}s) is {'above' if over else 'at most'} "
        f"{cfg.max_preemption_fraction:.2f}"
    )


def use_spot(pool: Pool, spot_nodes: int, history: PoolHistory, cfg: BurstConfig) -> bool:
    """Whether new nodes of ``pool`` should be spot (``market`` without the why)."""
    return market(pool, spot_nodes, history, cfg)[0]


# ---------------------------------------------------------------------- decision
def decide(snap: Snapshot, cfg: BurstConfig) -> list[Action]:
    """The actions of one tick (see the module docstring for the guarantees)."""
    actions: list[Action] = []
    pools = snap.pools
    preempted_pools = {name for _, name in snap.preempted}
    for node, name in snap.preempted:
        what = "lost: on-demand node" if node in snap.on_demand_lost else "preempted: node"
        actions.append(Forget(node, name, f"{what} vanished without being released"))

    # Nodes of each provisioned pool, running and starting, against its max.
    count: dict[str, int] = {name: 0 for name in pools}
    spot_nodes: dict[str, int] = {name: 0 for name in pools}
    for n in snap.nodes:
        if n.owned and n.pool in count:
            count[n.pool] += 1
            spot_nodes[n.pool] += n.spot
    for s in snap.starting:
        if s.pool in count:
            count[s.pool] += 1
    staying = dict(count)  # what min_nodes keeps: nodes on their way out are not kept
    for _, name in snap.leaving:
        if name in count:
            count[name] += 1

    # Capacity in slots per pool: free slots of registered nodes plus the slots
    # of nodes still starting. Static pools are drawn on first.
    free: dict[str, int] = {}
    for n in snap.nodes:
        free[n.pool] = free.get(n.pool, 0) + max(0, n.slots - n.running)
    for s in snap.starting:
        if s.pool in pools:
            free[s.pool] = free.get(s.pool, 0) + pools[s.pool].slots

    wanted_slots: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for b in sorted(snap.backlog, key=lambda b: -b.oldest_wait_s):
        eligible = [p for p in b.pools if p in pools]
        order = sorted(eligible, key=lambda p: (p not in b.preferred, pools[p].provisioned))
        need = slots_to_drain(b.pending, b.task_s, cfg.target_drain_s)
        for p in order:
            take = min(need, free.get(p, 0))
            free[p] = free.get(p, 0) - take
            need -= take
        urgent = any(p in preempted_pools for p in eligible)
        if need <= 0 or (b.oldest_wait_s < cfg.wait_threshold_s and not urgent):
            continue
        for p in order:
            pool = pools[p]
            if not pool.provisioned or need <= 0:
                continue
            planned = nodes_for_slots(wanted_slots.get(p, 0), pool.slots)
            room = (pool.max_nodes - count[p] - planned) * pool.slots
            take = min(need, max(0, room))
            if take > 0:
                wanted_slots[p] = wanted_slots.get(p, 0) + take
                need -= take
                why = "replace preempted node" if p in preempted_pools else "backlog"
                reasons.setdefault(
                    p,
                    f"{why}: {b.pending} pending in {b.key} for {b.oldest_wait_s:.0f}s, "
                    f"~{b.task_s:.0f}s each",
                )

    for p, slots in sorted(wanted_slots.items()):
        pool = pools[p]
        more = min(nodes_for_slots(slots, pool.slots), pool.max_nodes - count[p])
        if more <= 0:
            continue
        history = snap.history.get(p, PoolHistory())
        now_lost = sum(1 for node, name in snap.preempted
                       if name == p and node not in snap.on_demand_lost)
        if now_lost:  # the preemptions of this tick count at once
            history = PoolHistory((0.0,) * now_lost + history.preempted_s_ago,
                                  history.refused_s_ago)
        spot, why = market(pool, spot_nodes[p], history, cfg)
        actions.append(Launch(p, more, spot, reasons[p], why))

    # Releases: idle past the timeout, not below min, not while scaling up.
    releasing: dict[str, int] = {}
    for n in sorted(snap.nodes, key=lambda n: (-n.idle_s, n.name)):
        its_pool = pools.get(n.pool)
        if not n.owned or n.running or its_pool is None or n.pool in wanted_slots:
            continue
        if n.idle_s < its_pool.idle_timeout:
            continue
        if staying[n.pool] - releasing.get(n.pool, 0) <= its_pool.min_nodes:
            continue
        releasing[n.pool] = releasing.get(n.pool, 0) + 1
        actions.append(Release(n.name, n.pool, f"idle for {n.idle_s:.0f}s"))
    for s in snap.starting:
        if s.waited_s >= cfg.boot_timeout_s:
            actions.append(
                Release(s.name, s.pool, f"did not register within {cfg.boot_timeout_s:.0f}s")
            )
    return actions
