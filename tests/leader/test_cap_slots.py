"""The leader's offers of a capped experiment's one-task blocks (a large mesh): each
offered block carries a slot of the ``workers`` cap that nothing else holds or is
given, no more blocks are held and offered than the cap allows, a block goes only to a
node with room for it, and every block still runs. Pure: a view fed key by key."""

from __future__ import annotations

import random

import pytest

from hypermesh.agent.leader.offers import OFFER_AHEAD, Offers, claimable
from hypermesh.state.blocks import Batch, ResultEntry
from hypermesh.state.keyspace import BlockRef, TaskRef
from hypermesh.state.records import NodeRecord
from tests.leader.test_offers import offers_of
from tests.state.test_model import Feed
from tests.tasks.test_blocks import TRIVIAL, batch, feed_block

Written = dict[str, tuple[BlockRef, ...]]


def capped_feed(workers: int, blocks: int, slots: dict[str, int]) -> tuple[Feed, list[BlockRef]]:
    """A running workflow whose experiment has ``workers`` as its cap and ``blocks``
    one-task blocks, and nodes that choose from offers (name -> slots)."""
    feed = Feed()
    recipe = TRIVIAL.replace("samples: 10", f"samples: {blocks}\n    workers: {workers}")
    feed.workflow("w", recipe, state="running")
    for name, n in slots.items():
        feed.put(feed.ks.node(name), NodeRecord(name, "a:1", slots=n, offers=True).to_json())
    refs = [feed_block(feed, "w", first, 1) for first in range(blocks)]
    feed.put(feed.ks.expanded("w", "e"), {"count": blocks})
    return feed, refs


def claim_with(feed: Feed, bref: BlockRef, node: str, slot: int) -> bool:
    """A claim of ``bref`` with cap slot ``slot``, refused (False) as etcd would: the
    block or the slot is held."""
    key = feed.ks.block_slot("w", "e", slot)
    if bref in feed.view.block_claims or slot in feed.view.block_slots.get(("w", "e"), {}):
        return False
    feed.put(feed.ks.block_claim(bref), {"node": node, "lease": 1})
    feed.put(key, {"node": node, "first": bref.first})
    return True


def end(feed: Feed, bref: BlockRef, done: bool) -> None:
    """The holder's last flush: the result (if ``done``), the claim and its slot go."""
    held = [k for k, first in feed.view.block_slots.get(("w", "e"), {}).items()
            if first == bref.first]
    if done:
        batch(feed, bref, f"x-{bref.first}",
              Batch("x", (), (ResultEntry(bref.first, "succeeded", 1, 0, 1.0),)))
    feed.delete(feed.ks.block_claim(bref))
    for k in held:
        feed.delete(feed.ks.block_slot("w", "e", k))


def publish(feed: Feed, offers: Offers, now: float, written: Written) -> None:
    """Plan, and apply the offers as the leader writes them (with their slots)."""
    for name, blocks in offers.changes(now):
        written[name] = blocks or ()
        if blocks is None:
            feed.delete(feed.ks.offer(name))
        else:
            feed.put(feed.ks.offer(name), {"blocks": [offers._row(b) for b in blocks]})


def slots_of(feed: Feed, written: Written) -> dict[BlockRef, int]:
    return {b: k for blocks in written.values() for b in blocks
            for k in [feed.view.offered_slots[("w", "e")].get(b)] if k is not None}


