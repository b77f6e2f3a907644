"""agent/burst/view.py: the policy's inputs derived from a mirrored view (pure, fed by hand)."""

from __future__ import annotations

import pytest

from hypermesh.agent.burst import view as burst_view
from hypermesh.agent.burst.policy import Backlog, NodeState, Starting
from hypermesh.state.pools import Pool
from hypermesh.state.records import NodeRecord
from tests.claims.test_claims import Feed

CLOUD = Pool("cloud", kind="local", max_nodes=3, slots=2)
GPU_CLOUD = Pool("gpu", kind="local", max_nodes=3, gpus=1, gpu_type="a100")
POOLS = {"cloud": CLOUD, "gpu": GPU_CLOUD}


def node(feed: Feed, name: str, pool: str = "onprem", slots: int = 1, state: str = "alive",
         spot: bool = False) -> None:
    feed.put(feed.ks.node(name),
             NodeRecord(name, "a:1", pool=pool, slots=slots, state=state, spot=spot).to_json())


def sweep(feed: Feed, extra: str = "", count: int = 4) -> None:
    feed.workflow("w", f"experiments:\n  e:\n    command: echo\n{extra}")
    feed.tasks("w", "e", count)


def test_undeclared_node_pools_are_free_static_pools() -> None:
    feed = Feed()
    node(feed, "n1", pool="onprem")
    pools = burst_view.pools_in_use(feed.view, POOLS)
    assert pools["onprem"] == Pool("onprem") and pools["cloud"] is CLOUD


def test_backlog_waits_from_when_it_first_appeared() -> None:
    feed = Feed()
    node(feed, "n1")
    sweep(feed)
    pools = burst_view.pools_in_use(feed.view, POOLS)
    items, since = burst_view.backlog(feed.view, pools, {}, 100.0, 7.0)
    assert items == (Backlog("w/e", 4, 0.0, 7.0, ("cloud", "gpu", "onprem")),)
    items, since = burst_view.backlog(feed.view, pools, since, 130.0, 7.0)
    assert items[0].oldest_wait_s == 30.0
    # The backlog empties: its clock is forgotten.
    for ref in feed.view.task_refs("w"):
        feed.claim(ref)
    items, since = burst_view.backlog(feed.view, pools, since, 140.0, 7.0)
    assert items == () and since == {}


@pytest.mark.parametrize(
    ("extra", "pending", "pools"),
    [
        ("", 4, ("cloud", "gpu", "onprem")),                 # no hardware asked: every pool
        ("    hardware: {gpu: a100}\n", 4, ("gpu",)),        # only the GPU pool's nodes fit
        ("    pools: [gpu, cloud]\n", 4, ("gpu", "cloud")),  # the recipe's order
        ("    pools: [onprem]\n", 4, ("onprem",)),
        ("    workers: 2\n", 2, ("cloud", "gpu", "onprem")),  # the cap bounds what can start
    ],
)
def test_backlog_eligible_pools_and_pending(extra: str, pending: int,
                                            pools: tuple[str, ...]) -> None:
    feed = Feed()
    node(feed, "n1")
    sweep(feed, extra)
    in_use = burst_view.pools_in_use(feed.view, {"cloud": CLOUD, "gpu": GPU_CLOUD})
    (item,), _ = burst_view.backlog(feed.view, in_use, {}, 0.0, 1.0)
    expected = pools if extra else ("cloud", "onprem")
    if not extra:
        # No hardware asked: every pool fits, in name order.
        expected = ("cloud", "gpu", "onprem")
    assert (item.pending, item.pools) == (pending, expected)


def test_mean_task_duration_from_successful_attempts() -> None:
    feed = Feed()
    sweep(feed)
    refs = feed.view.task_refs("w")
    for ref, seconds in zip(refs, (10.0, 20.0), strict=False):
        feed.put(feed.ks.attempt(ref, 1), {"attempt": 1, "node": "n", "state": "succeeded",
                                           "started_at": 0.0, "ended_at": seconds})
    feed.put(feed.ks.attempt(refs[2], 1), {"attempt": 1, "node": "n", "state": "failed",
                                           "started_at": 0.0, "ended_at": 99.0})
    assert burst_view.mean_task_s(feed.view, "w", "e", 5.0) == 15.0
    assert burst_view.mean_task_s(feed.view, "w", "other", 5.0) == 5.0


