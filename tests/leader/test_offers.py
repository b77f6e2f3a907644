"""The leader's offer planning between whole plans: only what changed is looked at, and
the offers stay what a whole plan would allow (each block to one node, claimable, live,
no node short while a block waits). Pure: a view fed key by key, no etcd."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hypermesh.agent.leader.offers import OFFER_AHEAD, RESCAN_S, Offers, claimable
from hypermesh.state.blocks import Batch, ResultEntry
from hypermesh.state.keyspace import BlockRef, TaskRef
from hypermesh.state.records import NodeRecord
from tests.state.test_model import Feed
from tests.state.test_own_watch import offer, offered_feed
from tests.tasks.test_blocks import TRIVIAL, batch, feed_block

Changes = list[tuple[str, tuple[BlockRef, ...] | None]]


def offers_of(feed: Feed) -> Offers:
    return Offers(cast(Any, SimpleNamespace(view=feed.view)))


def claim(feed: Feed, bref: BlockRef, node: str) -> None:
    feed.put(feed.ks.block_claim(bref), {"node": node, "lease": 1})


def finish(feed: Feed, bref: BlockRef, node: str) -> None:
    results = tuple(ResultEntry(bref.first + k, "succeeded", 1, 0, 1.0) for k in range(2))
    batch(feed, bref, f"{node}-{bref.first}", Batch(node, (), results))
    feed.delete(feed.ks.block_claim(bref))


def test_a_round_looks_only_at_what_changed_and_writes_one_offer_per_claim() -> None:
    feed, b = offered_feed({"n1": True, "n2": True}, 8)
    offers = offers_of(feed)
    assert offers.changes(0.0) == [("n1", (b[0], b[1])), ("n2", (b[2], b[3]))]
    assert offers.changes(0.1) == []  # nothing changed: nothing planned, nothing written
    assert feed.view.offer_blocks == set()
    claim(feed, b[0], "n1")
    assert feed.view.offer_blocks == {b[0]}
    assert offers.changes(0.2) == [("n1", (b[1], b[4]))]
    finish(feed, b[0], "n1")  # a finished block offered to no one changes no offer
    assert offers.changes(0.3) == []
    claim(feed, b[5], "n9")  # a node that chooses itself took a waiting block
    claim(feed, b[2], "n2")
    assert offers.changes(0.4) == [("n2", (b[3], b[6]))]
    feed.delete(feed.ks.block_claim(b[5]))  # released unfinished: it waits again
    claim(feed, b[3], "n2")
    assert offers.changes(0.5) == [("n2", (b[6], b[7]))]
    claim(feed, b[1], "n1")
    assert offers.changes(0.6) == [("n1", (b[4], b[5]))]


def test_an_offer_whose_every_block_went_elsewhere_is_filled_again() -> None:
    feed, b = offered_feed({"n1": True}, 4)
    offers = offers_of(feed)
    offers.changes(0.0)
    claim(feed, b[0], "self")  # a node that chooses itself took both offered blocks
    claim(feed, b[1], "self")
    assert offers.changes(0.1) == [("n1", (b[2], b[3]))]


def test_changes_to_nodes_or_workflows_and_the_rescan_plan_everything_again() -> None:
    feed, b = offered_feed({"n1": True, "n2": True}, 6)
    offers = offers_of(feed)
    offers.changes(0.0)
    feed.put(feed.ks.node("n2"), NodeRecord("n2", "a:1", offers=True,
                                            state="draining").to_json())
    assert offers.changes(0.1) == [("n2", None)]  # a whole plan: n2's offer goes
    feed.put(feed.ks.node("n3"), NodeRecord("n3", "a:1", offers=True).to_json())
    assert offers.changes(0.2) == [("n3", (b[2], b[3]))]
    # The rescan finds a block a whole plan passed as finished and a retry reopened.
    finish(feed, b[4], "n1")
    finish(feed, b[5], "n1")
    feed.view.offer_blocks = set()  # as if these changes had been seen
    assert offers.changes(0.3) == []
    assert offers.changes(RESCAN_S + 1) == []
    feed.put(feed.ks.experiment_control("w", "e"), {"cancelled": True})
    assert offers.changes(RESCAN_S + 2) == [("n1", ()), ("n3", ())]


def test_a_node_that_joins_once_every_block_is_offered_takes_a_busy_nodes_second() -> None:
    # A burst node arrives for the backlog: the blocks kept in the busy node's offer for
    # later go to it, or it would idle until its idle timeout released it.
    feed, b = offered_feed({"n1": True}, 3)
    offers = offers_of(feed)
    assert offers.changes(0.0) == [("n1", (b[0], b[1]))]
    claim(feed, b[0], "n1")
    assert offers.changes(0.1) == [("n1", (b[1], b[2]))]
    feed.put(feed.ks.node("n2"), NodeRecord("n2", "a:1", offers=True).to_json())
    assert offers.changes(0.2) == [("n1", (b[1],)), ("n2", (b[2],))]
    feed.put(feed.ks.node("n3"), NodeRecord("n3", "a:1", offers=True).to_json())
    assert offers.changes(0.3) == []  # one block each is as far as sharing goes


def test_a_node_whose_offer_empties_takes_a_busy_nodes_second_then_its_unclaimed_one() -> None:
    # At the end of the work: n2 claims its only block while n1 (busy: its slots full)
    # still holds two it has not claimed; n2 takes n1's second in the same round, not at
    # the next whole plan. Sharing stops at one block each, so b[0] stays with n1 until
    # it has been offered there for RESCAN_S; the next whole plan gives it to n2.
    feed, b = offered_feed({"n1": True, "n2": True}, 3)
    offers = offers_of(feed)
    assert offers.changes(0.0) == [("n1", (b[0], b[1])), ("n2", (b[2],))]
    claim(feed, b[2], "n2")
    assert offers.changes(0.1) == [("n2", (b[1],)), ("n1", (b[0],))]
    claim(feed, b[1], "n2")
    assert offers.changes(0.2) == [("n2", ())]  # one block each is as far as sharing goes
    assert offers.changes(RESCAN_S - 0.1) == []  # not a whole plan yet: nothing moves
    assert offers.changes(RESCAN_S + 0.1) == [("n1", ()), ("n2", (b[0],))]
    claim(feed, b[0], "n2")
    assert offers.changes(RESCAN_S + 0.2) == [("n2", ())]


def test_a_block_offered_for_a_while_stays_where_it_is_when_no_node_is_left_without() -> None:
    # b[0] and b[1] are old offers, but every node has one: nothing is gained by a move.
    feed, b = offered_feed({"n1": True, "n2": True}, 2)
    offers = offers_of(feed)
    assert offers.changes(0.0) == [("n1", (b[0],)), ("n2", (b[1],))]
    assert offers.changes(3 * RESCAN_S) == []


def test_a_new_leader_counts_an_offer_it_found_from_its_first_plan() -> None:
    # Offers a former leader wrote, still valid, are not written again, but their age
    # counts from the new leader's first plan: after RESCAN_S more they may move.
    feed, b = offered_feed({"n1": True, "n2": True}, 1)
    offer(feed, "n1", (b[0],))
    feed.put(feed.ks.offer("n2"), {"blocks": []})
    offers = offers_of(feed)
    assert offers.changes(100.0) == []
    assert offers.changes(100.0 + RESCAN_S) == [("n1", ()), ("n2", (b[0],))]


def test_gpu_work_is_offered_where_gossip_says_a_gpu_is_free() -> None:
    # One-task blocks of a GPU experiment (a large mesh), two GPU nodes: g1's GPUs are
    # all busy, g2 has one free, g3 has not gossiped yet. g1 is offered none (it would
    # hold them while g2 idles); a node gossip knows nothing of is offered as before.
    feed = Feed()
    feed.workflow("w", TRIVIAL.replace("samples: 10", "samples: 10\n    hardware: {gpus: 1}"),
                  state="running")
    for name in ("g1", "g2", "g3"):
        feed.put(feed.ks.node(name), NodeRecord(name, "a:1", gpus=2, offers=True).to_json())
    b = [feed_block(feed, "w", first, 1) for first in range(6)]
    feed.put(feed.ks.expanded("w", "e"), {"count": 6})
    free = {"g1": 0.0, "g2": 1.0}
    offers = offers_of(feed)
    offers.free_gpus = free.get
    assert offers.changes(0.0) == [("g2", (b[0], b[1])), ("g3", (b[2], b[3]))]
    # g1 has a GPU free by the time g2 claims one: the round that refills g2's offer
    # gives g1 the blocks that waited.
    free["g1"] = 1.0
    claim(feed, b[0], "g2")
    assert offers.changes(0.1) == [("g2", (b[1],)), ("g1", (b[4], b[5]))]
    # g2's GPUs fill up (a per-task GPU claim, say): the next whole plan takes b[1] back
    # from it, and no busy node, nor g2 itself, is given it.
    free["g2"] = 0.0
    assert offers.changes(RESCAN_S + 1) == [("g2", ())]
    free["g2"] = 2.0
    assert offers.changes(2 * RESCAN_S + 2) == [("g2", (b[1],))]


def test_a_mirror_that_loads_again_has_its_offers_planned_whole() -> None:
    feed, _ = offered_feed({"n1": True}, 4)
    offers = offers_of(feed)
    offers.changes(0.0)
    epoch = feed.view.offer_epoch
    feed.view.reset()
    assert feed.view.offer_blocks is None and feed.view.offer_epoch > epoch
    offers.handed_over()
    assert feed.view.offer_blocks is None


def end_or_release(feed: Feed, rng: random.Random) -> BlockRef | None:
    """A held block, chosen at random, ends (returned) or is released unfinished."""
    held = sorted(feed.view.block_claims)
    if not held:
        return None
    pick = rng.choice(held)
    if rng.random() < 0.7:
        finish(feed, pick, "x")
        return pick
    feed.delete(feed.ks.block_claim(pick))
    return None


@pytest.mark.parametrize("seed", range(6))
def test_random_changes_keep_every_offer_valid_and_no_node_short_while_blocks_wait(
    seed: int,
) -> None:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(6)]
    feed, b = offered_feed({n: True for n in names} | {"self": False}, 30)
    offers = offers_of(feed)
    written: dict[str, tuple[BlockRef, ...]] = {}
    finished: set[BlockRef] = set()
    whole_plans = 0
    for step in range(400):
        roll = rng.random()
        open_blocks = [x for x in b if x not in finished]
        if roll < 0.45 and open_blocks:  # a node claims an offered block, or any block
            offered = [x for blocks in written.values() for x in blocks]
            pick = rng.choice(offered) if offered and rng.random() < 0.8 else rng.choice(b)
            if claimable(feed.view, pick):
                holder = next((n for n, bl in written.items() if pick in bl), "self")
                claim(feed, pick, holder)
        elif roll < 0.75:  # a held block ends, or is released unfinished
            ended = end_or_release(feed, rng)
            if ended is not None:
                finished.add(ended)
        elif roll < 0.8:  # a node drains or comes back
            name = rng.choice(names)
            state = rng.choice(["alive", "draining"])
            feed.put(feed.ks.node(name), NodeRecord(name, "a:1", offers=True,
                                                    state=state).to_json())
        whole_plans += feed.view.offer_epoch != offers._epoch
        for name, blocks in offers.changes(step * 0.01):  # never a rescan: 4 s in all
            written[name] = blocks or ()
        check(feed, written)
    assert whole_plans < 40  # most rounds planned only what changed


def check(feed: Feed, written: dict[str, tuple[BlockRef, ...]]) -> None:
    """What a whole plan promises: each offered block to one taker, claimable and live;
    a taker short of offers only when no claimable block is left to offer."""
    view = feed.view
    offered = [x for blocks in written.values() for x in blocks]
    assert len(offered) == len(set(offered)), written
    takers = {n for n, rec in view.nodes.items() if rec.offers and rec.state == "alive"}
    for name, blocks in written.items():
        assert not blocks or name in takers, (name, blocks)
        assert len(blocks) <= OFFER_AHEAD
        assert all(claimable(view, x) for x in blocks), (name, blocks)
    if any(len(written.get(n, ())) < OFFER_AHEAD for n in takers):
        spare = [BlockRef("w", "e", first) for first in view.block_firsts("w", "e")]
        spare = [x for x in spare if claimable(view, x) and x not in offered]
        assert not spare, (written, spare)
    counts = {len(written.get(n, ())) for n in takers}
    assert not {0, OFFER_AHEAD} <= counts, written  # nothing for one, two for another


class FakeLocality:
    """Who holds each task's data (by index), as ``Locality.holder`` would say."""

    def __init__(self, holders: dict[int, str | None]) -> None:
        self.delay_s = 3.0
        self.looked_up = 0
        self.holders = holders
        self.forgotten: set[int] = set()

    def holder(self, view: object, ref: TaskRef) -> str | None:
        return self.holders.get(ref.index)

    def forget(self, keep: Collection[TaskRef]) -> None:
        self.forgotten = {r.index for r in keep}


