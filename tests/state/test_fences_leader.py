"""The fences of the leader's decisions and of workflow-wide writes
(``hypermesh/state/txns.py``), against a real etcd. The leader decides from its view and
writes with the workflow state key's revision as it saw it, so a decision taken before a
live change (which rewrites that key) or before another leader's write is never written
after it: final states, progress, expansions, extensions and suggested trials."""

from __future__ import annotations

from typing import Any

import pytest

from hypermesh.errors import EtcdUnavailable, NotFound, UsageError
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.live import cancel_experiment, extend_experiment
from hypermesh.state.txns import (
    add_task,
    cancel_workflow,
    expand_experiment,
    publish_progress,
    set_workflow_state,
    submit_workflow,
)
from tests.state.fence_kit import (
    SteppedEtcd,
    endpoint,
    fresh_keyspace,
    revision_of,
    run,
    running,
    state_of,
    value_of,
    workflow,
)

PARAMS = [{"x": i / 8} for i in range(8)]


async def written(etcd: Etcd, ks: Keyspace, wid: str) -> dict[str, tuple[bytes, int]]:
    """Every task, block and marker key of the workflow: value and mod revision."""
    out: dict[str, tuple[bytes, int]] = {}
    for kind in ("task", "block", "expanded"):
        kvs, _ = await etcd.get_prefix(ks.kind_prefix(kind, wid))
        out |= {kv.key.decode(): (kv.value, kv.mod_revision) for kv in kvs}
    return out


# ---------------------------------------------------------------- final states and progress
def test_a_final_state_decided_before_a_live_change_is_not_written(
    etcd_server: EtcdServer,
) -> None:
    """The leader saw every task of ``a`` done and decides "succeeded"; meanwhile a user
    added samples (``extend``), which rewrote the state key with the same value. The
    decision is stale: the workflow stays running (the new tasks will run)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            await extend_experiment(etcd, ks, wid, "a", 3)

            assert not await set_workflow_state(etcd, ks, wid, "running", "succeeded", seen,
                                                {"state": "succeeded"})

            assert (await state_of(etcd, ks, wid))[0] == "running"
            assert await etcd.get(ks.progress(wid)) is None

    run(scenario())


def test_a_state_change_without_a_view_requires_the_state_it_expects(
    etcd_server: EtcdServer,
) -> None:
    """Without a revision (a caller that holds no view), the expected value alone guards:
    a workflow cancelled since is not marked succeeded."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks)
            assert await cancel_workflow(etcd, ks, wid) == ("cancelled", True)

            assert not await set_workflow_state(etcd, ks, wid, "running", "succeeded")

            assert (await state_of(etcd, ks, wid))[0] == "cancelled"

    run(scenario())


def test_progress_is_not_published_over_a_final_summary(etcd_server: EtcdServer) -> None:
    """A leader whose view predates the workflow's end (another leader wrote the final
    state and summary) does not overwrite the final summary with a running one."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await publish_progress(etcd, ks, wid, {"state": "running", "n": 1}, seen)
            final: dict[str, Any] = {"state": "succeeded", "n": 2}
            assert await set_workflow_state(etcd, ks, wid, "running", "succeeded", seen, final)

            assert await publish_progress(etcd, ks, wid, {"state": "running", "n": 1},
                                          seen) is None

            assert await value_of(etcd, ks.progress(wid)) == final

    run(scenario())


def test_cancel_does_not_overwrite_a_final_state_written_after_it_read(
    etcd_server: EtcdServer,
) -> None:
    """``hypermesh cancel`` read "running"; the leader then wrote "succeeded". The cancel
    must not turn a finished workflow into a cancelled one: it reports the end instead."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as leader:
            wid, seen = await running(leader, ks)

            async def leader_ends() -> None:
                assert await set_workflow_state(leader, ks, wid, "running", "succeeded", seen)

            user.before_txn(leader_ends)

            assert await cancel_workflow(user, ks, wid) == ("succeeded", False)

            assert user.interleaved == 1
            assert (await state_of(leader, ks, wid))[0] == "succeeded"

    run(scenario())


def test_a_cancel_of_an_unknown_workflow_writes_nothing(etcd_server: EtcdServer) -> None:
    """``hypermesh cancel`` of an id no workflow has (a typo, or one deleted) is an error,
    and writes no state key: a stray "cancelled" would belong to no workflow."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            with pytest.raises(NotFound, match="no workflow"):
                await cancel_workflow(etcd, ks, "nosuch-000000")

            assert await etcd.get(ks.workflow_state("nosuch-000000")) is None

    run(scenario())


def test_a_workflow_id_is_submitted_once(etcd_server: EtcdServer) -> None:
    """A second submit of the same id (ids are random; a retried submit, or a clash) is
    refused and does not reset the running workflow to pending."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wf = workflow()
            _, seen = await running(etcd, ks, wf)

            with pytest.raises(UsageError, match="already exists"):
                await submit_workflow(etcd, ks, wf)

            assert await state_of(etcd, ks, wf.id) == ("running", seen)

    run(scenario())


# ---------------------------------------------------------------- expansions
def test_an_expansion_decided_before_a_live_change_is_not_written(
    etcd_server: EtcdServer,
) -> None:
    """The leader decides to expand ``a``; a user cancels ``a`` first. No task is written."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await cancel_experiment(etcd, ks, wid, "a")

            assert not await expand_experiment(etcd, ks, wid, "a", PARAMS, seen)

            assert await written(etcd, ks, wid) == {}

    run(scenario())


def test_an_experiment_is_expanded_once(etcd_server: EtcdServer) -> None:
    """Leader B's view saw A's tasks of ``a`` but not A's marker, written just after: B
    expands ``a`` again. Refused; nothing A wrote is written again."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await expand_experiment(etcd, ks, wid, "a", PARAMS, seen, seen_revision=seen)
            before = await written(etcd, ks, wid)
            tasks_at = await revision_of(etcd, ks.task(TaskRef(wid, "a", 0)))

            assert not await expand_experiment(etcd, ks, wid, "a", PARAMS, seen,
                                               seen_revision=tasks_at)

            assert await written(etcd, ks, wid) == before

    run(scenario())


