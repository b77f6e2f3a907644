"""Many SWIM members on the simulated network: convergence, crashes, loss, partitions."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.simnet import SimNet
from hypermesh.agent.gossip.suspicion import push_pull_period, suspicion_bounds

CFG = GossipConfig.local()
P = CFG.protocol_period


def all_see(net: SimNet, member: str, state: str) -> bool:
    views = net.views_of(member)
    return views[state] == sum(views.values())


@pytest.mark.parametrize(("rows", "seed", "periods"), [(1000, 3, 2), (64, 3, 8), (64, 12, 8)])
def test_members_joining_through_one_seed_converge(rows: int, seed: int, periods: int) -> None:
    # All join within one period: gossip alone leaves a few holes (early joiners count few
    # members, so they retransmit little); push-pull fills them. Whole tables (rows 1000)
    # fill them within two push-pull periods; at most 64 rows an exchange, about half the
    # table, each hole waits for an exchange whose rows happen to hold it: the slowest of
    # twelve seeds took 5.5 push-pull periods (seed 12).
    cfg = GossipConfig.local(push_pull_interval=0.5, push_pull_rows=rows)
    net = SimNet(120, cfg, seed=seed, bootstrap="join")
    net.run_until(periods * push_pull_period(120, cfg))
    for node in net.nodes:
        assert node.live_count() == 120, node.name
    assert not net.deaths
    assert net.stats.by_kind["push_pull"] >= 119


def test_a_meta_change_reaches_everyone_within_a_few_periods() -> None:
    net = SimNet(150, CFG, seed=4)
    net.run_periods(2)
    watch = net.watch("n7")
    start = net.now
    net.set_meta("n7", {"state": "draining"})
    net.run_periods(6)
    seen = watch.meta[1]
    assert set(seen) == set(net.names)  # n7 itself included
    assert max(seen.values()) - start <= 4 * P
    assert all(n.member("n7").meta == {"state": "draining"} for n in net.nodes)  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_a_load_change_rides_only_on_probes_and_still_reaches_everyone(seed: int) -> None:
    # Task counts are quiet meta: no gossip round is sent for them, yet pings and acks
    # spread them epidemically (about log2 N periods; 4-5.2 measured at 150 members).
    net = SimNet(150, CFG, seed=seed)
    net.run_periods(2)
    watch = net.watch("n7")
    start, rounds = net.now, net.stats.by_kind.get("gossip", 0)
    net.set_meta("n7", {"free_gpus": 3})
    net.run_periods(10)
    seen = watch.meta[1]
    assert set(seen) == set(net.names)
    assert max(seen.values()) - start <= 8 * P
    assert net.stats.by_kind.get("gossip", 0) == rounds
    assert all(n.member("n7").meta == {"free_gpus": 3} for n in net.nodes)  # type: ignore[union-attr]


def busy(net: SimNet, counts: Callable[[int], int], loud_first: bool, periods: int) -> None:
    """Every member publishes ``counts(k)`` tasks running every 2 periods, k = 1, 2, ...,
    staggered over a fifth of a period; ``loud_first``: after a loud change of every
    member's meta at once (a state, as a drain of the whole mesh would be)."""
    start = net.now
    for i, name in enumerate(net.names):
        if loud_first:
            net.set_meta(name, {"state": "busy", "running": 0})
        for k in range(1, periods // 2):
            meta = {"state": "busy", "running": counts(k)}
            net.at(start + (i % 20) * P / 100 + 2 * P * k,
                   functools.partial(net.set_meta, name, meta))


def rounds_in(net: SimNet, periods: float) -> int:
    before = net.stats.by_kind.get("gossip", 0)
    net.run_periods(periods)
    return net.stats.by_kind.get("gossip", 0) - before


@pytest.mark.parametrize("loud_first", [False, True])
def test_a_busy_mesh_sends_no_gossip_rounds_for_its_load(loud_first: bool) -> None:
    # Every member's task count changes every 2 periods, as on one-slot nodes that run
    # short tasks. A one-slot node's count goes 1, 0, 1: a member that missed the 0
    # sees the same meta at a newer version, which once counted as loud news; and a
    # quiet change replacing a member's still-queued loud news kept it loud for ever
    # (each change came before the news had been sent its retransmit limit). Either
    # kept every member sending gossip rounds (about 2,900 per 10 periods here).
    net = SimNet(48, CFG, seed=1)
    net.run_periods(3)
    watch = net.watch("n7")
    busy(net, lambda k: k % 2 if not loud_first else k, loud_first, periods=100)
    rounds_in(net, 20)  # the loud news, if any, is spread and done with
    assert rounds_in(net, 60) == 0
    # The counts still reach everyone, on pings and acks: each member has seen n7's
    # counts change, lately.
    recent = net.now - 20 * P
    seen = {m for v, at in watch.meta.items() if v > 1 for m, t in at.items() if t >= recent}
    assert seen == set(net.names)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_silent_crash_is_known_dead_everywhere_within_the_bound(seed: int) -> None:
    n = 100
    net = SimNet(n, CFG, seed=seed)
    net.run_periods(3)
    watch = net.watch("n42")
    crash = net.now
    net.crash("n42")
    low, high = suspicion_bounds(n, CFG)
    net.run_until(crash + 4 * P + high + 4 * P)
    dead = watch.states["dead"]
    assert len(dead) == n - 1 and all_see(net, "n42", "dead")
    first_suspect = min(watch.states["suspect"].values())
    assert min(dead.values()) - first_suspect >= low  # never faster than the suspicion
    assert max(dead.values()) - crash <= 4 * P + high + 4 * P
    assert not net.false_deaths


@pytest.mark.parametrize("seed", [5, 19])
def test_a_refused_crash_is_known_dead_one_round_trip_after_its_first_refusal(seed: int) -> None:
    net = SimNet(100, CFG, seed=seed)
    net.run_periods(3)
    watch = net.watch("n9")
    net.crash("n9", refused=True)
    net.run_periods(20)
    dead = watch.states["dead"]
    assert len(dead) == 99
    first = net.first_refusal["n9"]
    round_trip = 2 * net.latency[1]
    assert min(dead.values()) - first <= 2 * round_trip  # refused, ping_req, refused, nack
    assert max(dead.values()) - first <= 5 * P  # then gossip; no suspicion is waited out
    assert not net.false_deaths


def test_ten_percent_loss_makes_suspicions_but_no_false_deaths() -> None:
    net = SimNet(150, CFG, seed=6, loss=0.10)
    net.run_periods(500)
    assert net.transitions[("alive", "suspect")] > 0  # the loss is felt...
    assert net.false_deaths == []  # ...and refuted in time
    assert all(node.live_count() == 150 for node in net.nodes)


def test_a_partition_kills_each_side_for_the_other_and_healing_revives_them() -> None:
    net = SimNet(60, CFG, seed=7)
    net.run_periods(2)
    left, right = net.names[:30], net.names[30:]
    net.partition([left, right])

    def across(state: str) -> bool:
        return all(
            net.nodes[net.index[a]].member(b).state == state  # type: ignore[union-attr]
            for side, other in ((left, right), (right, left))
            for a in side
            for b in other
        )

    # Half the indirect probers are unreachable, so every member's local health
    # drops (Lifeguard): each side probes, and accuses, more slowly than usual.
    for _ in range(60):
        net.run_periods(10)
        if across("dead"):
            break
    assert across("dead")
    assert all(net.nodes[5].member(b).state == "alive" for b in left)  # type: ignore[union-attr]
    assert max(node.local_health for node in net.nodes) >= 1
    net.heal()
    net.run_until(net.now + 2 * push_pull_period(60, CFG))
    for node in net.nodes:
        assert node.live_count() == 60, node.name
        for name in net.names:
            view = node.member(name)
            assert view is not None and view.state == "alive" and view.incarnation >= 1


def test_a_member_paused_for_less_than_the_suspicion_timeout_is_not_declared_dead() -> None:
    n = 80
    net = SimNet(n, CFG, seed=8)
    net.run_periods(3)
    low, _ = suspicion_bounds(n, CFG)
    watch = net.watch("n11")
    net.pause("n11")
    suspects = watch.states.setdefault("suspect", {})
    while not suspects:  # paused until it is missed...
        net.run_periods(0.1)
    net.run_until(min(suspects.values()) + low * 0.8)  # ...and most of the shortest timeout
    net.resume("n11")
    assert net.nodes[11].local_health >= 1  # its late tick counted against itself
    net.run_periods(20)
    assert "dead" not in watch.states and not net.false_deaths
    assert all_see(net, "n11", "alive")
    assert net.nodes[11].incarnation >= 1  # it refuted


def test_a_member_that_leaves_is_seen_left_not_dead() -> None:
    net = SimNet(50, CFG, seed=9)
    net.run_periods(2)
    net.leave("n3")
    net.run_periods(3)
    net.crash("n3")
    net.run_periods(30)
    assert all_see(net, "n3", "left") and not net.deaths


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="loss"):
        SimNet(3, CFG, loss=1.0)
    with pytest.raises(ValueError, match="latency"):
        SimNet(3, CFG, latency=(0.2, 0.1))
    with pytest.raises(ValueError, match="bootstrap"):
        SimNet(3, CFG, bootstrap="magic")
