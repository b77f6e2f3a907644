"""The fences of per-task keys (``hypermesh/state/txns.py``), each against a real etcd:
a claim, a finish (attempt record, claim and slot released, result) and a metrics write
succeed only while what they compare is as their writer saw it. Every test drives the
production transaction in the situation its compare exists for, where the other
compares of the transaction let the write through, so it fails when that compare is
removed (issue 27: a test per fence)."""

from __future__ import annotations

import time

from hypermesh.local.etcd import EtcdServer
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import Attempt
from hypermesh.state.txns import (
    ClaimPlan,
    Finish,
    claim_tasks,
    finish_attempt,
    finish_attempts,
    put_metrics,
)
from tests.state.fence_kit import endpoint, fresh_keyspace, revision_of, run, value_of

REF = TaskRef("w", "e", 0)


async def claim(etcd: Etcd, ks: Keyspace, plan: ClaimPlan, node: str, lease: int) -> int:
    """Claim ``plan`` for ``node``; the claim revision (the fence of its later writes)."""
    revision = await claim_tasks(etcd, ks, [plan], node, lease, time.time())
    assert revision is not None, f"{node} could not claim {plan.ref}"
    return revision


def ended(n: int, node: str, state: str = "succeeded", code: int | None = 0) -> Attempt:
    return Attempt(n, node, state, code, "exit", time.time() - 1, time.time())


async def reclaimed_by_b(etcd: Etcd, ks: Keyspace, ref: TaskRef, lease_a: int) -> int:
    """A's lease is revoked (a pause past its TTL: its claim and slot vanish with it) and
    B claims ``ref`` again as attempt 2 on slot 0, closing A's attempt 1 as lost, as a
    claimer with a current view does. B's claim revision."""
    await etcd.revoke(lease_a)
    assert await etcd.get(ks.claim(ref)) is None
    value, seen = await etcd.get(ks.attempt(ref, 1))  # type: ignore[misc]
    assert b'"running"' in value
    lost = Attempt(1, "a", "running", started_at=time.time() - 1, revision=seen)
    lease_b = await etcd.grant(30)
    return await claim(etcd, ks, ClaimPlan(ref, 2, slot=0, lost=lost), "b", lease_b)


# ---------------------------------------------------------------- finish (txns.py finish_ops)
def test_zombie_finish_after_reclaim_is_rejected_and_keeps_the_new_claim(
    etcd_server: EtcdServer,
) -> None:
    """The zombie case of issue 27. Node A claims a task, A's lease is revoked, node B
    claims the task; A's late finish (a success, with its result) must write nothing:
    not its result, not its attempt record, and not the release of B's live claim and
    slot. B has not finished, so "no result yet" holds: only the claim's revision tells
    A's claim from B's."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a = await etcd.grant(30)
            rev_a = await claim(etcd, ks, ClaimPlan(REF, 1, slot=0), "a", lease_a)
            rev_b = await reclaimed_by_b(etcd, ks, REF, lease_a)
            closed = await value_of(etcd, ks.attempt(REF, 1))
            assert (closed["state"], closed["reason"]) == ("failed", "node-lost")

            late = await finish_attempt(etcd, ks, REF, rev_a, 0, ended(1, "a"), "succeeded")

            assert late is None
            assert await revision_of(etcd, ks.claim(REF)) == rev_b
            assert (await value_of(etcd, ks.claim(REF)))["node"] == "b"
            assert await revision_of(etcd, ks.slot("w", "e", 0)) == rev_b
            assert await etcd.get(ks.result(REF)) is None
            assert await value_of(etcd, ks.attempt(REF, 1)) == closed  # B's record of it
            # B, the holder, still records its own end, and the task has its one result.
            done = await finish_attempt(etcd, ks, REF, rev_b, 0, ended(2, "b"), "succeeded")
            assert done is not None
            assert (await value_of(etcd, ks.result(REF)))["attempt"] == 2

    run(scenario())


def test_a_batch_of_finishes_with_one_lost_claim_writes_nothing(etcd_server: EtcdServer) -> None:
    """``finish_attempts`` is all or nothing: A's batch of two ends, one of a task B
    claimed again since, writes neither, and B's claim stays."""
    ks = fresh_keyspace()
    other = TaskRef("w", "e", 1)

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a = await etcd.grant(30)
            rev_a = await claim_tasks(
                etcd, ks, [ClaimPlan(other, 1), ClaimPlan(REF, 1, slot=0)], "a", lease_a,
                time.time(),
            )
            assert rev_a is not None
            rev_b = await reclaimed_by_b(etcd, ks, REF, lease_a)

            late = await finish_attempts(etcd, ks, [
                Finish(other, rev_a, None, ended(1, "a"), "succeeded"),
                Finish(REF, rev_a, 0, ended(1, "a"), "succeeded"),
            ])

            assert late is None
            assert await revision_of(etcd, ks.claim(REF)) == rev_b
            assert await etcd.get(ks.result(REF)) is None
            assert await etcd.get(ks.result(other)) is None
            assert (await value_of(etcd, ks.attempt(other, 1)))["state"] == "running"

    run(scenario())


