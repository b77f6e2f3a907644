"""Deleting a workflow (``hypermesh/state/cleanup.py``) against a real etcd: every key of
every kind goes, in pages, and nothing of another workflow; the leader's fenced writes
decided before the deletion fail after it; a workflow reopened meanwhile stays; a
deletion cut short is finished by the next one."""

from __future__ import annotations

import dataclasses

import pytest

from hypermesh.errors import NotFound, UsageError
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.cleanup import (
    delete_workflow,
    forget_workflow,
    has_leftovers,
    purge_order,
    read_state,
)
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import dumps
from hypermesh.state.txns import (
    add_task,
    expand_experiment,
    publish_progress,
    set_workflow_state,
    state_value,
    submit_workflow,
)
from tests.state.fence_kit import endpoint, fresh_keyspace, run, running, workflow

TASKS = 50  # task keys per workflow: several pages of PAGE


def every_key(ks: Keyspace, wid: str) -> list[str]:
    """One key of every per-workflow kind (and TASKS task keys), but the record and state."""
    ref = TaskRef(wid, "e", 0)
    block = BlockRef(wid, "e", 0)
    return [
        ks.progress(wid), ks.workflow_usage(wid), ks.expanded(wid, "e"),
        ks.experiment_control(wid, "e"), ks.slot(wid, "e", 0), ks.claim(ref),
        ks.attempt(ref, 1), ks.result(ref), ks.metrics(ref, 1), ks.gang_seat(ref, 0),
        ks.gang_rendezvous(ref), ks.gang_end(ref, 1, 0), ks.block(block),
        ks.block_claim(block), ks.block_batch(block, 1, 1), ks.block_slot(wid, "e", 0),
        *(ks.task(TaskRef(wid, "e", i)) for i in range(TASKS)),
    ]


async def stored(etcd: Etcd, ks: Keyspace, wid: str) -> set[str]:
    """Every key of ``wid`` in etcd (exact keys and ranges)."""
    found = set()
    for p in ks.workflow_prefixes(wid):
        if p.endswith("/"):
            found |= {kv.key.decode() for kv in (await etcd.get_prefix(p))[0]}
        elif await etcd.get(p) is not None:
            found.add(p)
    return found


async def finished(etcd: Etcd, ks: Keyspace, wid: str, state: str = "succeeded") -> None:
    """Store workflow ``wid`` ended in ``state``, with a key of every kind."""
    await submit_workflow(etcd, ks, dataclasses.replace(workflow(), id=wid))
    for key in every_key(ks, wid):
        await etcd.put(key, dumps({"state": state, "experiments": {}}))
    assert await set_workflow_state(etcd, ks, wid, "pending", state)


def test_every_key_goes_in_pages_and_nothing_of_a_longer_id(etcd_server: EtcdServer) -> None:
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            await finished(etcd, ks, "w")
            await finished(etcd, ks, "w2")  # "w" is a prefix of its id
            kept = await stored(etcd, ks, "w2")
            assert len(await stored(etcd, ks, "w")) == len(kept) == len(every_key(ks, "w")) + 2
            before = (await etcd.status()).header.revision

            deleted = await delete_workflow(etcd, ks, "w", page=7)

            assert deleted.state == "succeeded" and deleted.keys == len(kept)
            assert await stored(etcd, ks, "w") == set()
            assert await stored(etcd, ks, "w2") == kept
            # One revision per page: the task keys alone take ceil(50 / 7) of them.
            assert (await etcd.status()).header.revision - before >= 1 + -(-TASKS // 7)
            assert await read_state(etcd, ks, "w") is None
            with pytest.raises(NotFound):
                await delete_workflow(etcd, ks, "w")

    run(scenario())


def test_running_work_is_purged_first_and_markers_last() -> None:
    order = [p.split("/")[-3] for p in purge_order(Keyspace("t"), "w")]
    assert order[:5] == ["claim", "bclaim", "bcap", "slot", "gang"]
    assert order[-1] == "expanded"
    assert sorted(order) == sorted(p.split("/")[-3] for p in Keyspace("t").workflow_prefixes("w")
                                   if p.endswith("/"))


def test_the_leaders_writes_decided_before_a_deletion_fail_after_it(
    etcd_server: EtcdServer,
) -> None:
    """The leader saw the workflow running (state revision ``seen``) and decides to expand
    it, suggest a trial, publish progress, end it; meanwhile a user deleted it (--force).
    Each write is fenced on the state key, which is gone: none lands, no key is back."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, seen = await running(etcd, ks)
            deleted = await delete_workflow(etcd, ks, wid, force=True, drain_s=0)
            assert deleted.state == "cancelled"

            assert not await expand_experiment(etcd, ks, wid, "a", [{"x": 0.5}] * 300, seen)
            assert not await expand_experiment(etcd, ks, wid, "b", [{}] * 300, seen, block=50)
            assert not await add_task(etcd, ks, TaskRef(wid, "a", 9), {"x": 1.0}, seen)
            assert await publish_progress(etcd, ks, wid, {"state": "running"}, seen) is None
            assert not await set_workflow_state(etcd, ks, wid, "running", "succeeded", seen,
                                                {"state": "succeeded"})
            # The usage the leader adds up is written only while the workflow is stored.
            usage = await etcd.txn([etcd.absent(ks.workflow_usage(wid)),
                                    etcd.present(ks.workflow(wid))],
                                   [etcd.op_put(ks.workflow_usage(wid), b"{}")])
            assert not usage.succeeded
            assert await stored(etcd, ks, wid) == set()

    run(scenario())


def test_a_workflow_reopened_after_it_was_read_is_not_deleted(etcd_server: EtcdServer) -> None:
    """The leader's retention read the workflow failed; a user ran ``retry`` (which
    rewrites the state key, running again) before the deletion: it stays, whole."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            await finished(etcd, ks, "w", "failed")
            found = await read_state(etcd, ks, "w")
            assert found is not None and found[0] == "failed"
            before = await stored(etcd, ks, "w")
            await etcd.put(ks.workflow_state("w"), state_value("running"))

            assert await forget_workflow(etcd, ks, "w", found[1]) is None

            assert await stored(etcd, ks, "w") == before
            with pytest.raises(UsageError, match=r"cancel it first.*--force"):
                await delete_workflow(etcd, ks, "w")
            assert await stored(etcd, ks, "w") == before

    run(scenario())


def test_a_deletion_cut_short_is_finished_by_the_next(etcd_server: EtcdServer) -> None:
    """The workflow's own keys went (step 1), then the deleting process died: ``delete``
    of the same id finds the leftovers and purges them."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            await finished(etcd, ks, "w")
            found = await read_state(etcd, ks, "w")
            assert found is not None
            assert await forget_workflow(etcd, ks, "w", found[1]) == 4
            assert await has_leftovers(etcd, ks, "w")

            deleted = await delete_workflow(etcd, ks, "w")

            assert deleted.state == "" and deleted.keys == len(every_key(ks, "w")) - 2
            assert await stored(etcd, ks, "w") == set()
            assert not await has_leftovers(etcd, ks, "w")

    run(scenario())
