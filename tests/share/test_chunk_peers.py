"""ChunkPeers and the holder choice, driven directly: pure logic, no agents."""

from __future__ import annotations

from collections import Counter

import pytest

from hypermesh.agent.share.config import MIN_PEER_RATE, ShareConfig, transfer_deadline
from hypermesh.agent.share.peers import ChunkPeers, holder_order, race_delay
from hypermesh.state.node_rows import hit_rates


def ids(*names: str) -> list[str]:
    return [f"{n:0<64}" for n in names]


def gossip(src: ChunkPeers, dst: ChunkPeers) -> bool:
    """Hand ``src``'s meta to ``dst``; True when ``dst`` wants a snapshot."""
    return dst.observe(src.name, {"chunks": src.meta(), "running": 0})


def alive(*peers: ChunkPeers) -> None:
    for a in peers:
        for b in peers:
            a.member_state(b.name, "alive")


def test_deltas_keep_a_replica_in_step_without_snapshots() -> None:
    a, b = ChunkPeers("a"), ChunkPeers("b")
    alive(a, b)
    assert not gossip(a, b)  # both empty at version 0
    c1, c2, c3 = ids("1", "2", "3")
    a.update_own([c1, c2])
    assert not gossip(a, b)
    a.update_own([c2, c3])  # one scan: c1 left, c3 came; one delta
    assert a.meta()["v"] == 3 and a.meta()["delta"] == {"b": 1, "v": 3, "a": [c3], "r": [c1]}
    assert not gossip(a, b)
    assert b.holders(c3) == {"a"} and b.holders(c1) == frozenset()
    assert b.stale() == []


def test_a_missed_delta_asks_for_a_snapshot_which_brings_the_replica_in_step() -> None:
    a, b = ChunkPeers("a"), ChunkPeers("b")
    alive(a, b)
    c1, c2 = ids("1", "2")
    a.update_own([c1])
    a.update_own([c1, c2])  # b never saw the first delta
    assert gossip(a, b)
    assert b.stale() == ["a"]
    b.load_snapshot("a", a.snapshot())
    assert b.stale() == [] and b.holders(c1) == {"a"}
    assert not gossip(a, b)  # the same meta again changes nothing


def test_a_large_delta_is_left_out_of_the_meta() -> None:
    a = ChunkPeers("a", max_delta_bytes=200)
    a.update_own(ids(*"123456"))
    assert "delta" not in a.meta() and a.meta()["v"] == 1
    b = ChunkPeers("b")
    alive(a, b)
    assert gossip(a, b)


def test_a_restarted_peer_is_resynced_even_at_a_lower_version() -> None:
    a, b = ChunkPeers("a"), ChunkPeers("b")
    alive(a, b)
    c1, c2 = ids("1", "2")
    for held in ([c1], [c1, c2], [c2]):
        a.update_own(held)
        gossip(a, b)
    fresh = ChunkPeers("a")
    fresh.update_own([c1])  # version 1 again, different content
    assert gossip(fresh, b)
    b.load_snapshot("a", fresh.snapshot())
    assert b.holders(c1) == {"a"} and b.holders(c2) == frozenset()


def test_holders_leave_out_suspect_and_dead_members_and_include_this_node() -> None:
    a, b, me = ChunkPeers("a"), ChunkPeers("b"), ChunkPeers("me")
    alive(a, b, me)
    (c,) = ids("c")
    for peer in (a, b):
        peer.update_own([c])
        gossip(peer, me)
    me.update_own([c])
    assert me.holders(c) == {"a", "b", "me"}
    assert set(me.peer_holders(c)) == {"a", "b"}
    me.member_state("a", "suspect")
    assert me.holders(c) == {"b", "me"}
    me.member_state("b", "dead")  # forgotten: back alive, it is synced afresh
    assert me.holders(c) == {"me"}
    me.member_state("b", "alive")
    assert me.holders(c) == {"me"} and me.replica_size("b") == 0
    assert not gossip(b, me)  # its one delta starts at 0: the fresh replica applies it
    assert me.holders(c) == {"b", "me"}