# ---------------------------------------------------------------- claims (txns.py claim_ops)
def test_a_claimed_task_is_not_claimed_again(etcd_server: EtcdServer) -> None:
    """B's view has not seen A's claim and plans a new attempt: refused, A's claim stays."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            rev_a = await claim(etcd, ks, ClaimPlan(REF, 1), "a", lease_a)

            assert await claim_tasks(
                etcd, ks, [ClaimPlan(REF, 2)], "b", lease_b, time.time()
            ) is None

            assert await revision_of(etcd, ks.claim(REF)) == rev_a
            assert await etcd.get(ks.attempt(REF, 2)) is None

    run(scenario())


def test_a_decided_task_is_not_claimed_again(etcd_server: EtcdServer) -> None:
    """A finished the task; B's view still shows it open: B's claim is refused."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            rev_a = await claim(etcd, ks, ClaimPlan(REF, 1), "a", lease_a)
            assert await finish_attempt(etcd, ks, REF, rev_a, None, ended(1, "a"), "succeeded")

            assert await claim_tasks(
                etcd, ks, [ClaimPlan(REF, 2)], "b", lease_b, time.time()
            ) is None

            assert await etcd.get(ks.claim(REF)) is None
            assert await etcd.get(ks.attempt(REF, 2)) is None
            assert (await value_of(etcd, ks.result(REF)))["attempt"] == 1

    run(scenario())


def test_an_attempt_number_is_claimed_once(etcd_server: EtcdServer) -> None:
    """A claimed attempt 1 and lost its lease; B's view missed both, so B plans attempt 1
    too. Refused: A's attempt record is history, not B's to overwrite."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            await claim(etcd, ks, ClaimPlan(REF, 1), "a", lease_a)
            await etcd.revoke(lease_a)
            record = await etcd.get(ks.attempt(REF, 1))

            assert await claim_tasks(
                etcd, ks, [ClaimPlan(REF, 1)], "b", lease_b, time.time()
            ) is None

            assert await etcd.get(ks.attempt(REF, 1)) == record
            assert await etcd.get(ks.claim(REF)) is None

    run(scenario())


def test_a_workers_slot_is_held_by_one_task_at_a_time(etcd_server: EtcdServer) -> None:
    """Slot 0 of the experiment's ``workers`` cap is A's (task 0); B's claim of task 1 on
    the same slot is refused, so the cap is never exceeded."""
    ks = fresh_keyspace()
    second = TaskRef("w", "e", 1)

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            rev_a = await claim(etcd, ks, ClaimPlan(REF, 1, slot=0), "a", lease_a)

            assert await claim_tasks(
                etcd, ks, [ClaimPlan(second, 1, slot=0)], "b", lease_b, time.time()
            ) is None

            assert await revision_of(etcd, ks.slot("w", "e", 0)) == rev_a
            assert await value_of(etcd, ks.slot("w", "e", 0)) == {"task": REF.id}
            assert await etcd.get(ks.claim(second)) is None

    run(scenario())


# ---------------------------------------------------------------- metrics (txns.py put_metrics)
def test_zombie_metrics_after_reclaim_are_rejected(etcd_server: EtcdServer) -> None:
    """A's metrics of attempt 1, reported after B claimed the task again, are not stored;
    B's are."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a = await etcd.grant(30)
            rev_a = await claim(etcd, ks, ClaimPlan(REF, 1, slot=0), "a", lease_a)
            assert await put_metrics(etcd, ks, REF, 1, rev_a, b'{"loss":[1.0]}') is not None
            rev_b = await reclaimed_by_b(etcd, ks, REF, lease_a)

            assert await put_metrics(etcd, ks, REF, 1, rev_a, b'{"loss":[0.5]}') is None

            assert await value_of(etcd, ks.metrics(REF, 1)) == {"loss": [1.0]}
            assert await put_metrics(etcd, ks, REF, 2, rev_b, b'{"loss":[2.0]}') is not None
            assert await value_of(etcd, ks.metrics(REF, 2)) == {"loss": [2.0]}

    run(scenario())
