"""The fences of gangs (``hypermesh/state/gang_txns.py``), against a real etcd: a seat is
taken only while free and the task undecided, and given back only by its holder; a gang
starts only while every seat it names is held by the member it names; a member's end is
recorded only while the attempt's claim and the member's seat are unchanged; rank 0
records a result only while every seat the attempt started with is unchanged."""

from __future__ import annotations

import time

from hypermesh.local.etcd import EtcdServer
from hypermesh.state import gang_txns
from hypermesh.state.etcd import Etcd
from hypermesh.state.gangs import MemberEnd, Rendezvous
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import Attempt
from hypermesh.state.txns import ClaimPlan, Finish, claim_tasks, finish_attempt
from tests.state.fence_kit import endpoint, fresh_keyspace, revision_of, run, value_of

REF = TaskRef("w", "g", 0)
OK = MemberEnd("succeeded", 0, "exit")


async def seat(etcd: Etcd, ks: Keyspace, rank: int, node: str, lease: int) -> int:
    revision = await gang_txns.join(etcd, ks, REF, rank, node, "127.0.0.1", lease)
    assert revision is not None, f"{node} could not take seat {rank}"
    return revision


async def started(
    etcd: Etcd, ks: Keyspace, attempt: int, seats: dict[int, tuple[str, int]], lease: int,
    lost: Attempt | None = None,
) -> Rendezvous:
    """Rank 0 (``seats[0]``'s node) starts ``attempt`` with ``seats``; its rendezvous."""
    rdv = Rendezvous(attempt, "127.0.0.1", 29500, seats, 0)
    plan = ClaimPlan(REF, attempt, lost=lost)
    revision = await gang_txns.start(etcd, ks, plan, rdv, seats[0][0], lease, time.time())
    assert revision is not None, "the gang did not start"
    return Rendezvous(attempt, rdv.master_addr, rdv.master_port, seats, revision)


async def two_members(etcd: Etcd, ks: Keyspace) -> tuple[dict[str, int], Rendezvous]:
    """Nodes a (rank 0) and b (rank 1) take their seats and a starts attempt 1. Their
    leases, and the rendezvous."""
    leases = {name: await etcd.grant(30) for name in ("a", "b")}
    seats = {rank: (node, await seat(etcd, ks, rank, node, leases[node]))
             for rank, node in enumerate(("a", "b"))}
    return leases, await started(etcd, ks, 1, seats, leases["a"])


async def started_again(etcd: Etcd, ks: Keyspace) -> tuple[Rendezvous, Rendezvous]:
    """a (rank 0) and b start attempt 1; a dies: its seat, claim and rendezvous go with
    its lease. c takes rank 0 and starts attempt 2 with b, whose seat never changed,
    closing attempt 1 as lost. Both rendezvous."""
    leases, first = await two_members(etcd, ks)
    await etcd.revoke(leases["a"])
    lease_c = await etcd.grant(30)
    _, seen = await etcd.get(ks.attempt(REF, 1))  # type: ignore[misc]
    lost = Attempt(1, "a", "running", started_at=1.0, revision=seen)
    seats = {0: ("c", await seat(etcd, ks, 0, "c", lease_c)), 1: first.seats[1]}
    return first, await started(etcd, ks, 2, seats, lease_c, lost)


def test_a_taken_seat_is_not_taken_again(etcd_server: EtcdServer) -> None:
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            held = await seat(etcd, ks, 0, "a", await etcd.grant(30))

            assert await gang_txns.join(etcd, ks, REF, 0, "c", "127.0.0.2",
                                        await etcd.grant(30)) is None

            assert await revision_of(etcd, ks.gang_seat(REF, 0)) == held
            assert (await value_of(etcd, ks.gang_seat(REF, 0)))["node"] == "a"

    run(scenario())


def test_no_seat_is_taken_in_a_decided_task(etcd_server: EtcdServer) -> None:
    """The task has its result: a member whose view lags does not sit down (it would
    hold a slot, waiting for a gang that never starts)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease = await etcd.grant(30)
            claimed = await claim_tasks(etcd, ks, [ClaimPlan(REF, 1)], "a", lease, time.time())
            assert claimed is not None
            assert await finish_attempt(etcd, ks, REF, claimed, None,
                                        Attempt(1, "a", "succeeded", 0, "exit", 1.0, 2.0),
                                        "succeeded")

            assert await gang_txns.join(etcd, ks, REF, 1, "b", "127.0.0.2", lease) is None

            assert await etcd.get(ks.gang_seat(REF, 1)) is None

    run(scenario())


def test_a_member_that_lost_its_seat_does_not_give_back_the_new_holders(
    etcd_server: EtcdServer,
) -> None:
    """b's lease ends and d takes rank 1; b's late ``leave`` must not free d's seat."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_b = await etcd.grant(30)
            old = await seat(etcd, ks, 1, "b", lease_b)
            await etcd.revoke(lease_b)
            new = await seat(etcd, ks, 1, "d", await etcd.grant(30))

            assert not await gang_txns.leave(etcd, ks, REF, 1, old)

            assert await revision_of(etcd, ks.gang_seat(REF, 1)) == new

    run(scenario())