def test_a_block_is_kept_for_the_node_that_holds_its_data_for_the_locality_delay() -> None:
    # One-task blocks of an experiment with inputs (a large mesh). b0-b2 and b6 are n1's
    # data, b3 n2's; b4's inputs are still being looked up; b5's data nobody holds.
    feed = Feed()
    feed.workflow("w", TRIVIAL.replace("samples: 10", "samples: 7\n    data: {s: s}\n"
                                       "    inputs: 's/shard-{{task_index}}'"),
                  state="running")
    for name in ("n1", "n2", "n3"):
        feed.put(feed.ks.node(name), NodeRecord(name, "a:1", offers=True).to_json())
    b = [feed_block(feed, "w", first, 1) for first in range(7)]
    feed.put(feed.ks.expanded("w", "e"), {"count": 7})
    locality = FakeLocality({0: "n1", 1: "n1", 2: "n1", 3: "n2", 4: "", 5: None, 6: "n1"})
    wakes: list[float] = []
    offers = offers_of(feed)
    offers.locality = locality
    offers.wake_at = wakes.append
    # n3 holds none of it: it gets b5 (nobody's), shared from n2, and nothing n1 holds.
    assert offers.changes(0.0) == [("n1", (b[0], b[1])), ("n2", (b[3],)), ("n3", (b[5],))]
    assert 3.0 in wakes  # a round when the first keeping ends
    assert locality.forgotten == {0, 1, 2, 3, 4, 5, 6}
    # n1 claims b0: its offer takes the next block it holds, not one waiting for anyone.
    claim(feed, b[0], "n1")
    assert offers.changes(1.0) == [("n1", (b[1], b[2]))]
    # b4's inputs were looked up: n3 holds them.
    locality.holders[4] = "n3"
    locality.looked_up += 1
    assert offers.changes(1.1) == [("n3", (b[5], b[4]))]
    assert offers.changes(2.0) == []  # nothing changed, no keeping ended
    # 3 s on: n1 (one slot, running b0) gives up b1 and b2, kept and offered to it but
    # not claimed, and b6 waits for any node too: n2 takes the lowest, and n1 is filled
    # again only from the next round on, after the others.
    assert offers.changes(3.0) == [("n1", ()), ("n2", (b[3], b[1]))]
    claim(feed, b[3], "n2")
    assert dict(offers.changes(3.1)) == {"n2": (b[1],), "n1": (b[2], b[6])}