def test_an_extension_is_written_once(etcd_server: EtcdServer) -> None:
    """A user added 2 samples to ``a``; leader A wrote them (tasks 8 and 9, marker 10).
    Leader B, whose view saw A's tasks but not the marker's move, extends from 8 again
    (with other parameters): refused, A's tasks and marker stand."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await expand_experiment(etcd, ks, wid, "a", PARAMS, seen, seen_revision=seen)
            assert await extend_experiment(etcd, ks, wid, "a", 2) == 10
            _, seen = await state_of(etcd, ks, wid)
            more = [{"x": 0.25}, {"x": 0.75}]
            assert await expand_experiment(etcd, ks, wid, "a", more, seen, start=8,
                                           seen_revision=seen)
            before = await written(etcd, ks, wid)
            tasks_at = await revision_of(etcd, ks.task(TaskRef(wid, "a", 8)))

            assert not await expand_experiment(etcd, ks, wid, "a", [{"x": 0.5}] * 2, seen,
                                               start=8, seen_revision=tasks_at)

            assert await written(etcd, ks, wid) == before
            assert await value_of(etcd, ks.expanded(wid, "a")) == {"count": 10}

    run(scenario())


def test_a_leader_that_missed_a_partial_expansion_writes_no_blocks_over_it(
    etcd_server: EtcdServer,
) -> None:
    """Leader A writes ``a`` as two blocks of 4 and dies before its marker. Leader B, whose
    view predates A's blocks, expands ``a`` as one block of 8: refused (tasks 4..7 would
    be in two blocks and could run twice). A leader that saw A's blocks finishes the
    expansion with A's size."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        leader_a = SteppedEtcd(endpoint(etcd_server))
        async with leader_a, Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)

            async def goes_on() -> None:
                pass

            async def dies() -> None:
                raise EtcdUnavailable("leader A died before writing its marker")

            leader_a.before_txn(goes_on)
            leader_a.before_txn(dies)
            with pytest.raises(EtcdUnavailable):
                await expand_experiment(leader_a, ks, wid, "a", PARAMS, seen, block=4,
                                        seen_revision=seen)
            partial = await written(etcd, ks, wid)
            assert sorted(partial) == [ks.block(BlockRef(wid, "a", first)) for first in (0, 4)]

            assert not await expand_experiment(etcd, ks, wid, "a", PARAMS, seen, block=8,
                                               seen_revision=seen)

            assert await written(etcd, ks, wid) == partial
            _, now = await etcd.get_prefix(ks.kind_prefix("block", wid))
            assert await expand_experiment(etcd, ks, wid, "a", PARAMS, seen, block=4,
                                           seen_revision=now)
            assert await value_of(etcd, ks.expanded(wid, "a")) == {"count": 8}
            after = await written(etcd, ks, wid)
            assert {k: after[k][0] for k in partial} == {k: v for k, (v, _) in partial.items()}

    run(scenario())


# ---------------------------------------------------------------- trials of a search
def test_a_trial_decided_before_a_live_change_is_not_written(etcd_server: EtcdServer) -> None:
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            assert await cancel_experiment(etcd, ks, wid, "a")

            assert not await add_task(etcd, ks, TaskRef(wid, "a", 0), {"x": 0.5}, seen)

            assert await etcd.get(ks.task(TaskRef(wid, "a", 0))) is None

    run(scenario())


def test_a_trial_index_is_written_once(etcd_server: EtcdServer) -> None:
    """Two leaders suggest trial 0 (a search's suggestions need not agree): the first
    one written stands."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            ref = TaskRef(wid, "a", 0)
            assert await add_task(etcd, ks, ref, {"x": 0.1}, seen)

            assert not await add_task(etcd, ks, ref, {"x": 0.9}, seen)

            assert await value_of(etcd, ks.task(ref)) == {"params": {"x": 0.1}}

    run(scenario())


def test_a_trial_index_is_written_once_as_a_task_or_a_one_task_block(
    etcd_server: EtcdServer,
) -> None:
    """On a large mesh a leader writes a trial as a one-task block: one written either
    way refuses the other, and a live change fences the block as it fences the task."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            ref, other = TaskRef(wid, "a", 0), TaskRef(wid, "a", 1)
            assert await add_task(etcd, ks, ref, {"x": 0.1}, seen, block=True)
            assert await value_of(etcd, ks.block(BlockRef(wid, "a", 0))) == {
                "params": [{"x": 0.1}]}

            assert not await add_task(etcd, ks, ref, {"x": 0.9}, seen, block=True)
            assert not await add_task(etcd, ks, ref, {"x": 0.9}, seen)  # nor as a task
            assert await add_task(etcd, ks, other, {"x": 0.2}, seen)
            assert not await add_task(etcd, ks, other, {"x": 0.9}, seen, block=True)

            assert await etcd.get(ks.task(ref)) is None
            assert await etcd.get(ks.block(BlockRef(wid, "a", 1))) is None
            assert await cancel_experiment(etcd, ks, wid, "a")
            assert not await add_task(etcd, ks, TaskRef(wid, "a", 2), {"x": 0.5}, seen,
                                      block=True)
            assert await etcd.get(ks.block(BlockRef(wid, "a", 2))) is None

    run(scenario())
