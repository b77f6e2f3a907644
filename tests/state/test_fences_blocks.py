"""The fences of batched experiments (``hypermesh/state/block_txns.py``, and metrics of a
block's tasks in ``hypermesh/state/txns.py``), against a real etcd: a block is claimed only
while nobody holds it and by a view that saw every batch of it; a batch (and a release,
and a metrics write) only while the claim it is fenced on is still the one made."""

from __future__ import annotations

from hypermesh.local.etcd import EtcdServer
from hypermesh.state.block_txns import claim_block, flush_block, lost_entries
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.txns import put_metrics
from tests.state.fence_kit import endpoint, fresh_keyspace, revision_of, run, value_of

BREF = BlockRef("w", "e", 0)


async def seen_now(etcd: Etcd, ks: Keyspace) -> int:
    """The revision of a view that has seen every batch of ``BREF`` so far."""
    return (await etcd.get_prefix(ks.block_batches(BREF)))[1]


async def batch_keys(etcd: Etcd, ks: Keyspace) -> list[str]:
    kvs, _ = await etcd.get_prefix(ks.block_batches(BREF))
    return [kv.key.decode() for kv in kvs]


async def held_by_a_then_b(etcd: Etcd, ks: Keyspace) -> tuple[int, int, int]:
    """A claims the block and starts task 0; A's lease is revoked (a pause past its TTL)
    and B, with a current view, claims the block, closing A's attempt as lost. A's lease,
    A's fence and B's fence."""
    lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
    fence_a = await claim_block(etcd, ks, BREF, "a", lease_a, await seen_now(etcd, ks),
                                ks.block_batch(BREF, lease_a, 1))
    assert fence_a is not None
    started = Batch("a", (AttemptEntry(0, 1, "running", started_at=1.0),))
    assert await flush_block(etcd, ks, BREF, fence_a, ks.block_batch(BREF, lease_a, 2), started)
    await etcd.revoke(lease_a)
    fence_b = await claim_block(etcd, ks, BREF, "b", lease_b, await seen_now(etcd, ks),
                                ks.block_batch(BREF, lease_b, 1),
                                lost_entries([(0, 1, "a", 1.0)], 2.0))
    assert fence_b is not None
    return lease_a, fence_a, fence_b


def test_zombie_block_batch_and_release_are_rejected_and_keep_the_new_claim(
    etcd_server: EtcdServer,
) -> None:
    """The zombie case for blocks: A's late batch (a success of task 0), released with
    the claim as a holder that is done does, writes nothing and leaves B's claim."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, fence_a, fence_b = await held_by_a_then_b(etcd, ks)
            before = await batch_keys(etcd, ks)
            late = Batch("a", (AttemptEntry(0, 1, "succeeded", 0, "exit", 1.0, 3.0),),
                         (ResultEntry(0, "succeeded", 1, 0, 3.0),))

            assert await flush_block(etcd, ks, BREF, fence_a, ks.block_batch(BREF, lease_a, 3),
                                     late, release=True) is None

            assert await revision_of(etcd, ks.block_claim(BREF)) == fence_b
            assert (await value_of(etcd, ks.block_claim(BREF)))["node"] == "b"
            assert await batch_keys(etcd, ks) == before

    run(scenario())


def test_a_held_block_is_not_claimed_again(etcd_server: EtcdServer) -> None:
    """B's view is current (it saw every batch) but A holds the block: refused."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            fence_a = await claim_block(etcd, ks, BREF, "a", lease_a, await seen_now(etcd, ks),
                                        ks.block_batch(BREF, lease_a, 1))
            assert fence_a is not None

            assert await claim_block(etcd, ks, BREF, "b", lease_b, await seen_now(etcd, ks),
                                     ks.block_batch(BREF, lease_b, 1),
                                     lost_entries([(0, 1, "a", 1.0)], 2.0)) is None

            assert await revision_of(etcd, ks.block_claim(BREF)) == fence_a
            assert await batch_keys(etcd, ks) == []  # B's record of "lost" attempts neither

    run(scenario())


def test_a_block_is_not_claimed_by_a_view_that_missed_a_batch(etcd_server: EtcdServer) -> None:
    """A decided task 0 and released the block after B's view was taken: B, which does
    not know task 0 is done, may not claim it (it would run task 0 again)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            stale = await seen_now(etcd, ks)
            fence_a = await claim_block(etcd, ks, BREF, "a", lease_a, stale,
                                        ks.block_batch(BREF, lease_a, 1))
            assert fence_a is not None
            done = Batch("a", (AttemptEntry(0, 1, "succeeded", 0, "exit", 1.0, 2.0),),
                         (ResultEntry(0, "succeeded", 1, 0, 2.0),))
            assert await flush_block(etcd, ks, BREF, fence_a, ks.block_batch(BREF, lease_a, 2),
                                     done, release=True)
            assert await etcd.get(ks.block_claim(BREF)) is None
            before = await batch_keys(etcd, ks)

            assert await claim_block(etcd, ks, BREF, "b", lease_b, stale,
                                     ks.block_batch(BREF, lease_b, 1),
                                     lost_entries([(0, 1, "a", 1.0)], 3.0)) is None

            assert await etcd.get(ks.block_claim(BREF)) is None
            assert await batch_keys(etcd, ks) == before

    run(scenario())


def test_zombie_block_metrics_are_rejected(etcd_server: EtcdServer) -> None:
    """Metrics of a block's task are fenced on the block claim's create revision: A's,
    reported after B claimed the block, are not stored; B's are."""
    ks = fresh_keyspace()
    ref = TaskRef("w", "e", 0)

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            _, fence_a, fence_b = await held_by_a_then_b(etcd, ks)

            assert await put_metrics(etcd, ks, ref, 1, fence_a, b'{"x":[1]}', BREF) is None

            assert await etcd.get(ks.metrics(ref, 1)) is None
            assert await put_metrics(etcd, ks, ref, 2, fence_b, b'{"x":[2]}', BREF) is not None
            assert await value_of(etcd, ks.metrics(ref, 2)) == {"x": [2]}

    run(scenario())


def test_a_lost_block_claim_tells_the_revision_etcd_answered_at(etcd_server: EtcdServer) -> None:
    """B's claim of a block A holds fails, and B learns the revision etcd answered at: at
    least A's fence, so B's claimer waits until its view has seen A's claim before it
    claims again (a view that lagged used to claim the same taken block at every wake-up:
    8.5 refused transactions per task at 64 in-process members, 0.51 after)."""

    async def go() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            ks = fresh_keyspace()
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            stale = await seen_now(etcd, ks)
            fence_a = await claim_block(etcd, ks, BREF, "a", lease_a, stale,
                                        ks.block_batch(BREF, lease_a, 1))
            assert fence_a is not None
            told: list[int] = []
            assert await claim_block(etcd, ks, BREF, "b", lease_b, stale,
                                     ks.block_batch(BREF, lease_b, 1), refused=told.append) is None
            assert len(told) == 1 and told[0] >= fence_a
            fence_b = await claim_block(etcd, ks, BlockRef("w", "e", 8), "b", lease_b, stale,
                                        ks.block_batch(BREF, lease_b, 2), refused=told.append)
            assert fence_b is not None and len(told) == 1  # told only when refused

    run(go())
