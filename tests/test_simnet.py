"""Many SWIM members on the simulated network: convergence, crashes, loss, partitions."""

from __future__ import annotations

import pytest
from hypermesh.agent.gossip_config import GossipConfig
from hypermesh.agent.simnet import SimNet
from hypermesh.agent.suspicion import push_pull_period, suspicion_bounds

CFG = GossipConfig.local()
P = CFG.protocol_period


def all_see(net: SimNet, member: str, state: str) -> bool:
    views = net.views_of(member)
    return views[state] == sum(views.values())


def test_members_joining_through_one_seed_converge() -> None:
    # All join within one period: gossip alone leaves a few holes (early joiners count few
    # members, so they retransmit little); push-pull fills them.
    cfg = GossipConfig.local(push_pull_interval=0.5)
    net = SimNet(120, cfg, seed=3, bootstrap="join")
    net.run_until(2 * push_pull_period(120, cfg))
    for node in net.nodes:
        assert node.live_count() == 120, node.name
    assert not net.deaths
    assert net.stats.by_kind["push_pull"] >= 119


def test_a_meta_change_reaches_everyone_within_a_few_periods() -> None:
    net = SimNet(150, CFG, seed=4)
    net.run_periods(2)
    watch = net.watch("n7")
    start = net.now
    net.nodes[7].set_meta({"free_gpus": 3}, net.now)
    net.at(net.now, lambda: net._reschedule(7))
    net.run_periods(6)
    seen = watch.meta[1]
    assert set(seen) == set(net.names)  # n7 itself included
    assert max(seen.values()) - start <= 4 * P
    assert all(n.member("n7").meta == {"free_gpus": 3} for n in net.nodes)  # type: ignore[union-attr]


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


def test_a_refused_crash_is_known_dead_within_about_a_period() -> None:
    net = SimNet(100, CFG, seed=5)
    net.run_periods(3)
    watch = net.watch("n9")
    crash = net.now
    net.crash("n9", refused=True)
    net.run_periods(10)
    dead = watch.states["dead"]
    assert len(dead) == 99
    assert min(dead.values()) - crash <= 2.5 * P
    assert max(dead.values()) - crash <= 6 * P
    assert "suspect" not in watch.states or min(watch.states["suspect"].values()) >= min(
        dead.values()) - 1e-9
    assert not net.false_deaths


def test_ten_percent_loss_makes_suspicions_but_no_false_deaths() -> None:
    net = SimNet(100, CFG, seed=6, loss=0.10)
    net.run_periods(300)
    assert net.transitions[("alive", "suspect")] > 0  # the loss is felt...
    assert net.false_deaths == []  # ...and refuted in time
    assert all(node.live_count() == 100 for node in net.nodes)


def test_a_partition_kills_each_side_for_the_other_and_healing_revives_them() -> None:
    net = SimNet(60, CFG, seed=7)
    net.run_periods(2)
    left, right = net.names[:30], net.names[30:]
    net.partition([left, right])
    _, high = suspicion_bounds(60, CFG)
    net.run_until(net.now + high + 10 * P)
    assert all_see(net, "n0", "dead") is False  # its own side still sees it alive
    assert net.nodes[40].member("n0").state == "dead"  # type: ignore[union-attr]
    assert net.nodes[5].member("n50").state == "dead"  # type: ignore[union-attr]
    assert net.nodes[5].member("n6").state == "alive"  # type: ignore[union-attr]
    net.heal()
    net.run_until(net.now + 2 * push_pull_period(60, CFG))
    for node in net.nodes:
        assert node.live_count() == 60, node.name
        for name in (left[3], right[3]):
            view = node.member(name)
            assert view is not None and view.state == "alive" and view.incarnation >= 1


def test_a_member_paused_for_less_than_the_suspicion_timeout_is_not_declared_dead() -> None:
    n = 80
    net = SimNet(n, CFG, seed=8)
    net.run_periods(3)
    low, _ = suspicion_bounds(n, CFG)
    watch = net.watch("n11")
    net.pause("n11")
    net.run_until(net.now + low * 0.7)
    assert len(watch.states.get("suspect", {})) > 0  # it was missed
    net.resume("n11")
    assert net.nodes[11].local_health >= 1  # its late tick counted against itself
    net.run_periods(20)
    assert "dead" not in watch.states and not net.false_deaths
    assert all_see(net, "n11", "alive")
    assert net.nodes[11].incarnation >= 1  # it refuted


def test_a_member_that_leaves_is_seen_left_not_dead() -> None:
    net = SimNet(50, CFG, seed=9)
    net.run_periods(2)
    net.at(net.now, lambda: net._call(3, net.nodes[3].leave(net.now)))
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