@pytest.mark.parametrize("seed", range(6))
def test_random_changes_keep_blocks_for_their_data_and_no_node_short_while_others_wait(
    seed: int,
) -> None:
    # As above, with every task's data held by a node (or by none, or being looked up)
    # and a clock that lets keepings end: a block is offered only to the node it is kept
    # for while kept, and a node is short only while every block left is kept for another.
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(6)]
    feed = Feed()
    feed.workflow("w", TRIVIAL.replace("samples: 10", "samples: 60\n    data: {s: s}\n"
                                       "    inputs: 's/shard-{{task_index}}'"),
                  state="running")
    for i, name in enumerate(names):  # n0-n2 soon busy (they give kept blocks up), n3-n5 never
        feed.put(feed.ks.node(name), NodeRecord(name, "a:1", offers=True,
                                                slots=1 if i < 3 else 100).to_json())
    b = [feed_block(feed, "w", first, 2) for first in range(0, 60, 2)]
    feed.put(feed.ks.expanded("w", "e"), {"count": 60})
    locality = FakeLocality({x.first: rng.choice([*names, "elsewhere", None, ""]) for x in b})
    offers = offers_of(feed)
    offers.locality = locality
    written: dict[str, tuple[BlockRef, ...]] = {}
    for step in range(400):
        now = step * 0.05  # 20 s: keepings (3 s) end, whole plans (5 s) come
        roll = rng.random()
        if roll < 0.4:  # a node claims an offered block
            offered = [(n, x) for n, blocks in written.items() for x in blocks]
            if offered:
                node, pick = rng.choice(offered)
                claim(feed, pick, node)
        elif roll < 0.7:  # a held block ends, or is released unfinished
            end_or_release(feed, rng)
        elif roll < 0.75:  # a lookup ends
            waiting = [i for i, h in locality.holders.items() if h == ""]
            if waiting:
                locality.holders[rng.choice(waiting)] = rng.choice(names)
                locality.looked_up += 1
        for name, blocks in offers.changes(now):
            written[name] = blocks or ()
        check_kept(feed, offers, locality, written, now)


