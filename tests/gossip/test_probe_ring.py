"""Probe targets along the ring: in a period every member is probed by one other, so a
member that falls silent is first probed within about a period, whatever N."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hypermesh.agent.gossip import probe
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.simnet import SimNet
from hypermesh.agent.gossip.suspicion import probe_deadline
from hypermesh.agent.gossip.swim import Swim

CFG = GossipConfig.local()
P = CFG.protocol_period


def targets(nodes: list[Swim], now: float) -> dict[str, str | None]:
    return {node.name: probe._next_target(node, now) for node in nodes}


def assert_derangement(chosen: dict[str, str | None]) -> None:
    """Every member probes another, and each is probed by exactly one."""
    assert all(t is not None and t != name for name, t in chosen.items()), chosen
    assert Counter(chosen.values()) == Counter(chosen.keys()), chosen


def test_ring_strides_are_the_same_everywhere_and_never_a_full_turn() -> None:
    for size in (2, 3, 32):
        assert {probe.ring_stride(period, size) for period in range(2_000)} == set(range(1, size))
    strides = {probe.ring_stride(period, 1000) for period in range(2_000)}
    assert min(strides) >= 1 and max(strides) <= 999 and len(strides) > 800
    # A pure function of the period's number, not of the process (no salted hash):
    assert [probe.ring_stride(p, 977) for p in (0, 1, 1_800_000_000)] == [1, 336, 545]


@pytest.mark.parametrize("bootstrap", ["roster", "join"])
def test_in_a_period_every_member_is_probed_by_exactly_one_other(bootstrap: str) -> None:
    # "join": each member learned the others in its own order (through one seed, by
    # gossip and push-pull); the ring is by name, so they still agree on it.
    net = SimNet(40, GossipConfig.local(push_pull_interval=0.5), seed=3, bootstrap=bootstrap)
    net.run_periods(12)
    assert all(node.live_count() == 40 for node in net.nodes)
    strides = set()
    for period in range(200, 230):
        now = period * P + 0.3 * P
        assert_derangement(targets(net.nodes, now))
        strides.add(probe.ring_stride(period, 40))
    assert len(strides) > 10  # a different derangement most periods, not one fixed ring


def test_members_with_their_own_monotonic_clocks_agree_through_the_wall_clock() -> None:
    net = SimNet(12, CFG, seed=2)
    net.run_periods(3)
    rng = random.Random(7)
    wall = 1_800_000_000.25
    chosen = {}
    for node in net.nodes:
        mono = rng.uniform(0.0, 1e6)  # every agent's monotonic clock starts elsewhere
        node.clock_offset = wall - mono
        chosen[node.name] = probe._next_target(node, mono)
    assert_derangement(chosen)


def test_a_dead_members_target_is_probed_by_its_prober() -> None:
    net = SimNet(16, CFG, seed=4)
    net.run_periods(3)
    net.crash("n5")
    net.run_periods(20)
    live = [node for node in net.nodes if node.name != "n5"]
    assert all(node.member("n5").state == "dead" for node in live)  # type: ignore[union-attr]
    for period in range(100, 120):
        # n5's prober probes whom n5 would have: the live members still make one ring
        assert_derangement(targets(live, period * P))


@pytest.mark.parametrize(("n", "seed"), [(32, 1), (200, 2)])
def test_a_silent_member_is_first_suspected_within_two_periods_of_falling_silent(
        n: int, seed: int) -> None:
    # With each member's own shuffled order a member went unprobed in a period with a
    # chance of about 1/e: the first suspicion of a silent member came 3 periods or more
    # after it fell silent about one time in twenty, and up to 7 here.
    net = SimNet(n, CFG, seed=seed)
    rng = random.Random(seed)
    net.run_periods(5)
    late = []
    for _ in range(25):
        victim = net.names[rng.randrange(n)]
        net.run_until(net.now + rng.random() * P)
        watch = net.watch(victim)
        watch.states.clear()
        silent = net.now
        net.pause(victim)
        suspects = watch.states.setdefault("suspect", {})
        while not suspects and net.now - silent < 10 * P:
            net.run_periods(0.05)
        late.append(min(suspects.values()) - silent)
        net.resume(victim)
        net.run_periods(15)
    assert max(late) <= 2 * P + probe_deadline(CFG) + 0.1 * P, late
