"""Claims whose transaction's answer was lost (``agent/claims/unsure.py``), against a real
etcd: each is read back once etcd answers again, and given back only if it is this
node's (its name and its current lease), not in use here, and still the claim that was
read (the give-back is fenced on the revision read back)."""

from __future__ import annotations

import json
import time

import pytest

from hypermesh.agent.claims.unsure import UnsureClaims
from hypermesh.errors import EtcdUnavailable
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.block_txns import claim_block
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import Attempt
from hypermesh.state.txns import ClaimPlan, claim_tasks
from tests.state.fence_kit import (
    SteppedEtcd,
    endpoint,
    fresh_keyspace,
    revision_of,
    run,
    value_of,
)

REF = TaskRef("w", "e", 0)
BREF = BlockRef("w", "b", 0)


async def claim(etcd: Etcd, ks: Keyspace, plan: ClaimPlan, node: str, lease: int) -> int:
    revision = await claim_tasks(etcd, ks, [plan], node, lease, time.time())
    assert revision is not None, f"{node} could not claim {plan.ref}"
    return revision


async def claim_b(etcd: Etcd, ks: Keyspace, node: str, lease: int) -> int:
    """Claim block ``BREF`` for ``node`` with a current view; the claim's revision."""
    _, seen = await etcd.get_prefix(ks.block_batches(BREF))
    fence = await claim_block(etcd, ks, BREF, node, lease, seen, ks.block_batch(BREF, lease, 1))
    assert fence is not None, f"{node} could not claim {BREF}"
    return fence


def test_claims_whose_answer_was_lost_are_read_back_and_given_back(
    etcd_server: EtcdServer,
) -> None:
    """etcd commits a task claim and a block claim, their answers are lost and etcd stays
    away past the transactions' deadline: the claimer gets ``EtcdUnavailable`` and notes
    them as unsure. Once etcd answers, ``settle`` reads each back (the reads are
    asserted, not only the outcome) and gives it back: held under this node's lease,
    run by nobody, the task would never run while the node lives."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        etcd = SteppedEtcd(endpoint(etcd_server))
        async with etcd:
            lease = await etcd.grant(30)
            decided: list[str] = []
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, decided.append)
            plan = ClaimPlan(REF, 1, slot=0)
            now = time.time()
            faults = etcd.lose_answers()
            with pytest.raises(EtcdUnavailable):
                await claim_tasks(etcd, ks, [plan], "node1", lease, now)
            unsure.tasks([plan], now)  # as the claimer does (agent/claims/claimer.py)
            assert faults[0] == "lost" and set(faults[1:]) == {"refused"}
            faults = etcd.lose_answers()
            with pytest.raises(EtcdUnavailable):
                await claim_block(etcd, ks, BREF, "node1", lease, 0,
                                  ks.block_batch(BREF, lease, 1))
            unsure.block(BREF)  # as the block holder does (agent/tasks/blocks.py)
            assert faults[0] == "lost" and set(faults[1:]) == {"refused"}
            etcd.answers_again()
            # Both were written: held under this node's lease, by nobody running them.
            assert (await value_of(etcd, ks.claim(REF)))["lease"] == lease
            assert (await value_of(etcd, ks.block_claim(BREF)))["lease"] == lease
            etcd.reads.clear()

            given = await unsure.settle(set(), set())

            assert etcd.reads == [ks.claim(REF), ks.block_claim(BREF)]  # each read back
            assert sorted(given) == sorted([ks.claim(REF), ks.block_claim(BREF)])
            assert not unsure
            assert await etcd.get(ks.claim(REF)) is None
            assert await etcd.get(ks.slot("w", "e", 0)) is None
            assert await etcd.get(ks.block_claim(BREF)) is None
            lost = await value_of(etcd, ks.attempt(REF, 1))
            assert (lost["node"], lost["state"], lost["reason"]) == ("node1", "failed", "node-lost")
            assert await etcd.get(ks.result(REF)) is None  # open again, no retry spent
            assert len(decided) == 2
            # Read back once: nothing is left to read or give back.
            etcd.reads.clear()
            assert await unsure.settle(set(), set()) == [] and etcd.reads == []

    run(scenario())


def test_an_unsure_claim_held_by_another_node_or_lease_is_left_alone(
    etcd_server: EtcdServer,
) -> None:
    """What is read back is someone else's claim: another node's (it won the task), or
    one under another lease of a node of the same name (an earlier incarnation). Neither
    is this node's to give back."""
    ks = fresh_keyspace()
    theirs, older = REF, TaskRef("w", "e", 1)

    async def scenario() -> None:
        etcd = SteppedEtcd(endpoint(etcd_server))
        async with etcd:
            lease, other_lease, old_lease = [await etcd.grant(30) for _ in range(3)]
            rev_theirs = await claim(etcd, ks, ClaimPlan(theirs, 1), "node2", other_lease)
            rev_older = await claim(etcd, ks, ClaimPlan(older, 1), "node1", old_lease)
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, lambda _: None)
            unsure.tasks([ClaimPlan(theirs, 1), ClaimPlan(older, 1)], time.time())

            assert await unsure.settle(set(), set()) == []

            assert sorted(etcd.reads) == sorted([ks.claim(theirs), ks.claim(older)])
            assert await revision_of(etcd, ks.claim(theirs)) == rev_theirs
            assert await revision_of(etcd, ks.claim(older)) == rev_older
            for ref in (theirs, older):
                assert (await value_of(etcd, ks.attempt(ref, 1)))["state"] == "running"

    run(scenario())