def test_malformed_meta_is_ignored() -> None:
    me = ChunkPeers("me")
    good = {"chunks": {"v": 1, "d": "0" * 16}}
    assert not me.observe("a", good)  # a member gossip has not reported alive: ignored
    me.member_state("a", "alive")
    for meta in ({}, {"chunks": 3}, {"chunks": {"v": "1", "d": "x"}}):
        assert not me.observe("a", meta)
    bad_delta = {"v": 2, "d": "0" * 16, "delta": {"b": 5, "v": 2}}
    assert me.observe("a", {"chunks": bad_delta})  # the delta is refused, the digest differs


def test_holder_order_is_stable_and_spreads_chunks_over_holders() -> None:
    holders = [f"node{i}" for i in range(4)]
    chunks = [f"{i:064x}" for i in range(400)]
    firsts = Counter(holder_order(c, holders)[0] for c in chunks)
    assert set(firsts) == set(holders)
    assert min(firsts.values()) >= 60  # about 100 each
    for c in chunks[:20]:
        order = holder_order(c, holders)
        assert order == holder_order(c, reversed(holders))  # every node agrees
        # a holder leaving moves only the chunks it was first for
        rest = holder_order(c, holders[1:])
        assert rest == [h for h in order if h != "node0"]


def test_share_config_checks_its_ranges() -> None:
    assert ShareConfig.local().scan_period_s < ShareConfig.lan().scan_period_s
    cfg = ShareConfig.lan()
    assert cfg.mount_timeout_s > cfg.dedup_wait_s + cfg.peer_timeout_s
    with pytest.raises(ValueError, match="peer_timeout_s"):
        ShareConfig(peer_timeout_s=0)
    with pytest.raises(ValueError, match="peer_tries"):
        ShareConfig(peer_tries=0)


def test_hit_rates_are_shares_of_blocks_by_source() -> None:
    assert hit_rates({"cache": 6, "peer": 3, "store": 1}) == {"cache": 0.6, "peer": 0.3,
                                                             "store": 0.1}
    assert hit_rates({"cache": 0, "peer": 0, "store": 0}) is None  # nothing read yet
    assert hit_rates(None) is None and hit_rates({"cache": -1, "peer": 0, "store": 1}) is None


@pytest.mark.parametrize(
    ("cache_full", "won_here", "delay"),
    [(False, False, 0.0), (True, False, 0.5), (True, True, 0.0), (False, True, 0.0)],
)
def test_only_a_node_without_room_races_late(
    cache_full: bool, won_here: bool, delay: float
) -> None:
    assert race_delay(cache_full, won_here, 0.5) == delay
    assert race_delay(cache_full, won_here, 0.0) == 0.0  # switched off


def test_held_elsewhere_names_chunks_another_alive_node_holds() -> None:
    a, b, c = ChunkPeers("a"), ChunkPeers("b"), ChunkPeers("c")
    alive(a, b, c)
    x, y, z = ids("x", "y", "z")
    a.update_own([x, y, z])
    b.update_own([x])
    c.update_own([y])
    gossip(b, a)
    gossip(c, a)
    assert a.held_elsewhere([x, y, z]) == {x, y}
    a.member_state("c", "dead")  # a dead node's chunks count for nothing
    assert a.held_elsewhere([x, y, z]) == {x}


@pytest.mark.parametrize(
    ("first", "length", "deadline"),
    [(1.0, 0, 1.0), (1.0, 16 << 20, 1.0 + (16 << 20) / MIN_PEER_RATE), (0.5, MIN_PEER_RATE, 1.5)],
)
def test_a_transfer_may_take_its_first_piece_time_plus_its_length_at_the_least_rate(
    first: float, length: int, deadline: float
) -> None:
    assert transfer_deadline(first, length) == pytest.approx(deadline)
