"""The bursting policy: table tests for each formula and each decision."""

from __future__ import annotations

import pytest

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
    market,
    nodes_for_slots,
    preemption_fraction,
    slots_to_drain,
    use_spot,
)
from hypermesh.errors import UsageError
from hypermesh.state.pools import Pool

CFG = BurstConfig(wait_threshold_s=60, target_drain_s=600, refusal_backoff_s=300,
                  preemption_window_s=3600, max_preemption_fraction=0.5, boot_timeout_s=900)
STATIC = Pool("onprem", price=0.5)
BURST = Pool("cloud", kind="local", price=1.0, spot_price=0.3, spot=True, max_nodes=3,
             idle_timeout=120)
POOLS = {p.name: p for p in (STATIC, BURST)}


def static_node(name: str = "s1", running: int = 1, slots: int = 1) -> NodeState:
    return NodeState(name, "onprem", False, slots, running, 0.0 if running else 500.0, False)


def cloud_node(name: str, running: int = 0, idle_s: float = 0.0, spot: bool = True) -> NodeState:
    return NodeState(name, "cloud", spot, 1, running, idle_s, True)


def backlog(pending: int, wait: float = 100.0, task_s: float = 600.0,
            pools: tuple[str, ...] = ("onprem", "cloud")) -> Backlog:
    return Backlog("wf/sweep", pending, wait, task_s, pools)


@pytest.mark.parametrize(
    ("pending", "task_s", "target", "slots"),
    [
        (0, 600, 600, 0),      # nothing pending: nothing needed
        (1, 600, 600, 1),
        (10, 600, 600, 10),    # ten 10-min tasks in 10 min: ten slots
        (10, 600, 1200, 5),
        (10, 600, 1800, 4),    # ceil(3.33)
        (10, 60, 600, 1),
        (3, 6000, 600, 3),     # never more slots than tasks
        (4096, 600, 1800, 1366),
    ],
)
def test_slots_to_drain(pending: int, task_s: float, target: float, slots: int) -> None:
    assert slots_to_drain(pending, task_s, target) == slots


@pytest.mark.parametrize(("slots", "per_node", "nodes"),
                         [(0, 1, 0), (1, 1, 1), (5, 2, 3), (4, 2, 2), (-3, 2, 0)])
def test_nodes_for_slots(slots: int, per_node: int, nodes: int) -> None:
    assert nodes_for_slots(slots, per_node) == nodes


@pytest.mark.parametrize(("preempted", "spot_nodes", "fraction"),
                         [(0, 0, 0.0), (0, 5, 0.0), (1, 3, 0.25), (2, 2, 0.5), (3, 0, 1.0)])
def test_preemption_fraction(preempted: int, spot_nodes: int, fraction: float) -> None:
    assert preemption_fraction(preempted, spot_nodes) == pytest.approx(fraction)


@pytest.mark.parametrize(
    ("pool", "spot_nodes", "history", "spot"),
    [
        (BURST, 0, PoolHistory(), True),
        (Pool("od", kind="local", max_nodes=2), 0, PoolHistory(), False),   # on-demand pool
        (BURST, 0, PoolHistory(refused_s_ago=10), False),                  # just refused
        (BURST, 0, PoolHistory(refused_s_ago=301), True),                  # backoff over
        (BURST, 2, PoolHistory(preempted_s_ago=(5, 10)), True),            # 2/4 = 0.5
        (BURST, 1, PoolHistory(preempted_s_ago=(5, 10)), False),           # 2/3 > 0.5
        (BURST, 1, PoolHistory(preempted_s_ago=(5000, 6000)), True),       # outside window
    ],
)
def test_use_spot(pool: Pool, spot_nodes: int, history: PoolHistory, spot: bool) -> None:
    assert use_spot(pool, spot_nodes, history, CFG) is spot


@pytest.mark.parametrize(
    ("pool", "spot_nodes", "history", "why"),
    [
        (BURST, 0, PoolHistory(), "spot: preemption rate 0.00 (0 of 0 spot nodes in the last "
                                  "3600s) is at most 0.50"),
        (Pool("od", kind="local", max_nodes=2), 0, PoolHistory(),
         "on-demand: the pool is on-demand"),
        (BURST, 0, PoolHistory(refused_s_ago=10),
         "on-demand: spot capacity refused 10s ago (backoff 300s)"),
        (BURST, 2, PoolHistory(preempted_s_ago=(5, 10)),
         "spot: preemption rate 0.50 (2 of 4 spot nodes in the last 3600s) is at most 0.50"),
        (BURST, 1, PoolHistory(preempted_s_ago=(5, 10, 5000)),
         "on-demand: preemption rate 0.67 (2 of 3 spot nodes in the last 3600s) is above 0.50"),
    ],
)
def test_market_says_why(pool: Pool, spot_nodes: int, history: PoolHistory, why: str) -> None:
    spot, reason = market(pool, spot_nodes, history, CFG)
    assert reason == why
    assert spot is use_spot(pool, spot_nodes, history, CFG) is reason.startswith("spot")