def test_offers_give_each_block_a_free_slot_and_no_more_than_the_cap_has_room_for() -> None:
    feed, b = capped_feed(3, 8, {"n1": 2, "n2": 2, "n3": 4})
    offers = offers_of(feed)
    written: Written = {}
    publish(feed, offers, 0.0, written)
    # Three blocks offered, with slots 0, 1 and 2; the other five wait for the cap.
    assert slots_of(feed, written) == {b[0]: 0, b[1]: 1, b[2]: 2}
    assert written["n1"] == (b[0], b[1]) and written["n2"] == (b[2],), written
    assert not written.get("n3")
    # n1 takes b[0] with its slot: nothing frees, nothing more is offered.
    assert claim_with(feed, b[0], "n1", 0)
    publish(feed, offers, 0.1, written)
    assert written["n1"] == (b[1],) and not written.get("n3")
    # b[0] ends: its slot goes back, and b[3] is offered with it to a node with room.
    end(feed, b[0], done=True)
    publish(feed, offers, 0.2, written)
    assert slots_of(feed, written) == {b[1]: 1, b[2]: 2, b[3]: 0}
    # A node that watches everything takes slot 1, which b[1]'s offer gave: that claim
    # of b[1] is refused, and the next whole plan gives b[1] a slot that is free.
    assert claim_with(feed, b[4], "self", 1)
    assert not claim_with(feed, b[1], "n1", 1)
    publish(feed, offers, 6.0, written)
    offered = slots_of(feed, written)
    assert b[1] not in offered  # three held or offered: b[4], b[2], b[3]
    assert sorted(offered.values()) == [0, 2]


def test_a_node_is_offered_capped_blocks_only_for_its_free_slots() -> None:
    # The cap has room for 6, but n1 has one slot and it is busy: n1 is offered none.
    feed, b = capped_feed(6, 8, {"n1": 1, "n2": 2})
    feed.put(feed.ks.block_claim(BlockRef("w", "other", 0)), {"node": "n1", "lease": 1})
    offers = offers_of(feed)
    written: Written = {}
    publish(feed, offers, 0.0, written)
    assert not written.get("n1") and written["n2"] == (b[0], b[1]), written


def test_a_cap_changed_live_is_what_the_next_plan_offers_for() -> None:
    feed, _ = capped_feed(2, 6, {"n1": 4, "n2": 4})
    offers = offers_of(feed)
    written: Written = {}
    publish(feed, offers, 0.0, written)
    assert len(slots_of(feed, written)) == 2
    feed.put(feed.ks.experiment_control("w", "e"), {"workers": 4, "workers_set": True})
    publish(feed, offers, 0.1, written)
    assert sorted(slots_of(feed, written).values()) == [0, 1, 2, 3]
    for bref, k in slots_of(feed, written).items():
        assert claim_with(feed, bref, "n1", k)
    feed.put(feed.ks.experiment_control("w", "e"), {"workers": 1, "workers_set": True})
    publish(feed, offers, 0.2, written)
    assert slots_of(feed, written) == {}  # four held, the cap is one: none until three end
    for bref in list(feed.view.block_claims)[:3]:
        end(feed, bref, done=True)
    publish(feed, offers, 0.3, written)
    assert slots_of(feed, written) == {}
    end(feed, next(iter(feed.view.block_claims)), done=True)
    publish(feed, offers, 0.4, written)
    assert list(slots_of(feed, written).values()) == [0]


@pytest.mark.parametrize("seed", range(8))
def test_random_claims_and_ends_never_pass_the_cap_and_every_block_runs(seed: int) -> None:
    rng = random.Random(seed)
    slots = {f"n{i}": rng.randint(1, 3) for i in range(5)}
    workers = rng.randint(1, 6)
    feed, b = capped_feed(workers, 40, slots)
    offers = offers_of(feed)
    written: Written = {}
    done: set[BlockRef] = set()
    step = 0
    while len(done) < len(b):
        step += 1
        assert step < 3000, f"{len(done)} of {len(b)} blocks ran"
        roll = rng.random()
        held = sorted(feed.view.block_claims)
        if roll < 0.5:  # a node with a free slot claims an offered block with its slot
            offered = slots_of(feed, written)
            if offered:
                bref = rng.choice(sorted(offered))
                node = next(n for n, blocks in written.items() if bref in blocks)
                if sum(c.node == node for c in feed.view.block_claims.values()) < slots[node]:
                    claim_with(feed, bref, node, offered[bref])
        elif roll < 0.6:  # a node that watches everything claims with a slot it sees free
            free = feed.view.free_block_slots("w", feed.view.workflows["w"].recipe
                                              .experiment("e"))
            open_blocks = [x for x in b if claimable(feed.view, x)]
            if free and open_blocks:
                claim_with(feed, rng.choice(open_blocks), "self", rng.choice(free))
        elif held:  # a held block ends, or is released unfinished
            bref = rng.choice(held)
            finished = rng.random() < 0.8
            end(feed, bref, finished)
            if finished:
                done.add(bref)
        publish(feed, offers, step * 0.01, written)
        check(feed, written, workers, slots)