def test_an_unsure_claim_this_node_runs_is_not_given_back(etcd_server: EtcdServer) -> None:
    """The claim was not written the first time, and a later round claimed the task (and
    the block) for real: read back, it is this node's and in use, and stays."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        etcd = SteppedEtcd(endpoint(etcd_server))
        async with etcd:
            lease = await etcd.grant(30)
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, lambda _: None)
            plan = ClaimPlan(REF, 1)
            unsure.tasks([plan], time.time())
            unsure.block(BREF)
            rev = await claim(etcd, ks, plan, "node1", lease)
            fence = await claim_b(etcd, ks, "node1", lease)

            assert await unsure.settle({REF}, {BREF}) == []

            assert sorted(etcd.reads) == sorted([ks.claim(REF), ks.block_claim(BREF)])
            assert await revision_of(etcd, ks.claim(REF)) == rev
            assert await revision_of(etcd, ks.block_claim(BREF)) == fence
            assert (await value_of(etcd, ks.attempt(REF, 1)))["state"] == "running"

    run(scenario())


def test_an_unsure_task_claim_taken_over_after_its_read_back_is_kept(
    etcd_server: EtcdServer,
) -> None:
    """Between the read-back and the give-back, this node's lease ends and node2 claims
    the task: the give-back, fenced on the revision read back, must not release node2's
    claim nor rewrite the attempt node2 closed."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        etcd = SteppedEtcd(endpoint(etcd_server))
        async with etcd, Etcd(endpoint(etcd_server)) as other:
            lease = await etcd.grant(30)
            plan = ClaimPlan(REF, 1, slot=0)
            await claim(etcd, ks, plan, "node1", lease)
            decisions: list[str] = []
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, decisions.append)
            unsure.tasks([plan], time.time())
            taken: list[int] = []

            async def node2_takes_over() -> None:
                await other.revoke(lease)
                _, seen = await other.get(ks.attempt(REF, 1))  # type: ignore[misc]
                lost = Attempt(1, "node1", "running", started_at=time.time(), revision=seen)
                taken.append(await claim(other, ks, ClaimPlan(REF, 2, slot=0, lost=lost),
                                         "node2", await other.grant(30)))

            etcd.after_read(ks.claim(REF), node2_takes_over)

            # Refused by its fence, the give-back is not reported as made.
            assert await unsure.settle(set(), set()) == [] and decisions == []
            assert etcd.interleaved == 1 and taken
            assert await revision_of(etcd, ks.claim(REF)) == taken[0]
            assert await revision_of(etcd, ks.slot("w", "e", 0)) == taken[0]
            closed_by_node2 = await etcd.get(ks.attempt(REF, 1))
            assert closed_by_node2 is not None and closed_by_node2[1] == taken[0]
            assert json.loads(closed_by_node2[0])["reason"] == "node-lost"
            assert (await value_of(etcd, ks.attempt(REF, 2)))["node"] == "node2"

    run(scenario())


def test_an_unsure_block_claim_taken_over_after_its_read_back_is_kept(
    etcd_server: EtcdServer,
) -> None:
    """The same for a block claim: node2 holds the block by the time the give-back's
    delete is sent; it must not delete node2's claim."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        etcd = SteppedEtcd(endpoint(etcd_server))
        async with etcd, Etcd(endpoint(etcd_server)) as other:
            lease = await etcd.grant(30)
            await claim_b(etcd, ks, "node1", lease)
            decisions: list[str] = []
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, decisions.append)
            unsure.block(BREF)
            taken: list[int] = []

            async def node2_takes_over() -> None:
                await other.revoke(lease)
                taken.append(await claim_b(other, ks, "node2", await other.grant(30)))

            etcd.after_read(ks.block_claim(BREF), node2_takes_over)

            assert await unsure.settle(set(), set()) == [] and decisions == []
            assert etcd.interleaved == 1 and taken
            assert await revision_of(etcd, ks.block_claim(BREF)) == taken[0]
            assert (await value_of(etcd, ks.block_claim(BREF)))["node"] == "node2"

    run(scenario())