def test_preemptions_seen_this_tick_count_towards_the_rate() -> None:
    # c1 vanished this tick (the duty adds it to the history only afterwards); with
    # c2 still alive the rate is 1 of 2: spot. With c2 gone too, 2 of 2: on-demand.
    one = Snapshot(POOLS, nodes=(static_node(), cloud_node("c2", running=1)),
                   backlog=(backlog(3, wait=1),), preempted=(("c1", "cloud"),))
    launch = next(a for a in decide(one, CFG) if isinstance(a, Launch))
    assert launch.spot is True and "rate 0.50 (1 of 2" in launch.market
    both = Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(3, wait=1),),
                    preempted=(("c1", "cloud"), ("c2", "cloud")))
    launch = next(a for a in decide(both, CFG) if isinstance(a, Launch))
    assert launch.spot is False
    assert launch.market.startswith("on-demand: preemption rate 1.00 (2 of 2")


def test_lost_on_demand_nodes_are_replaced_but_not_counted_as_preempted() -> None:
    snap = Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(3, wait=1),),
                    preempted=(("c1", "cloud"),), on_demand_lost=frozenset({"c1"}))
    forget, launch = decide(snap, CFG)
    assert forget == Forget("c1", "cloud", "lost: on-demand node vanished without being released")
    assert isinstance(launch, Launch) and launch.spot is True
    assert launch.reason.startswith("replace preempted node")
    assert launch.market.startswith("spot: preemption rate 0.00 (0 of 0")


def test_config_rejects_out_of_range_values() -> None:
    with pytest.raises(UsageError, match="target_drain_s 0 is out of range"):
        BurstConfig(target_drain_s=0)


@pytest.mark.parametrize(
    ("snapshot", "expected"),
    [
        # Nothing pending: nothing starts, even with an empty mesh.
        (Snapshot(POOLS), []),
        (Snapshot(POOLS, nodes=(static_node(running=0),)), []),
        # Static capacity is free: it takes the work; no cloud node.
        (Snapshot(POOLS, nodes=(static_node(running=0, slots=4),), backlog=(backlog(4),)), []),
        # Static full, but the work has not waited long enough.
        (Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(2, wait=30),)), []),
        # Static full, waited: enough nodes to drain 2 x 10 min within 10 min.
        (Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(2),)),
         [Launch("cloud", 2, True, "backlog: 2 pending in wf/sweep for 100s, ~600s each")]),
        # A big backlog: capped at max.
        (Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(50),)),
         [Launch("cloud", 3, True, "backlog: 50 pending in wf/sweep for 100s, ~600s each")]),
        # Short tasks: one node drains ten 1-minute tasks in 10 minutes.
        (Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(10, task_s=60),)),
         [Launch("cloud", 1, True, "backlog: 10 pending in wf/sweep for 100s, ~60s each")]),
        # Running plus starting nodes count against max.
        (Snapshot(POOLS, nodes=(static_node(), cloud_node("c1", running=1)),
                  starting=(Starting("c2", "cloud", True, 10),), backlog=(backlog(50),)),
         [Launch("cloud", 1, True, "backlog: 50 pending in wf/sweep for 100s, ~600s each")]),
        # At max: nothing more.
        (Snapshot(POOLS, nodes=(static_node(), *(cloud_node(f"c{i}", 1) for i in range(3))),
                  backlog=(backlog(50),)), []),
        # Starting nodes' slots already cover the backlog.
        (Snapshot(POOLS, nodes=(static_node(),), starting=(Starting("c1", "cloud", True, 5),),
                  backlog=(backlog(1),)), []),
        # The recipe restricts the experiment to the static pool: never burst.
        (Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(9, pools=("onprem",)),)), []),
        # Spot refused a moment ago: on-demand.
        (Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(1),),
                  history={"cloud": PoolHistory(refused_s_ago=1)}),
         [Launch("cloud", 1, False, "backlog: 1 pending in wf/sweep for 100s, ~600s each")]),
        # Idle past the timeout and nothing pending: released.
        (Snapshot(POOLS, nodes=(static_node(), cloud_node("c1", idle_s=121))),
         [Release("c1", "cloud", "idle for 121s")]),
        # Idle, but not long enough; busy nodes are never released.
        (Snapshot(POOLS, nodes=(cloud_node("c1", idle_s=60), cloud_node("c2", running=1))), []),
        # Static nodes are never released, however idle.
        (Snapshot(POOLS, nodes=(static_node(running=0),)), []),
        # A node that never registered is released after the boot timeout.
        (Snapshot(POOLS, starting=(Starting("c9", "cloud", True, 901),)),
         [Release("c9", "cloud", "did not register within 900s")]),
    ],
)
def test_decide(snapshot: Snapshot, expected: list[object]) -> None:
    assert decide(snapshot, CFG) == expected