def check(feed: Feed, written: Written, workers: int, slots: dict[str, int]) -> None:
    view = feed.view
    offered = slots_of(feed, written)
    taken = view.block_slots.get(("w", "e"), {})
    assert len(taken) <= workers and all(k < workers for k in taken)
    assert len(set(offered.values())) == len(offered)  # no slot given twice
    assert not set(offered.values()) & set(taken), (offered, taken)  # nor one held
    assert len(taken) + len(offered) <= workers
    room = {}
    for name in slots:
        blocks = written.get(name, ())
        assert all(b in offered for b in blocks)  # every block of the experiment has one
        running = sum(c.node == name for c in view.block_claims.values())
        assert len(blocks) <= slots[name] - running, (name, blocks)
        room[name] = min(OFFER_AHEAD, slots[name] - running) - len(blocks)
    # No node with room goes without while the cap has room and a block waits.
    firsts = view.block_firsts("w", "e")
    waiting = [b for b in (BlockRef("w", "e", f) for f in firsts)
               if claimable(view, b) and b not in offered]
    if waiting and len(taken) + len(offered) < workers:
        assert not [n for n, r in room.items() if r > 0], (room, waiting)


def test_a_new_leader_writes_again_an_offer_whose_slot_it_gives_otherwise() -> None:
    feed, b = capped_feed(3, 4, {"n1": 2})
    feed.put(feed.ks.offer("n1"), {"blocks": [["w", "e", 0, 2], ["w", "e", 1, 0]]})
    offers = offers_of(feed)
    written: Written = {}
    publish(feed, offers, 0.0, written)
    assert written == {"n1": (b[0], b[1])}  # the same blocks, with the slots it gives
    assert slots_of(feed, written) == {b[0]: 0, b[1]: 1}


def test_blocks_waiting_for_the_cap_are_dropped_with_their_workflow() -> None:
    feed, b = capped_feed(1, 4, {"n1": 2})
    offers = offers_of(feed)
    written: Written = {}
    publish(feed, offers, 0.0, written)
    assert written == {"n1": (b[0],)} and offers._caps.penned
    assert claim_with(feed, b[0], "n1", 0)
    publish(feed, offers, 0.1, written)
    for key in (feed.ks.workflow_state("w"), feed.ks.workflow("w")):
        feed.delete(key)
    end(feed, b[0], done=False)  # a slot frees as the workflow goes
    publish(feed, offers, 0.2, written)
    publish(feed, offers, 0.3, written)
    assert written == {"n1": ()} and not offers._caps.penned and not offers._caps.given


def test_the_mirror_counts_what_each_node_runs_and_holds() -> None:
    feed, b = capped_feed(3, 4, {"n1": 2})
    view = feed.view
    ref = feed.ks.claim(TaskRef("w", "other", 0))
    feed.put(ref, {"node": "n1", "attempt": 1, "lease": 1})
    feed.put(ref, {"node": "n1", "attempt": 1, "lease": 1})  # the same claim again
    assert claim_with(feed, b[0], "n1", 0)
    assert (view.node_running["n1"], view.node_blocks["n1"]) == (1, 1)
    assert view.block_claim_counts[("w", "e")] == 1
    feed.delete(ref)  # no leader plans offers here: nobody is told
    assert view.node_running["n1"] == 0 and view.load_dropped == set()
    view.offer_blocks = set()  # a leader's view: a node whose load fell is noted
    feed.put(feed.ks.block_claim(b[0]), {"node": "n1", "lease": 1})  # the same holder
    assert view.node_blocks["n1"] == 1 and view.load_dropped == set()
    end(feed, b[0], done=True)
    assert view.node_blocks["n1"] == 0 and view.load_dropped == {"n1"}
    assert view.block_claim_counts[("w", "e")] == 0