def check_kept(feed: Feed, offers: Offers, locality: FakeLocality,
               written: dict[str, tuple[BlockRef, ...]], now: float) -> None:
    view = feed.view
    offered = [x for blocks in written.values() for x in blocks]
    assert len(offered) == len(set(offered)), written

    def kept_for(x: BlockRef) -> str | None:
        since = offers._open_since.get(x, now)
        return locality.holders[x.first] if now - since < locality.delay_s else None

    for name, blocks in written.items():
        assert len(blocks) <= OFFER_AHEAD
        for x in blocks:
            assert claimable(view, x), (name, x)
            assert kept_for(x) in (None, name), (name, x, kept_for(x))
    spare = [BlockRef("w", "e", first) for first in view.block_firsts("w", "e")]
    spare = [x for x in spare if claimable(view, x) and x not in offered]
    held = Counter(claim.node for claim in view.block_claims.values())
    for name in names_short(view, written):
        if held[name] >= view.nodes[name].slots:
            continue  # busy: it may have given kept blocks up this round (filled next)
        bad = [(x.first, kept_for(x)) for x in spare if kept_for(x) in (None, name)]
        assert not bad, (name, bad, offers._kept_by.get(bad[0] and spare[0]), written)


def names_short(view: Any, written: dict[str, tuple[BlockRef, ...]]) -> list[str]:
    return [n for n, rec in view.nodes.items()
            if rec.offers and rec.state == "alive" and len(written.get(n, ())) < OFFER_AHEAD]


