"""Compares that guard against states the protocol never makes (issue 27).

A few compares are defence in depth: no hypermesh writer produces the state they
guard against, because another compare of the same writer (or the shape of the
protocol) already rules it out. Each test here writes that state by hand in the real
etcd, as a buggy or foreign writer or an operator would (a plain ``put`` of the key,
outside every transaction), then drives the production transaction and asserts that
it refuses to write and changes nothing. Each fails when its compare is removed.
"""

from __future__ import annotations

import json
import time

import pytest

from hypermesh.agent.claims.unsure import UnsureClaims
from hypermesh.errors import StateConflict
from hypermesh.local.etcd import EtcdServer
from hypermesh.state import gang_txns
from hypermesh.state.etcd import Etcd
from hypermesh.state.gangs import Rendezvous
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.live import retry_failed, scale_experiment
from hypermesh.state.records import Attempt
from hypermesh.state.txns import ClaimPlan, cancel_workflow, claim_tasks, finish_attempt
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

REF = TaskRef("w", "e", 0)


def forged(value: dict[str, object]) -> bytes:
    return json.dumps(value).encode()


async def claim(etcd: Etcd, ks: Keyspace, plan: ClaimPlan, node: str, lease: int) -> int:
    """Claim ``plan`` for ``node``; the claim revision."""
    revision = await claim_tasks(etcd, ks, [plan], node, lease, time.time())
    assert revision is not None, f"{node} could not claim {plan.ref}"
    return revision


# ---------------------------------------------------------------- txns.py cancel_workflow
def test_a_cancel_that_read_no_state_does_not_overwrite_one_written_since(
    etcd_server: EtcdServer,
) -> None:
    """A workflow key without its state key (a foreign or partial write: ``submit``
    writes both at once). ``cancel`` reads no state ("pending"); before it writes, a
    foreign writer puts the state "succeeded". The cancel's write, guarded by "still no
    state key", is refused; it reads again and reports the end instead of overwriting it."""
    ks = fresh_keyspace()
    wf = workflow()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as other:
            await other.put(ks.workflow(wf.id), forged(wf.to_json()))
            written: list[int] = []

            async def state_put() -> None:
                written.append(await other.put(ks.workflow_state(wf.id),
                                               forged({"state": "succeeded"})))

            user.before_txn(state_put)

            assert await cancel_workflow(user, ks, wf.id) == ("succeeded", False)

            assert user.interleaved == 1
            assert await state_of(other, ks, wf.id) == ("succeeded", written[0])

    run(scenario())


