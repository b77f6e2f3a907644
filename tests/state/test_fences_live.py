"""The fences of live changes (``hypermesh/state/live.py``: ``scale``, ``extend``,
``cancel --experiment``, ``retry``), against a real etcd. Each change reads, then writes
in one transaction guarded by what it read; here another actor writes in between (the
leader ending the workflow, expanding a dependent, a user cancelling, a block holder
recording), and the change must not be written over it."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hypermesh.errors import StateConflict, UsageError
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.block_txns import claim_block, flush_block
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.live import (
    cancel_experiment,
    extend_experiment,
    retry_failed,
    scale_experiment,
)
from hypermesh.state.records import Attempt
from hypermesh.state.txns import (
    ClaimPlan,
    cancel_workflow,
    claim_tasks,
    expand_experiment,
    finish_attempt,
    set_workflow_state,
)
from tests.state.fence_kit import (
    SteppedEtcd,
    endpoint,
    fresh_keyspace,
    run,
    running,
    state_of,
    value_of,
)

Change = Callable[[Etcd, Keyspace, str], Awaitable[Any]]

CHANGES: dict[str, Change] = {
    "scale": lambda etcd, ks, wid: scale_experiment(etcd, ks, wid, "a", 1),
    "extend": lambda etcd, ks, wid: extend_experiment(etcd, ks, wid, "a", 2),
    "cancel --experiment": lambda etcd, ks, wid: cancel_experiment(etcd, ks, wid, "a"),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_live_change_does_not_revive_a_workflow_that_ended_after_it_read(
    etcd_server: EtcdServer, name: str
) -> None:
    """The change read "running"; the leader then wrote the final state. The change's
    write (which rewrites the state key with the value it read) would make the ended
    workflow run again: refused, and the user is told it ended."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as leader:
            wid, seen = await running(leader, ks)

            async def leader_ends() -> None:
                assert await set_workflow_state(leader, ks, wid, "running", "succeeded", seen)

            user.before_txn(leader_ends)

            with pytest.raises(StateConflict, match="has ended"):
                await CHANGES[name](user, ks, wid)

            assert user.interleaved == 1
            assert (await state_of(leader, ks, wid))[0] == "succeeded"
            assert await leader.get(ks.experiment_control(wid, "a")) is None

    run(scenario())


def test_extend_is_refused_once_a_dependent_was_expanded_meanwhile(
    etcd_server: EtcdServer,
) -> None:
    """``extend a`` read that ``b`` (which runs after ``a``) was not expanded; the leader
    then expanded ``b``. New tasks of ``a`` would change ``b``'s inputs under it: refused.
    (The leader's expansion leaves the state key alone: only this compare sees it.)"""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as leader:
            wid, seen = await running(leader, ks)

            async def leader_expands_b() -> None:
                assert await expand_experiment(leader, ks, wid, "b", [{}], seen)

            user.before_txn(leader_expands_b)

            with pytest.raises(StateConflict, match="dependents"):
                await extend_experiment(user, ks, wid, "a", 2)

            assert user.interleaved == 1
            assert await leader.get(ks.experiment_control(wid, "a")) is None

    run(scenario())