def test_a_block_is_kept_for_a_preferred_pools_node_with_room_for_the_pool_delay() -> None:
    # One-task blocks of an experiment that prefers pool onprem (a large mesh): p1 (onprem)
    # has room for 4, c1 (cloud) too. The first four blocks are kept for p1, the rest go
    # to c1 at once; a kept block p1 does not get to within the delay goes to anyone.
    feed = Feed()
    feed.workflow("w", TRIVIAL.replace("samples: 10", "samples: 6\n    prefer_pools: [onprem]"),
                  state="running")
    feed.put(feed.ks.node("p1"), NodeRecord("p1", "a:1", pool="onprem", slots=4,
                                            offers=True).to_json())
    feed.put(feed.ks.node("c1"), NodeRecord("c1", "a:1", pool="cloud", slots=4,
                                            offers=True).to_json())
    b = [feed_block(feed, "w", first, 1) for first in range(6)]
    feed.put(feed.ks.expanded("w", "e"), {"count": 6})
    offers = offers_of(feed)
    offers.pool_delay = 5.0
    assert offers.changes(0.0) == [("c1", (b[4], b[5])), ("p1", (b[0], b[1]))]
    assert offers._kept == {"p1": {b[2]: None, b[3]: None}}
    claim(feed, b[0], "p1")  # p1's offer takes the next block kept for it
    assert offers.changes(1.0) == [("p1", (b[1], b[2]))]
    claim(feed, b[4], "c1")  # not one kept for p1
    assert offers.changes(2.0) == [("c1", (b[5],))]
    assert offers.changes(5.0) == [("c1", (b[5], b[3]))]  # b3 waited 5 s: anyone's
    # Without a pool delay, no block is kept: the same blocks in order.
    fresh = offers_of(feed)
    assert fresh.changes(6.0) == [("c1", (b[1], b[2])), ("p1", (b[3], b[5]))]