# ---------------------------------------------------------------- txns.py finish_ops
def test_a_finish_does_not_overwrite_a_result_written_while_the_claim_was_held(
    etcd_server: EtcdServer,
) -> None:
    """A holds the task's claim; a foreign writer puts a result (``cancelled``) while
    the claim is still A's. A's finish passes the claim's compare but not "no result
    yet": nothing is written, so the result, A's claim and slot, and A's attempt record
    stay as they are (A's claim lapses with its lease, as any claim does)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease = await etcd.grant(30)
            rev_a = await claim(etcd, ks, ClaimPlan(REF, 1, slot=0), "a", lease)
            result = {"state": "cancelled", "attempt": 0, "exit_code": None, "ended_at": 1.0}
            written = await etcd.put(ks.result(REF), forged(result))
            running_record = await etcd.get(ks.attempt(REF, 1))

            done = Attempt(1, "a", "succeeded", 0, "exit", time.time() - 1, time.time())
            assert await finish_attempt(etcd, ks, REF, rev_a, 0, done, "succeeded") is None

            assert await value_of(etcd, ks.result(REF)) == result
            assert await revision_of(etcd, ks.result(REF)) == written
            assert await revision_of(etcd, ks.claim(REF)) == rev_a
            assert await revision_of(etcd, ks.slot("w", "e", 0)) == rev_a
            assert await etcd.get(ks.attempt(REF, 1)) == running_record

    run(scenario())


# ---------------------------------------------------------------- txns.py claim_ops
def test_a_claim_does_not_close_a_lost_attempt_rewritten_since_it_was_read(
    etcd_server: EtcdServer,
) -> None:
    """A's lease ends with attempt 1 running; B reads that record and plans attempt 2,
    closing 1 as lost. Before B writes, an operator rewrites attempt 1's record by hand
    (no claim, no result: every other compare of B's claim holds). B's claim is
    refused: the operator's record stays and nothing of B's is written."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            await claim(etcd, ks, ClaimPlan(REF, 1), "a", lease_a)
            await etcd.revoke(lease_a)
            got = await etcd.get(ks.attempt(REF, 1))
            assert got is not None and b'"running"' in got[0]
            lost = Attempt(1, "a", "running", started_at=time.time() - 1, revision=got[1])
            record = {"attempt": 1, "node": "a", "state": "failed", "reason": "operator"}
            await etcd.put(ks.attempt(REF, 1), forged(record))

            plan = ClaimPlan(REF, 2, lost=lost)
            assert await claim_tasks(etcd, ks, [plan], "b", lease_b, time.time()) is None

            assert await value_of(etcd, ks.attempt(REF, 1)) == record
            assert await etcd.get(ks.claim(REF)) is None
            assert await etcd.get(ks.attempt(REF, 2)) is None

    run(scenario())


# ---------------------------------------------------------------- gang_txns.py start
def test_a_gang_does_not_start_over_a_rendezvous_already_there(
    etcd_server: EtcdServer,
) -> None:
    """Seats a and b are held and the task has no claim, but a rendezvous is there (a
    foreign writer's, not removed with any lease). Rank 0's start would overwrite where
    the members meet: nothing is written, not the claim, the attempt or the rendezvous."""
    ks = fresh_keyspace()
    ref = TaskRef("w", "g", 0)

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            leases = {node: await etcd.grant(30) for node in ("a", "b")}
            seats: dict[int, tuple[str, int]] = {}
            for rank, node in enumerate(("a", "b")):
                taken = await gang_txns.join(etcd, ks, ref, rank, node, "127.0.0.1",
                                             leases[node])
                assert taken is not None
                seats[rank] = (node, taken)
            stray = Rendezvous(7, "10.0.0.9", 29400, {0: ("x", 1)}, 0).to_json()
            written = await etcd.put(ks.gang_rendezvous(ref), forged(stray))
            rdv = Rendezvous(1, "127.0.0.1", 29500, seats, 0)

            assert await gang_txns.start(etcd, ks, ClaimPlan(ref, 1), rdv, "a", leases["a"],
                                         time.time()) is None

            assert await revision_of(etcd, ks.gang_rendezvous(ref)) == written
            assert await value_of(etcd, ks.gang_rendezvous(ref)) == stray
            assert await etcd.get(ks.claim(ref)) is None
            assert await etcd.get(ks.attempt(ref, 1)) is None

    run(scenario())


# ---------------------------------------------------------------- live.py _change
def test_a_live_change_is_not_written_over_a_control_rewritten_alone(
    etcd_server: EtcdServer,
) -> None:
    """``scale`` read experiment ``a``'s control; an operator then adds samples by
    writing the control key alone (every hypermesh writer also rewrites the state key,
    which this write leaves alone). The stale write is refused, and the change is made
    again on a fresh read: the hand-added samples are kept."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as other:
            wid, seen = await running(other, ks)
            control = ks.experiment_control(wid, "a")

            async def operator_adds_samples() -> None:
                await other.put(control, forged({"cancelled": False, "extra_samples": 5}))

            async def second_write() -> None:
                pass

            user.before_txn(operator_adds_samples)
            user.before_txn(second_write)

            assert await scale_experiment(user, ks, wid, "a", 1) is None

            assert user.interleaved == 2  # the first write was refused
            assert await value_of(other, control) == {
                "cancelled": False, "extra_samples": 5, "workers": 1,
            }
            assert (await state_of(other, ks, wid))[1] > seen

    run(scenario())


# ---------------------------------------------------------------- live.py retry_failed
def test_retry_does_not_reopen_a_result_rewritten_since_it_was_read(
    etcd_server: EtcdServer,
) -> None:
    """``retry`` read task 0's result as ``failed``; before it writes, an operator
    rewrites that result by hand (the workflow's state untouched). The retry is
    refused: the result stays as written, the task is not reopened, the state is the
    same key at the same revision."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        user = SteppedEtcd(endpoint(etcd_server))
        async with user, Etcd(endpoint(etcd_server)) as other:
            wid, _ = await running(other, ks)
            ref = TaskRef(wid, "a", 0)
            lease = await other.grant(30)
            claimed = await claim(other, ks, ClaimPlan(ref, 1), "n1", lease)
            failed = Attempt(1, "n1", "failed", 1, "exit", 1.0, 2.0)
            assert await finish_attempt(other, ks, ref, claimed, None, failed, "failed")
            before = await state_of(other, ks, wid)
            result = {"state": "failed", "attempt": 1, "exit_code": 1, "ended_at": 2.0,
                      "note": "checked by hand"}

            async def operator_rewrites_result() -> None:
                await other.put(ks.result(ref), forged(result))

            user.before_txn(operator_rewrites_result)

            with pytest.raises(StateConflict, match="changed while retrying"):
                await retry_failed(user, ks, wid)

            assert user.interleaved == 1
            assert await value_of(other, ks.result(ref)) == result
            assert await other.get(ks.task(ref)) is None
            assert await state_of(other, ks, wid) == before

    run(scenario())


# ---------------------------------------------------------------- agent/claims/unsure.py
def test_an_unsure_claim_under_this_lease_but_another_nodes_name_is_left_alone(
    etcd_server: EtcdServer,
) -> None:
    """The claim read back carries this node's lease id but another node's name (a
    foreign writer's rewrite: no node writes another's name). Only a claim this node
    wrote is its to give back: it stays, and no attempt is closed as lost."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        etcd = SteppedEtcd(endpoint(etcd_server))
        async with etcd:
            lease = await etcd.grant(30)
            await claim(etcd, ks, ClaimPlan(REF, 1), "node1", lease)
            value = await value_of(etcd, ks.claim(REF))
            value["node"] = "node2"
            rewritten = await etcd.put(ks.claim(REF), forged(value), lease=lease)
            running_record = await etcd.get(ks.attempt(REF, 1))
            decided: list[str] = []
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, decided.append)
            unsure.tasks([ClaimPlan(REF, 1)], time.time())

            assert await unsure.settle(set(), set()) == []

            assert ks.claim(REF) in etcd.reads  # it was read back
            assert decided == []
            assert await revision_of(etcd, ks.claim(REF)) == rewritten
            assert await etcd.get(ks.attempt(REF, 1)) == running_record

    run(scenario())