def test_extend_of_a_cancelled_experiment_is_refused(etcd_server: EtcdServer) -> None:
    """``cancel --experiment a`` was made; ``extend a`` reads the cancelled control. Its
    compares all hold (it writes over the control it read), so only the check of
    ``cancelled`` stands between it and samples nobody will run: refused, and neither the
    control nor the state key is written."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            assert await cancel_experiment(etcd, ks, wid, "a")
            control = await etcd.get(ks.experiment_control(wid, "a"))
            state = await state_of(etcd, ks, wid)

            with pytest.raises(StateConflict, match="was cancelled"):
                await extend_experiment(etcd, ks, wid, "a", 2)

            assert await etcd.get(ks.experiment_control(wid, "a")) == control
            assert await state_of(etcd, ks, wid) == state

    run(scenario())


# ---------------------------------------------------------------- retry of per-task keys
async def failed_task(etcd: Etcd, ks: Keyspace, wid: str) -> TaskRef:
    """Task 0 of ``a`` runs once and fails for good (its result is ``failed``)."""
    return await decided_task(etcd, ks, wid, 0, "failed")


async def decided_task(etcd: Etcd, ks: Keyspace, wid: str, index: int, state: str) -> TaskRef:
    """Task ``index`` of ``a`` runs once and ends for good: its result is ``state``."""
    ref = TaskRef(wid, "a", index)
    lease = await etcd.grant(30)
    claimed = await claim_tasks(etcd, ks, [ClaimPlan(ref, 1)], "n1", lease, time.time())
    assert claimed is not None
    ended = Attempt(1, "n1", state, 0 if state == "succeeded" else 1, "exit", 1.0, 2.0)
    assert await finish_attempt(etcd, ks, ref, claimed, None, ended, state)
    return ref


def test_retry_does_not_revive_a_workflow_cancelled_while_it_ran(
    etcd_server: EtcdServer,
) -> None:
    """``retry`` read the failed task; a user cancelled the workflow before the retry
    wrote. The retry would reopen the task and set the workflow running: refused."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as other:
            wid, _ = await running(other, ks)
            ref = await failed_task(other, ks, wid)

            async def cancelled() -> None:
                assert await cancel_workflow(other, ks, wid) == ("cancelled", True)

            user.before_txn(cancelled)

            with pytest.raises(StateConflict, match="changed while retrying"):
                await retry_failed(user, ks, wid)

            assert user.interleaved == 1
            assert (await state_of(other, ks, wid))[0] == "cancelled"
            assert (await value_of(other, ks.result(ref)))["state"] == "failed"

    run(scenario())


def test_retry_of_a_cancelled_workflow_is_refused(etcd_server: EtcdServer) -> None:
    """The workflow was cancelled with a failed task in it. ``retry`` reads "cancelled":
    its state compare holds (it is the revision the retry read), so only the check of
    the state keeps the retry from reopening the task and setting the cancelled workflow
    running again. Refused; the workflow stays cancelled and the result failed."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            ref = await failed_task(etcd, ks, wid)
            assert await cancel_workflow(etcd, ks, wid) == ("cancelled", True)
            state = await state_of(etcd, ks, wid)

            with pytest.raises(StateConflict, match="was cancelled"):
                await retry_failed(etcd, ks, wid)

            assert await state_of(etcd, ks, wid) == state
            assert (await value_of(etcd, ks.result(ref)))["state"] == "failed"
            assert await etcd.get(ks.task(ref)) is None

    run(scenario())


def test_retry_reopens_a_failed_task_and_not_a_succeeded_one(etcd_server: EtcdServer) -> None:
    """Task 0 of ``a`` failed for good and task 1 succeeded. ``retry`` reopens task 0
    only: a reopened task 1 would run again and record a second success (the result's
    revision compare holds either way; only the choice of failed results keeps it)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            failed = await failed_task(etcd, ks, wid)
            succeeded = await decided_task(etcd, ks, wid, 1, "succeeded")
            result = await etcd.get(ks.result(succeeded))

            assert await retry_failed(etcd, ks, wid) == [failed.id]

            assert await etcd.get(ks.result(failed)) is None
            assert await etcd.get(ks.result(succeeded)) == result
            assert await etcd.get(ks.task(succeeded)) is None

    run(scenario())


# ---------------------------------------------------------------- retry of blocks
BLOCK_PARAMS = [{"x": 0.0}, {"x": 0.5}]