def test_a_gang_does_not_start_after_a_seat_changed_hands(etcd_server: EtcdServer) -> None:
    """Rank 0 saw seats a and b; b's lease ends and d takes rank 1 before the start is
    written. The start would name b, which is gone: nothing is written, not the claim,
    not the attempt, not the rendezvous."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            lease_a, lease_b = await etcd.grant(30), await etcd.grant(30)
            seats = {0: ("a", await seat(etcd, ks, 0, "a", lease_a)),
                     1: ("b", await seat(etcd, ks, 1, "b", lease_b))}
            await etcd.revoke(lease_b)
            await seat(etcd, ks, 1, "d", await etcd.grant(30))
            rdv = Rendezvous(1, "127.0.0.1", 29500, seats, 0)

            assert await gang_txns.start(etcd, ks, ClaimPlan(REF, 1), rdv, "a", lease_a,
                                         time.time()) is None

            for key in (ks.claim(REF), ks.attempt(REF, 1), ks.gang_rendezvous(REF)):
                assert await etcd.get(key) is None, key

    run(scenario())


def test_a_gang_does_not_start_again_after_its_result_was_written(
    etcd_server: EtcdServer,
) -> None:
    """a and b ran attempt 1 and rank 0 recorded its success; both still hold their seats.
    A rank 0 whose view missed the result starts attempt 2 with the same seats: every
    seat is as it names it and the rendezvous is gone, so only the claim's "no result
    yet" refuses it. Nothing is written: no claim, no attempt 2, no rendezvous (the task
    would run again and record a second success)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            leases, rdv = await two_members(etcd, ks)
            done = Attempt(1, "a", "succeeded", 0, "exit", 1.0, 2.0)
            assert await gang_txns.finish(
                etcd, ks, Finish(REF, rdv.revision, None, done, "succeeded"), rdv
            ) is not None
            result = await revision_of(etcd, ks.result(REF))
            again = Rendezvous(2, "127.0.0.1", 29500, rdv.seats, 0)

            assert await gang_txns.start(etcd, ks, ClaimPlan(REF, 2), again, "a", leases["a"],
                                         time.time()) is None

            for key in (ks.claim(REF), ks.attempt(REF, 2), ks.gang_rendezvous(REF)):
                assert await etcd.get(key) is None, key
            assert await revision_of(etcd, ks.result(REF)) == result

    run(scenario())


def test_a_members_end_is_not_recorded_for_an_attempt_that_was_started_again(
    etcd_server: EtcdServer,
) -> None:
    """Rank 0 (a) dies: its seat, claim and rendezvous go with its lease; c takes rank 0
    and starts attempt 2 with b, whose seat never changed. b's late end of attempt 1 is
    not recorded: its claim is gone."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            first, second = await started_again(etcd, ks)

            assert await gang_txns.member_end(etcd, ks, REF, 1, 1, OK, first.revision,
                                              first.seats[1][1]) is None

            assert await etcd.get(ks.gang_end(REF, 1, 1)) is None
            assert await revision_of(etcd, ks.claim(REF)) == second.revision

    run(scenario())


def test_a_members_end_is_not_recorded_after_it_lost_its_seat(etcd_server: EtcdServer) -> None:
    """b's lease ends during attempt 1 and d takes rank 1; rank 0's claim is unchanged.
    b's late end is not recorded (rank 0 would count it as the gang's)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            leases, rdv = await two_members(etcd, ks)
            await etcd.revoke(leases["b"])
            await seat(etcd, ks, 1, "d", await etcd.grant(30))

            assert await gang_txns.member_end(etcd, ks, REF, 1, 1, OK, rdv.revision,
                                              rdv.seats[1][1]) is None

            assert await etcd.get(ks.gang_end(REF, 1, 1)) is None
            assert await revision_of(etcd, ks.claim(REF)) == rdv.revision

    run(scenario())


def test_a_gang_that_lost_a_member_records_no_result(etcd_server: EtcdServer) -> None:
    """b's lease ends (and d sits down at rank 1) while attempt 1 runs: rank 0 may not
    record a success, only the attempt's end as ``node-lost`` (the gang forms again)."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            leases, rdv = await two_members(etcd, ks)
            await etcd.revoke(leases["b"])
            await seat(etcd, ks, 1, "d", await etcd.grant(30))
            done = Attempt(1, "a", "succeeded", 0, "exit", 1.0, 2.0)

            assert await gang_txns.finish(
                etcd, ks, Finish(REF, rdv.revision, None, done, "succeeded"), rdv
            ) is None

            assert await etcd.get(ks.result(REF)) is None
            assert await revision_of(etcd, ks.claim(REF)) == rdv.revision
            assert await etcd.get(ks.gang_rendezvous(REF)) is not None
            lost = Attempt(1, "a", "failed", None, "node-lost", 1.0, 2.0)
            assert await gang_txns.finish(
                etcd, ks, Finish(REF, rdv.revision, None, lost, None), rdv
            ) is not None
            assert await etcd.get(ks.result(REF)) is None
            assert await etcd.get(ks.claim(REF)) is None
            assert (await value_of(etcd, ks.attempt(REF, 1)))["reason"] == "node-lost"

    run(scenario())


def test_a_zombie_rank_0s_end_is_not_recorded_after_the_task_was_started_again(
    etcd_server: EtcdServer,
) -> None:
    """Rank 0 (a) of attempt 1 pauses past its lease; c takes rank 0 and starts attempt 2
    with b. a's late end of attempt 1 is not final (the gang is to form again), so no
    seat is compared: only the claim's revision refuses it. Nothing is written: c's claim
    and rendezvous stay, and attempt 1 keeps the record c closed it with."""
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            first, second = await started_again(etcd, ks)
            closed = await value_of(etcd, ks.attempt(REF, 1))
            late = Attempt(1, "a", "failed", 1, "exit", 1.0, 2.0)

            assert await gang_txns.finish(
                etcd, ks, Finish(REF, first.revision, None, late, None), first
            ) is None

            assert await revision_of(etcd, ks.claim(REF)) == second.revision
            assert await revision_of(etcd, ks.gang_rendezvous(REF)) == second.revision
            assert await value_of(etcd, ks.attempt(REF, 1)) == closed

    run(scenario())