def test_nodes_idle_time_and_ownership() -> None:
    feed = Feed()
    sweep(feed)
    node(feed, "n1")
    node(feed, "cloud-1", pool="cloud", slots=2, spot=True)
    node(feed, "cloud-2", pool="cloud", state="draining")
    feed.put(feed.ks.instance("cloud-1"), {"pool": "cloud", "state": "running"})
    feed.claim(feed.view.task_refs("w")[0], node="n1")
    states, busy = burst_view.nodes(feed.view, {}, 50.0)
    assert states == (
        NodeState("cloud-1", "cloud", True, 2, 0, 0.0, True),
        NodeState("n1", "onprem", False, 1, 1, 0.0, False),
    )
    states, busy = burst_view.nodes(feed.view, busy, 80.0)
    assert [(s.name, s.idle_s) for s in states] == [("cloud-1", 30.0), ("n1", 0.0)]


def test_starting_and_vanished_records() -> None:
    feed = Feed()
    node(feed, "cloud-2", pool="cloud")
    feed.put(feed.ks.instance("cloud-1"), {"pool": "cloud", "spot": True, "state": "starting",
                                           "requested_at": 90.0})
    feed.put(feed.ks.instance("cloud-2"), {"pool": "cloud", "state": "running"})
    feed.put(feed.ks.instance("cloud-3"), {"pool": "cloud", "state": "running"})
    feed.put(feed.ks.instance("cloud-4"), {"pool": "cloud", "state": "releasing"})
    assert burst_view.starting(feed.view, 100.0) == (Starting("cloud-1", "cloud", True, 10.0),)
    assert burst_view.vanished(feed.view) == (("cloud-3", "cloud"),)


def test_released_and_draining_nodes_are_leaving() -> None:
    feed = Feed()
    node(feed, "cloud-1", pool="cloud", state="draining")  # a spot notice: not yet marked
    node(feed, "cloud-2", pool="cloud")
    node(feed, "cloud-3", pool="cloud")
    feed.put(feed.ks.instance("cloud-1"), {"pool": "cloud", "state": "starting"})
    feed.put(feed.ks.instance("cloud-2"), {"pool": "cloud", "state": "running"})
    feed.put(feed.ks.instance("cloud-3"), {"pool": "cloud", "state": "releasing"})
    feed.put(feed.ks.instance("cloud-4"), {"pool": "cloud", "state": "releasing"})  # gone
    assert burst_view.leaving(feed.view) == (
        ("cloud-1", "cloud"), ("cloud-3", "cloud"), ("cloud-4", "cloud")
    )
    states, _ = burst_view.nodes(feed.view, {}, 100.0)
    starting = burst_view.starting(feed.view, 100.0)
    # Every record is counted once: alive, starting or leaving.
    assert {s.name for s in states} == {"cloud-2", "cloud-3"} and starting == ()


def test_a_node_gone_before_the_leader_marked_it_running_vanished() -> None:
    """A spot node that registers and is preempted between two burst ticks stays
    ``starting`` in its record; the view saw it up, so it is gone, not booting."""
    feed = Feed()
    feed.put(feed.ks.instance("cloud-1"), {"pool": "cloud", "spot": True, "state": "starting",
                                           "requested_at": 90.0})
    feed.put(feed.ks.instance("cloud-2"), {"pool": "cloud", "spot": True, "state": "starting",
                                           "requested_at": 90.0})
    node(feed, "cloud-1", pool="cloud")
    feed.delete(feed.ks.node("cloud-1"))
    assert burst_view.starting(feed.view, 100.0) == (Starting("cloud-2", "cloud", True, 10.0),)
    assert burst_view.vanished(feed.view) == (("cloud-1", "cloud"),)
    # Its record dropped (forgotten), nothing of it is left in the view.
    feed.delete(feed.ks.instance("cloud-1"))
    assert burst_view.vanished(feed.view) == () and "cloud-1" not in feed.view.booted


def test_node_seconds_per_pool_and_workflow() -> None:
    feed = Feed()
    sweep(feed)
    node(feed, "n1", slots=2)
    node(feed, "c1", pool="cloud", spot=True)
    refs = feed.view.task_refs("w")
    feed.claim(refs[0], node="n1")
    feed.claim(refs[1], node="c1")
    feed.put(feed.ks.instance("c1"), {"pool": "cloud", "spot": True, "state": "running"})
    feed.put(feed.ks.instance("c2"), {"pool": "cloud", "spot": True, "state": "starting"})
    feed.put(feed.ks.instance("c3"), {"pool": "cloud", "spot": False, "state": "releasing"})
    per_pool, per_wf = burst_view.node_seconds(feed.view, 2.0)
    # c1 registered, c2 booting and c3 going away are all billed; n1 is static.
    assert per_pool == {"onprem": {"on_demand_s": 2.0},
                        "cloud": {"spot_s": 4.0, "on_demand_s": 2.0}}
    # One of n1's two slots: half its time; all of c1's.
    assert per_wf == {"w": {"onprem": {"on_demand_s": 1.0}, "cloud": {"spot_s": 2.0}}}