async def held_block(etcd: Etcd, ks: Keyspace, wid: str) -> tuple[BlockRef, int, int]:
    """``a`` is written as one block of 2 tasks and n1 claims it. The block, n1's fence
    on it and n1's lease."""
    bref = BlockRef(wid, "a", 0)
    _, seen = await state_of(etcd, ks, wid)
    assert await expand_experiment(etcd, ks, wid, "a", BLOCK_PARAMS, seen, block=2)
    lease = await etcd.grant(30)
    _, view = await etcd.get_prefix(ks.block_batches(bref))
    fence = await claim_block(etcd, ks, bref, "n1", lease, view, ks.block_batch(bref, lease, 1))
    assert fence is not None
    return bref, fence, lease


async def failed_block(
    etcd: Etcd, ks: Keyspace, wid: str, release: bool
) -> tuple[BlockRef, int, int]:
    """``a`` is written as one block of 2 tasks; n1 holds it: task 0 failed for good and
    task 1 runs. With ``release``, n1 has released the block (it stopped: task 1 was
    recorded as lost). The block, n1's fence on it and n1's lease."""
    bref, fence, lease = await held_block(etcd, ks, wid)
    batch = Batch("n1", (AttemptEntry(0, 1, "failed", 1, "exit", 1.0, 2.0),
                         AttemptEntry(1, 1, "running", started_at=1.0)),
                  (ResultEntry(0, "failed", 1, 1, 2.0),))
    assert await flush_block(etcd, ks, bref, fence, ks.block_batch(bref, lease, 2), batch)
    if release:
        stop = Batch("n1", (AttemptEntry(1, 1, "failed", None, "node-lost", 1.0, 3.0),))
        assert await flush_block(etcd, ks, bref, fence, ks.block_batch(bref, lease, 3), stop,
                                 release=True)
    return bref, fence, lease


async def batches(etcd: Etcd, ks: Keyspace, bref: BlockRef) -> dict[str, bytes]:
    kvs, _ = await etcd.get_prefix(ks.block_batches(bref))
    return {kv.key.decode(): kv.value for kv in kvs}


async def retry_of_blocks(
    etcd: Etcd, ks: Keyspace, wid: str, bref: BlockRef
) -> tuple[list[str], list[dict[str, Any]]]:
    """Run ``retry``: the task ids it reopened, and the batches it wrote into ``bref``."""
    before = await batches(etcd, ks, bref)
    retried = await retry_failed(etcd, ks, wid)
    after = await batches(etcd, ks, bref)
    return retried, [json.loads(v) for k, v in after.items() if k not in before]


def test_retry_does_not_reopen_a_block_someone_holds(etcd_server: EtcdServer) -> None:
    """n1 still holds the block (task 1 runs): the retry may not write a batch into a
    block whose holder does not expect one. Refused; nothing is written."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            bref, _, _ = await failed_block(etcd, ks, wid, release=False)
            before, state = await batches(etcd, ks, bref), await state_of(etcd, ks, wid)

            with pytest.raises(StateConflict, match="changed while retrying"):
                await retry_failed(etcd, ks, wid)

            assert await batches(etcd, ks, bref) == before
            assert await state_of(etcd, ks, wid) == state

    run(scenario())


def test_retry_does_not_reopen_a_block_from_batches_it_has_not_read(
    etcd_server: EtcdServer,
) -> None:
    """The retry read the block's batches while n1 held it; n1 then recorded task 1 and
    released the block. The retry decided on a history that is no longer the block's:
    refused; only n1's batch was written."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as holder:
            wid, _ = await running(holder, ks)
            bref, fence, lease = await failed_block(holder, ks, wid, release=False)
            before = await batches(holder, ks, bref)
            last = ks.block_batch(bref, lease, 3)

            async def holder_finishes() -> None:
                done = Batch("n1", (AttemptEntry(1, 1, "failed", 1, "exit", 1.0, 3.0),),
                             (ResultEntry(1, "failed", 1, 1, 3.0),))
                assert await flush_block(holder, ks, bref, fence, last, done, release=True)

            user.before_txn(holder_finishes)

            with pytest.raises(StateConflict, match="changed while retrying"):
                await retry_failed(user, ks, wid)

            assert user.interleaved == 1
            assert sorted(await batches(holder, ks, bref)) == sorted([*before, last])

    run(scenario())


