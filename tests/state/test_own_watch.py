"""``--watch own`` against a real etcd: the mirror of a node that chooses blocks from
its offers never receives the block kinds, metrics, pruning medians, nor another node's
offer; a block claimed from an offer is read back whole (its tasks, its batches, the
attempts left running); the leader's offer plan gives each block to one node and keeps
what is still open."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from hypermesh.agent.leader.offers import plan_offers
from hypermesh.agent.tasks.blocks import _block_state, block_view
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.block_txns import claim_open_block, read_block
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace
from hypermesh.state.records import NodeRecord, dumps
from tests.state.test_model import Feed
from tests.tasks.test_blocks import TRIVIAL, batch, feed_block

DEADLINE_S = 10.0


def run(server: EtcdServer, scenario: Callable[[Etcd], Awaitable[None]]) -> None:
    async def main() -> None:
        async with Etcd([server.url.split("//")[1]]) as etcd:
            await scenario(etcd)

    asyncio.run(main())


async def until(done: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not done():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_the_own_mirror_sees_neither_blocks_nor_metrics_nor_other_offers(
    etcd_server: EtcdServer,
) -> None:
    ks = Keyspace(f"own{uuid.uuid4().hex[:8]}")
    bref = BlockRef("w1", "e", 0)
    kinds = {
        "seen": [ks.node("n1"), ks.workflow_state("w1"), ks.offer("n1"), ks.result(bref.task(0)),
                 ks.attempt(bref.task(0), 1), ks.claim(bref.task(0)), ks.workflow("w1")],
        "unseen": [ks.block(bref), ks.block_claim(bref), ks.block_batch(bref, 7, 1),
                   ks.offer("n10"), ks.offer("n"), ks.offer("n2"), ks.progress("w1"),
                   ks.metrics(bref.task(0), 1), ks.prune_medians("w1", "e")],
    }

    async def scenario(etcd: Etcd) -> None:
        applied: list[str] = []
        loaded = asyncio.Event()
        revisions: list[int] = []
        before = [await etcd.put(k, b"{}") for k in kinds["seen"][:2] + kinds["unseen"][:2]]
        mirror = asyncio.create_task(etcd.mirror(
            ks.root, lambda key, value, c, m: applied.append(key), revisions.append,
            ready=loaded, ranges=ks.own_ranges("n1")))
        try:
            await asyncio.wait_for(loaded.wait(), DEADLINE_S)
            assert sorted(applied) == sorted(kinds["seen"][:2])  # the load, cut the same way
            assert revisions[-1] >= max(before)
            for key in kinds["unseen"] + kinds["seen"]:
                await etcd.put(key, b"{}")
            last = await etcd.put(ks.settings, b"{}")
            await until(lambda: ks.settings in applied, "the last key")
            assert set(applied) == set(kinds["seen"]) | {ks.settings}
            assert last > revisions[0]
        finally:
            mirror.cancel()
            await asyncio.gather(mirror, return_exceptions=True)

    run(etcd_server, scenario)


def test_a_block_claimed_from_an_offer_is_read_back_whole(etcd_server: EtcdServer) -> None:
    ks = Keyspace(f"own{uuid.uuid4().hex[:8]}")
    bref = BlockRef("w1", "e", 4)
    params = [{"x": i} for i in range(4)]

    async def scenario(etcd: Etcd) -> None:
        await etcd.put(ks.block(bref), dumps({"params": params}))
        await etcd.put(ks.block(BlockRef("w1", "e", 40)), dumps({"params": [{"x": 99}]}))
        # An earlier holder: task 4 succeeded, 5 failed once (counted), 6 still running.
        batch = Batch("old", (
            AttemptEntry(4, 1, "succeeded", 0, None, 1.0, 2.0),
            AttemptEntry(5, 1, "failed", 1, "exit", 1.0, 2.0),
            AttemptEntry(6, 1, "running", started_at=3.0),
        ), (ResultEntry(4, "succeeded", 1, 0, 2.0),))
        await etcd.put(ks.block_batch(bref, 1, 1), dumps(batch.to_json()))
        lease = await etcd.grant(10)
        refusals: list[int] = []
        fence = await claim_open_block(etcd, ks, bref, "n1", lease, refusals.append)
        assert fence is not None and refusals == []
        again = await claim_open_block(etcd, ks, bref, "n2", lease, refusals.append)
        assert again is None and refusals and refusals[0] >= fence  # held: refused
        kvs = await read_block(etcd, ks, bref)
        assert [kv.key.decode() for kv in kvs] == [ks.block(bref), ks.block_batch(bref, 1, 1)]
        attempts, failures, left, todo = _block_state(block_view(ks, kvs), bref)
        assert attempts == {4: 1, 5: 1, 6: 1, 7: 0}
        assert failures == {4: 0, 5: 1, 6: 0, 7: 0}
        assert left == [(6, 1, "old", 3.0)]
        assert list(todo) == [5, 6, 7]
        assert block_view(ks, kvs).tasks[bref.task(3)] == {"params": {"x": 3}}

    run(etcd_server, scenario)


def offered_feed(nodes: dict[str, bool], blocks: int) -> tuple[Feed, list[BlockRef]]:
    """A running workflow whose experiment has ``blocks`` blocks of 2 tasks, and
    ``nodes`` (name -> whether it chooses from offers)."""
    feed = Feed()
    feed.workflow("w", TRIVIAL, state="running")
    for name, offers in nodes.items():
        feed.put(feed.ks.node(name), NodeRecord(name, "a:1", offers=offers).to_json())
    refs = [feed_block(feed, "w", first, 2) for first in range(0, 2 * blocks, 2)]
    feed.put(feed.ks.expanded("w", "e"), {"count": 2 * blocks})
    return feed, refs


def offer(feed: Feed, node: str, blocks: tuple[BlockRef, ...]) -> None:
    feed.put(feed.ks.offer(node), {"blocks": [[b.workflow, b.experiment, b.first]
                                              for b in blocks]})


def test_each_block_is_offered_to_one_node_and_an_offer_keeps_what_is_open() -> None:
    feed, b = offered_feed({"n1": True, "n2": True, "n3": False}, 6)
    cursors: dict[tuple[str, str], int] = {}
    first = plan_offers(feed.view, cursors)
    assert first == {"n1": (b[0], b[1]), "n2": (b[2], b[3])}  # n3 chooses itself
    offer(feed, "n1", first["n1"])
    offer(feed, "n2", first["n2"])
    # n1 claims b[0], b[2] is finished, b[4] is claimed by a node that chooses itself.
    feed.put(feed.ks.block_claim(b[0]), {"node": "n1", "lease": 1})
    batch(feed, b[2], "x", Batch("n2", (), (ResultEntry(4, "succeeded", 1, 0, 1.0),
                                            ResultEntry(5, "succeeded", 1, 0, 1.0))))
    feed.put(feed.ks.block_claim(b[4]), {"node": "n3", "lease": 3})
    assert plan_offers(feed.view, cursors) == {"n1": (b[1], b[5]), "n2": (b[3],)}
    # A node that drains or leaves is offered nothing; the cursor skipped nothing open.
    feed.put(feed.ks.node("n2"), NodeRecord("n2", "a:1", offers=True, state="draining").to_json())
    assert plan_offers(feed.view, cursors) == {"n1": (b[1], b[3])}
    assert cursors.get(("w", "e"), 0) == 0  # b[0] is held, not finished: the scan starts there
    feed.put(feed.ks.experiment_control("w", "e"), {"cancelled": True})
    assert plan_offers(feed.view, cursors) == {"n1": ()}
