"""``--watch own`` against a real etcd: the mirror of a node that chooses blocks from
its offers never receives the block kinds, metrics, pruning medians, nor another node's
offer, and a workflow's own keys only while it works on the workflow; a block claimed
from an offer is read back whole (its tasks, its batches, the attempts left running);
the leader's offer plan gives each block to one node and keeps what is still open."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from hypermesh.agent.leader.offers import plan_offers
from hypermesh.agent.tasks.blocks import _block_state, block_view
from hypermesh.etcd_watch import Following
from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.block_txns import claim_open_block, read_block
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import NodeRecord, WorkflowRecord, dumps
from hypermesh.state.view import MeshView
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
        "seen": [ks.node("n1"), ks.pool("p"), ks.offer("n1"), ks.result(bref.task(0)),
                 ks.attempt(bref.task(0), 1), ks.claim(bref.task(0)), ks.usage("p")],
        "unseen": [ks.block(bref), ks.block_claim(bref), ks.block_batch(bref, 7, 1),
                   ks.offer("n10"), ks.offer("n"), ks.offer("n2"), ks.progress("w1"),
                   ks.metrics(bref.task(0), 1), ks.prune_medians("w1", "e"),
                   # a workflow's own keys: followed only while it is worked on (below)
                   ks.workflow("w1"), ks.workflow_state("w1"), ks.expanded("w1", "e"),
                   ks.experiment_control("w1", "e"), ks.workflow_usage("w1")],
    }

    def watched(key: str) -> bool:
        return any(start <= key < end for start, end in ks.own_ranges("n1"))

    assert all(watched(k) for k in kinds["seen"]) and not any(map(watched, kinds["unseen"]))

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
            # One watcher per range: their answers may come in any order between them.
            await until(lambda: set(kinds["seen"]) | {ks.settings} <= set(applied),
                        "every key of the watched ranges")
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


def test_the_own_mirror_follows_a_workflow_from_the_first_key_naming_it_until_its_deletion(
    tmp_path: Path,
) -> None:
    """A node that watches its own part receives a workflow's keys (record, state,
    expansions, live changes) once its offer or a per-task key names the workflow, and
    from then on its changes, across an etcd restart; none once the workflow record is
    deleted, nor once it ended, until a task key of it is written again. A mirror that
    starts (or reloads) with followed workflows loads them, and forgets one deleted
    meanwhile."""
    server = EtcdServer(tmp_path / "etcd", fsync=False).start()
    ks = Keyspace(f"fol{uuid.uuid4().hex[:8]}")
    recipe = parse_recipe("experiments:\n  e:\n    samples: 4\n    command: ['true']\n")

    async def submitted(etcd: Etcd, wid: str) -> None:
        record = WorkflowRecord(id=wid, name=wid, recipe=recipe, seed=1, submitted_at=1.0,
                                workdir="/tmp")
        await etcd.put(ks.workflow(wid), dumps(record.to_json()))
        await etcd.put(ks.workflow_state(wid), dumps({"state": "running"}))
        await etcd.put(ks.expanded(wid, "e"), dumps({"count": 4}))

    async def deleted(etcd: Etcd, view: MeshView, wid: str) -> None:
        """Delete ``wid`` as hypermesh/state/cleanup.py does (its own keys, later the
        rest): the view forgets it, and receives none of its keys any more."""
        assert view.following is not None
        gone = await etcd.txn([], [etcd.op_delete(ks.workflow(wid)),
                                   etcd.op_delete(ks.workflow_state(wid))])
        assert gone.succeeded
        await until(lambda: wid not in view.following.followed, f"{wid} no longer followed")
        assert wid not in view.workflows and wid not in view.workflow_states
        assert (wid, "e") not in view.expanded  # forgotten: its deletion is not seen
        await etcd.txn([], [etcd.op_delete(ks.expanded(wid, "e"))])
        await etcd.put(ks.workflow_state(wid), dumps({"state": "running"}))  # a stray write
        await etcd.put(ks.pool(f"after-{wid}"), dumps({}))
        await until(lambda: f"after-{wid}" in view.pools, "the writes after the deletion")
        assert wid not in view.workflow_states

    def mirrored(etcd: Etcd, view: MeshView, loaded: asyncio.Event) -> asyncio.Task[None]:
        return asyncio.create_task(etcd.mirror(
            ks.root, view.apply, lambda revision: None, reset=view.reset, ready=loaded,
            ranges=ks.own_ranges("n1"), following=view.following))

    async def scenario(etcd: Etcd) -> None:
        for wid in ("w1", "w2", "w3"):
            await submitted(etcd, wid)
        view, loaded = MeshView(ks), asyncio.Event()
        following = view.following = Following(ks.workflow_ranges)
        mirror = mirrored(etcd, view, loaded)
        try:
            await asyncio.wait_for(loaded.wait(), DEADLINE_S)
            assert view.workflows == {} and view.expanded == {}
            await etcd.put(ks.offer("n1"), dumps({"blocks": [["w1", "e", 0]]}))
            await until(lambda: view.expanded.get(("w1", "e")) == 4, "w1 followed")
            assert view.workflow_state("w1") == "running" and set(view.workflows) == {"w1"}
            await etcd.put(ks.task(TaskRef("w2", "e", 0)), dumps({"params": {}}))
            await until(lambda: "w2" in view.workflows, "w2 followed: a task key names it")
            await etcd.put(ks.expanded("w1", "e"), dumps({"count": 6}))
            await until(lambda: view.expanded.get(("w1", "e")) == 6, "w1's new expansion")
            assert sorted(following.followed) == ["w1", "w2"]
            await deleted(etcd, view, "w1")
            server.stop()
            server.start()  # the stream breaks and is opened again, with w2's watchers
            await etcd.put(ks.expanded("w2", "e"), dumps({"count": 5}))
            await until(lambda: view.expanded.get(("w2", "e")) == 5, "w2's change after it")
            await deleted(etcd, view, "w2")
            assert "w3" not in view.workflow_states  # never named: never followed
            # An ended workflow is no longer watched, but kept as last read; a late key
            # of it does not follow it again, a task key (retry rewrites them) does.
            await submitted(etcd, "w4")
            await etcd.put(ks.offer("n1"), dumps({"blocks": [["w4", "e", 0]]}))
            await until(lambda: "w4" in following.followed, "w4 followed")
            await etcd.put(ks.workflow_state("w4"), dumps({"state": "succeeded"}))
            await until(lambda: "w4" not in following.followed, "w4 no longer followed")
            assert view.workflow_state("w4") == "succeeded" and "w4" in following.ended
            await etcd.put(ks.expanded("w4", "e"), dumps({"count": 7}))  # unwatched now
            await etcd.put(ks.result(TaskRef("w4", "e", 9)), dumps(
                {"state": "failed", "attempt": 1, "exit_code": 1, "ended_at": 1.0}))
            await etcd.put(ks.pool("after-w4"), dumps({}))
            await until(lambda: "after-w4" in view.pools, "the writes after its end")
            assert "w4" not in following.followed and view.expanded[("w4", "e")] == 4
            await etcd.put(ks.workflow_state("w4"), dumps({"state": "running"}))
            await etcd.put(ks.task(TaskRef("w4", "e", 9)), dumps({"params": {}}))
            await until(lambda: view.workflow_state("w4") == "running", "w4 followed again")
            assert view.expanded[("w4", "e")] == 7 and "w4" in following.followed
        finally:
            mirror.cancel()
            await asyncio.gather(mirror, return_exceptions=True)
        # A mirror starting with followed workflows (as a reload does) loads them whole
        # and forgets the one deleted while it did not watch.
        again, loaded = MeshView(ks), asyncio.Event()
        again.following = Following(ks.workflow_ranges)
        again.following.followed = {"w1": [], "w3": []}
        mirror = mirrored(etcd, again, loaded)
        try:
            await asyncio.wait_for(loaded.wait(), DEADLINE_S)
            assert set(again.workflows) == {"w3"} and again.expanded == {("w3", "e"): 4}
            assert list(again.following.followed) == ["w3"]
            await etcd.put(ks.workflow_state("w3"), dumps({"state": "succeeded"}))
            await until(lambda: again.workflow_state("w3") == "succeeded", "w3 watched")
        finally:
            mirror.cancel()
            await asyncio.gather(mirror, return_exceptions=True)

    try:
        run(server, scenario)
    finally:
        server.stop()