def test_retry_of_a_block_does_not_revive_a_workflow_cancelled_while_it_ran(
    etcd_server: EtcdServer,
) -> None:
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as other:
            wid, _ = await running(other, ks)
            bref, _, _ = await failed_block(other, ks, wid, release=True)
            before = await batches(other, ks, bref)

            async def cancelled() -> None:
                assert await cancel_workflow(other, ks, wid) == ("cancelled", True)

            user.before_txn(cancelled)

            with pytest.raises(StateConflict, match="changed while retrying"):
                await retry_failed(user, ks, wid)

            assert user.interleaved == 1
            assert (await state_of(other, ks, wid))[0] == "cancelled"
            assert await batches(other, ks, bref) == before

    run(scenario())


def test_retry_reopens_a_failed_block_task_nobody_holds(etcd_server: EtcdServer) -> None:
    """The same retry, undisturbed, reopens task 0 (the fences above refuse, not the
    retry itself)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            bref, _, _ = await failed_block(etcd, ks, wid, release=True)

            retried, reopens = await retry_of_blocks(etcd, ks, wid, bref)

            assert retried == [TaskRef(wid, "a", 0).id]
            assert reopens == [{"node": "retry", "o": [[0, 1]]}]

    run(scenario())


def test_retry_of_a_block_reopens_its_failure_and_not_its_success(
    etcd_server: EtcdServer,
) -> None:
    """n1 ran the block to its end and released it: task 0 failed for good, task 1
    succeeded. ``retry`` reopens task 0 only: a reopened task 1 would run again and
    record a second success (the block's claim compares hold either way; only the
    choice of failed results keeps the success)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            bref, fence, lease = await held_block(etcd, ks, wid)
            ended = Batch("n1", (AttemptEntry(0, 1, "failed", 1, "exit", 1.0, 2.0),
                                 AttemptEntry(1, 1, "succeeded", 0, "exit", 1.0, 2.0)),
                          (ResultEntry(0, "failed", 1, 1, 2.0),
                           ResultEntry(1, "succeeded", 1, 0, 2.0)))
            assert await flush_block(etcd, ks, bref, fence, ks.block_batch(bref, lease, 2),
                                     ended, release=True)

            retried, reopens = await retry_of_blocks(etcd, ks, wid, bref)

            assert retried == [TaskRef(wid, "a", 0).id]
            assert reopens == [{"node": "retry", "o": [[0, 1]]}]

    run(scenario())


def test_a_batched_experiment_is_not_scaled(etcd_server: EtcdServer) -> None:
    """``a`` runs in blocks, which take no ``workers`` slots: a cap would be written and
    never applied. ``scale`` is refused before it writes: no control key, and the state
    key is as it was."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await expand_experiment(etcd, ks, wid, "a", BLOCK_PARAMS, seen, block=2)
            state = await state_of(etcd, ks, wid)

            with pytest.raises(UsageError, match="runs in blocks"):
                await scale_experiment(etcd, ks, wid, "a", 1)

            assert await etcd.get(ks.experiment_control(wid, "a")) is None
            assert await state_of(etcd, ks, wid) == state

    run(scenario())


def test_an_experiment_in_one_task_blocks_is_scaled(etcd_server: EtcdServer) -> None:
    """One-task blocks (a large mesh) take slots of a cap with their claims: ``scale``
    writes the cap, as for tasks written one by one."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await expand_experiment(etcd, ks, wid, "a", BLOCK_PARAMS, seen, block=1)
            assert await scale_experiment(etcd, ks, wid, "a", 1) is None
            got = await etcd.get(ks.experiment_control(wid, "a"))
            assert got is not None and json.loads(got[0])["workers"] == 1

    run(scenario())