def test_min_nodes_are_kept() -> None:
    pool = Pool("cloud", kind="local", spot=True, min_nodes=1, max_nodes=3, idle_timeout=10)
    snap = Snapshot({"cloud": pool}, nodes=(cloud_node("a", idle_s=50), cloud_node("b", idle_s=40)))
    assert decide(snap, CFG) == [Release("a", "cloud", "idle for 50s")]


def test_no_release_while_the_pool_scales_up() -> None:
    snap = Snapshot(POOLS, nodes=(static_node(), cloud_node("c1", idle_s=500)),
                    backlog=(backlog(5, pools=("onprem", "cloud")),))
    # c1 is idle (it cannot have taken tasks that fit it: free slots count first),
    # so the backlog of 5 uses its slot; the rest starts 2 more (max 3).
    actions = decide(snap, CFG)
    assert actions == [
        Launch("cloud", 2, True, "backlog: 5 pending in wf/sweep for 100s, ~600s each")
    ]


def test_preempted_node_is_forgotten_and_replaced_at_once() -> None:
    # The work left behind has waited only 1 s, but a preemption does not wait.
    # The duty records a preemption after the tick that saw it: history is empty.
    snap = Snapshot(POOLS, nodes=(static_node(), cloud_node("c2", running=1)),
                    backlog=(backlog(1, wait=1),), preempted=(("c1", "cloud"),))
    assert decide(snap, CFG) == [
        Forget("c1", "cloud", "preempted: node vanished without being released"),
        Launch("cloud", 1, True,
               "replace preempted node: 1 pending in wf/sweep for 1s, ~600s each"),
    ]


def test_preempted_node_is_not_replaced_when_no_work_remains() -> None:
    snap = Snapshot(POOLS, nodes=(static_node(running=0),), preempted=(("c1", "cloud"),))
    assert decide(snap, CFG) == [
        Forget("c1", "cloud", "preempted: node vanished without being released")
    ]


def test_frequent_preemptions_switch_to_on_demand() -> None:
    snap = Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(1),),
                    history={"cloud": PoolHistory(preempted_s_ago=(10, 20, 30))})
    (launch,) = decide(snap, CFG)
    assert isinstance(launch, Launch) and launch.spot is False


def test_preferred_pool_order_is_followed() -> None:
    a = Pool("a", kind="local", max_nodes=1, spot=True)
    b = Pool("b", kind="local", max_nodes=5)
    snap = Snapshot({"a": a, "b": b}, backlog=(backlog(3, pools=("a", "b")),))
    assert [(x.pool, x.count, x.spot) for x in decide(snap, CFG) if isinstance(x, Launch)] == [
        ("a", 1, True), ("b", 2, False)
    ]


@pytest.mark.parametrize("pending", [0, 1, 7, 100, 10_000])
@pytest.mark.parametrize("running_cloud", [0, 1, 3])
def test_never_exceeds_max(pending: int, running_cloud: int) -> None:
    nodes = (static_node(), *(cloud_node(f"c{i}", 1) for i in range(running_cloud)))
    snap = Snapshot(POOLS, nodes=nodes, backlog=(backlog(pending),) if pending else ())
    launched = sum(a.count for a in decide(snap, CFG) if isinstance(a, Launch))
    assert running_cloud + launched <= BURST.max_nodes
    if pending == 0:
        assert launched == 0


@pytest.mark.parametrize("leaving", [0, 1, 2, 3])
def test_nodes_on_their_way_out_count_against_max(leaving: int) -> None:
    """A released or draining node exists until it is gone: the pool never has more
    than max_nodes at once, so its replacement waits."""
    snap = Snapshot(POOLS, nodes=(static_node(),), backlog=(backlog(100),),
                    leaving=tuple((f"c{i}", "cloud") for i in range(leaving)))
    launched = sum(a.count for a in decide(snap, CFG) if isinstance(a, Launch))
    assert launched == BURST.max_nodes - leaving


def test_nodes_on_their_way_out_are_not_kept_for_min_nodes() -> None:
    pool = Pool("cloud", kind="local", max_nodes=3, min_nodes=1, idle_timeout=60)
    snap = Snapshot({"cloud": pool}, nodes=(cloud_node("c1", idle_s=600),),
                    leaving=(("c2", "cloud"),))
    assert not [a for a in decide(snap, CFG) if isinstance(a, Release)]
