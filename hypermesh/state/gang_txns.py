"""The etcd transactions of gangs (see ``hypermesh.state.gangs`` for the records).

Every write is guarded: a seat is taken only while free, a gang starts only while
every seat it names is held by the member it names, a member's end is recorded only
while the attempt's claim is unchanged, and rank 0 records a result only while the
claim and every seat the attempt started with are unchanged.
"""

from __future__ import annotations

from hypermesh.state.etcd import Etcd
from hypermesh.state.gangs import MemberEnd, Rendezvous
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import dumps as _dumps
from hypermesh.state.txns import ClaimPlan, Finish, claim_ops, finish_ops


async def join(
    etcd: Etcd, ks: Keyspace, ref: TaskRef, rank: int, node: str, host: str, lease: int
) -> int | None:
    """Take seat ``rank`` on ``lease`` if it is free and the task has no result; the
    seat's revision, or None when someone was first."""
    seat = ks.gang_seat(ref, rank)
    done = await etcd.txn(
        [etcd.absent(seat), etcd.absent(ks.result(ref))],
        [etcd.op_put(seat, _dumps({"node": node, "host": host, "lease": lease}), lease=lease)],
    )
    return done.revision if done.succeeded else None


async def leave(etcd: Etcd, ks: Keyspace, ref: TaskRef, rank: int, revision: int) -> bool:
    """Give seat ``rank`` back, if it is still the one taken at ``revision``."""
    seat = ks.gang_seat(ref, rank)
    done = await etcd.txn([etcd.mod_revision_is(seat, revision)], [etcd.op_delete(seat)])
    return done.succeeded


async def start(
    etcd: Etcd,
    ks: Keyspace,
    plan: ClaimPlan,
    rdv: Rendezvous,
    node: str,
    lease: int,
    now: float,
) -> int | None:
    """Start a gang attempt: claim the task (as ``claim_tasks`` does) and publish the
    rendezvous, both on rank 0's ``lease``, only while every seat of ``rdv`` is held by
    the member it names. The start revision, or None if anything changed."""
    compare, ops = claim_ops(etcd, ks, plan, node, lease, now, {"gang": len(rdv.seats)})
    key = ks.gang_rendezvous(plan.ref)
    compare.append(etcd.absent(key))
    compare += [
        etcd.mod_revision_is(ks.gang_seat(plan.ref, rank), revision)
        for rank, (_, revision) in rdv.seats.items()
    ]
    ops.append(etcd.op_put(key, _dumps(rdv.to_json()), lease=lease))
    done = await etcd.txn(compare, ops)
    return done.revision if done.succeeded else None


async def member_end(
    etcd: Etcd, ks: Keyspace, ref: TaskRef, attempt: int, rank: int, end: MemberEnd,
    start_revision: int, seat_revision: int,
) -> int | None:
    """Record how member ``rank``'s process of ``attempt`` ended, while the attempt's
    claim and the member's seat are unchanged; the revision, or None."""
    done = await etcd.txn(
        [
            etcd.mod_revision_is(ks.claim(ref), start_revision),
            etcd.mod_revision_is(ks.gang_seat(ref, rank), seat_revision),
        ],
        [
            etcd.op_put(
                ks.gang_end(ref, attempt, rank),
                _dumps({"state": end.state, "exit_code": end.exit_code, "reason": end.reason}),
            )
        ],
    )
    return done.revision if done.succeeded else None


async def finish(etcd: Etcd, ks: Keyspace, item: Finish, rdv: Rendezvous) -> int | None:
    """Record a gang attempt's end (rank 0): as ``finish_attempts`` does, and drop the
    rendezvous. A result (``final_state``) is written only while every seat of ``rdv``
    is still held by the member that started; a non-final end needs only the claim."""
    compare, ops = finish_ops(etcd, ks, item)
    ops.append(etcd.op_delete(ks.gang_rendezvous(item.ref)))
    if item.final_state is not None:
        compare += [
            etcd.mod_revision_is(ks.gang_seat(item.ref, rank), revision)
            for rank, (_, revision) in rdv.seats.items()
        ]
    done = await etcd.txn(compare, ops)
    return done.revision if done.succeeded else None
