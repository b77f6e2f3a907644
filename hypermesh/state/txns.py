"""The etcd transactions of a mesh: submit, cancel, expand, claim, finish.

Every write that depends on a claim or on a state someone else may change is
guarded by a compare, so the invariants hold whatever the timing:

- a task is claimed by at most one attempt at a time (claim key absent);
- a ``workers`` cap is never exceeded (a claim also takes a free slot key);
- a task has at most one result, written only by the attempt whose claim is
  still in place (claim mod revision unchanged) — a zombie's late result fails.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hypermesh.errors import NotFound, UsageError
from hypermesh.recipe.plan import plan_tasks
from hypermesh.state.etcd import MAX_TXN_OPS, Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import TERMINAL, Attempt, WorkflowRecord, dumps
from hypermesh.state.settings import load_settings

MAX_TXN_BYTES = 512 * 1024
"""Bytes of keys and values one expansion transaction writes at most (etcd's request
limit is 1.5 MiB by default)."""

MAX_TXN_TASKS = 1024
"""Tasks one expansion transaction writes at most: every agent's mirror applies a
transaction at once, so its size bounds how long that holds the agent's loop."""

INLINE_VALUES = 256
"""Tasks of an expansion serialised on the event loop; more are serialised in a thread."""


def new_workflow_id(name: str) -> str:
    """A short readable id: the recipe's name, sanitised, plus 6 random hex digits."""
    stem = "".join(
        c if (c.isascii() and c.isalnum()) or c in "-_" else "-" for c in name
    ).strip("-_")[:40]
    return f"{stem or 'wf'}-{secrets.token_hex(3)}"


def state_value(state: str, reason: str | None = None, ended_at: float | None = None) -> bytes:
    """A workflow state key's value; ``reason`` says why it ended so when the leader
    failed it itself (its planning raised), and is absent otherwise. A final state also
    records when the workflow ended (``ended_at``, wall-clock seconds), which retention
    counts from (``agent/leader/retention.py``); values written before it have none."""
    value: dict[str, Any] = {"state": state}
    if reason is not None:
        value["reason"] = reason
    if ended_at is not None:
        value["ended_at"] = ended_at
    return dumps(value)


async def submit_workflow(etcd: Etcd, ks: Keyspace, wf: WorkflowRecord) -> None:
    """Store a workflow and its pending state in one transaction (ids never collide).

    Refuses (``UsageError``, nothing written) a recipe that plans more tasks than the
    mesh's ``max-workflow-tasks`` (``hypermesh/recipe/plan.py``)."""
    settings, _ = await load_settings(etcd, ks)
    plan = plan_tasks(wf.recipe, settings.max_workflow_tasks)
    if plan.over:
        raise UsageError(plan.refusal())
    result = await etcd.txn(
        [etcd.absent(ks.workflow(wf.id))],
        [
            etcd.op_put(ks.workflow(wf.id), dumps(wf.to_json())),
            etcd.op_put(ks.workflow_state(wf.id), state_value("pending")),
        ],
    )
    if not result.succeeded:
        raise UsageError(f"workflow id {wf.id} already exists")


async def cancel_workflow(etcd: Etcd, ks: Keyspace, wid: str) -> tuple[str, bool]:
    """Mark a workflow cancelled unless it already ended.

    Returns its state after, and whether this call is the one that cancelled it."""
    if await etcd.get(ks.workflow(wid)) is None:
        raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
    for _ in range(20):
        current = await etcd.get(ks.workflow_state(wid))
        state = json.loads(current[0])["state"] if current else "pending"
        if state in TERMINAL:
            return state, False
        guard = (
            etcd.mod_revision_is(ks.workflow_state(wid), current[1])
            if current
            else etcd.absent(ks.workflow_state(wid))
        )
        done = await etcd.txn(
            [guard],
            [etcd.op_put(ks.workflow_state(wid), state_value("cancelled", ended_at=time.time()))],
        )
        if done.succeeded:
            return "cancelled", True
    raise UsageError(f"workflow {wid} kept changing state; try cancel again")


def state_guard(etcd: Etcd, ks: Keyspace, wid: str, state_revision: int | None) -> list[Any]:
    """The compare that fences a leader's write: the workflow state key is as the
    leader saw it (live changes rewrite it). None: no compare (callers that hold
    no view)."""
    if state_revision is None:
        return []
    return [etcd.mod_revision_is(ks.workflow_state(wid), state_revision)]


async def set_workflow_state(
    etcd: Etcd,
    ks: Keyspace,
    wid: str,
    expected: str,
    state: str,
    state_revision: int | None = None,
    summary: dict[str, Any] | None = None,
    reason: str | None = None,
) -> bool:
    """Move a workflow from ``expected`` to ``state``; False if someone changed it first
    (with ``state_revision``, also if anyone rewrote the state key since). The leader
    passes the workflow's ``summary`` in that state, published with it, and a
    ``reason`` when it fails a workflow whose planning raised."""
    ended = time.time() if state in TERMINAL else None
    puts = [etcd.op_put(ks.workflow_state(wid), state_value(state, reason, ended))]
    if summary is not None:
        puts.append(etcd.op_put(ks.progress(wid), dumps(summary)))
    done = await etcd.txn(
        [
            etcd.value_is(ks.workflow_state(wid), state_value(expected)),
            *state_guard(etcd, ks, wid, state_revision),
        ],
        puts,
    )
    return done.succeeded


async def publish_progress(
    etcd: Etcd, ks: Keyspace, wid: str, summary: dict[str, Any], state_revision: int
) -> int | None:
    """The leader's summary of a running workflow, written only if the workflow state
    key is as its view saw it (a workflow that ended since keeps its final summary);
    the revision written, or None."""
    done = await etcd.txn(
        state_guard(etcd, ks, wid, state_revision),
        [etcd.op_put(ks.progress(wid), dumps(summary))],
    )
    return done.revision if done.succeeded else None


async def expand_experiment(
    etcd: Etcd,
    ks: Keyspace,
    wid: str,
    experiment: str,
    params: Sequence[dict[str, Any]],
    state_revision: int | None = None,
    start: int = 0,
    count: int | None = None,
    block: int | None = None,
    seen_revision: int | None = None,
) -> bool:
    """Write an experiment's tasks, then its ``expanded`` marker.

    Tasks are written in batches (etcd bounds a transaction's size); the marker
    is written last and only once. Task values are deterministic (seeded), so a
    new leader that repeats an interrupted expansion writes the same tasks.

    With ``start`` > 0 the experiment is already expanded with ``start`` tasks
    and ``params`` are tasks added to it (``hypermesh extend``): every batch is
    guarded by the marker still counting ``start``, and the marker moves to the
    new count last. Either way, ``state_revision`` fences the write against a
    live change made since the leader decided.
    ``count`` (default: ``start + len(params)``) is the marker's count: an adaptive
    search writes no task up front and each later with ``add_task``.
    With ``block`` the tasks are written as blocks of that many (``hypermesh.state.blocks``;
    one-task blocks too), without it task by task.
    With ``seen_revision``, the first write also requires that no task or block of the
    experiment was created since that revision of the leader's view: a leader that has
    not seen another's partial expansion must not write blocks of another size over it.
    """
    marker = ks.expanded(wid, experiment)
    guard = (
        [etcd.value_is(marker, dumps({"count": start}))] if start else [etcd.absent(marker)]
    ) + state_guard(etcd, ks, wid, state_revision)
    if len(params) > INLINE_VALUES:  # serialising a page must not hold the loop
        values = await asyncio.to_thread(_page_values, ks, wid, experiment, params, start, block)
    else:
        values = _page_values(ks, wid, experiment, params, start, block)
    first_guard = list(guard)
    if seen_revision is not None:
        first_guard += [
            etcd.none_created_since(f"{ks.kind_prefix(kind, wid)}{experiment}/", seen_revision)
            for kind in ("task", "block")
        ]
    txn: list[Any] = []
    size = 0
    for n, (key, value) in enumerate(values):
        txn.append(etcd.op_put(key, value))
        size += len(key) + len(value)
        full = len(txn) == MAX_TXN_OPS or len(txn) * (block or 1) >= MAX_TXN_TASKS
        if full or size > MAX_TXN_BYTES or n == len(values) - 1:
            done = await etcd.txn(first_guard, txn)
            if not done.succeeded:
                return False
            txn, size, first_guard = [], 0, guard
    total = start + len(params) if count is None else count
    done = await etcd.txn(guard, [etcd.op_put(marker, dumps({"count": total}))])
    return done.succeeded


def _page_values(
    ks: Keyspace, wid: str, experiment: str, params: Sequence[dict[str, Any]], start: int,
    block: int | None,
) -> list[tuple[str, bytes]]:
    """The keys and values of tasks ``start..`` with ``params`` (blocks of ``block``,
    or task by task without it)."""
    if block is not None:
        return [
            (ks.block(BlockRef(wid, experiment, start + i)),
             dumps({"params": list(params[i : i + block])}))
            for i in range(0, len(params), block)
        ]
    return [
        (ks.task(TaskRef(wid, experiment, start + i)), dumps({"params": p}))
        for i, p in enumerate(params)
    ]


@dataclass(frozen=True)
class ClaimPlan:
    """What a node intends to claim: a task, the attempt number it will be, the
    ``workers`` slot it takes (if capped), and a lost attempt to close out."""

    ref: TaskRef
    attempt: int
    slot: int | None = None
    lost: Attempt | None = None

    OPS = 4  # most operations one plan adds to a transaction


def claim_ops(
    etcd: Etcd, ks: Keyspace, p: ClaimPlan, node: str, lease: int, now: float,
    extra: dict[str, Any] | None = None,
) -> tuple[list[Any], list[Any]]:
    """The compares and operations that claim one plan (``extra``: more claim fields)."""
    claim = {
        "node": node,
        "attempt": p.attempt,
        "slot": p.slot,
        "lease": lease,
        "started_at": now,
        **(extra or {}),
    }
    running = Attempt(p.attempt, node, "running", started_at=now)
    compare = [
        etcd.absent(ks.claim(p.ref)),
        etcd.absent(ks.result(p.ref)),
        etcd.absent(ks.attempt(p.ref, p.attempt)),
    ]
    ops = [
        etcd.op_put(ks.claim(p.ref), dumps(claim), lease=lease),
        etcd.op_put(ks.attempt(p.ref, p.attempt), dumps(running.to_json())),
    ]
    if p.slot is not None:
        slot_key = ks.slot(p.ref.workflow, p.ref.experiment, p.slot)
        compare.append(etcd.absent(slot_key))
        ops.append(etcd.op_put(slot_key, dumps({"task": p.ref.id}), lease=lease))
    if p.lost is not None:
        lost_key = ks.attempt(p.ref, p.lost.attempt)
        lost = Attempt(
            p.lost.attempt,
            p.lost.node,
            "failed",
            reason="node-lost",
            started_at=p.lost.started_at,
            ended_at=now,
        )
        compare.append(etcd.mod_revision_is(lost_key, p.lost.revision))
        ops.append(etcd.op_put(lost_key, dumps(lost.to_json())))
    return compare, ops


async def claim_tasks(
    etcd: Etcd, ks: Keyspace, plans: Sequence[ClaimPlan], node: str, lease: int, now: float,
    refused: Callable[[int], None] | None = None,
) -> int | None:
    """Claim every plan in one transaction; the claim revision, or None if any was taken
    (then ``refused`` is told the revision etcd answered at: the claimer's view was older)."""
    compare: list[Any] = []
    ops: list[Any] = []
    for p in plans:
        more_compare, more_ops = claim_ops(etcd, ks, p, node, lease, now)
        compare += more_compare
        ops += more_ops
    done = await etcd.txn(compare, ops)
    if not done.succeeded and refused is not None:
        refused(done.revision)
    return done.revision if done.succeeded else None


@dataclass(frozen=True)
class Finish:
    """An attempt's end to record: the task, the claim revision that fences the
    write, the slot to free, the attempt record, and the result (if final)."""

    ref: TaskRef
    claim_revision: int
    slot: int | None
    attempt: Attempt
    final_state: str | None

    OPS = 4  # most operations one finish adds to a transaction


def finish_ops(etcd: Etcd, ks: Keyspace, f: Finish) -> tuple[list[Any], list[Any]]:
    """The compares (the claim is still this attempt's, no result yet) and operations
    (attempt record, claim and slot released, the result if final) of one finish."""
    ref, attempt = f.ref, f.attempt
    ops = [
        etcd.op_put(ks.attempt(ref, attempt.attempt), dumps(attempt.to_json())),
        etcd.op_delete(ks.claim(ref)),
    ]
    if f.slot is not None:
        ops.append(etcd.op_delete(ks.slot(ref.workflow, ref.experiment, f.slot)))
    if f.final_state is not None:
        result = {
            "state": f.final_state,
            "attempt": attempt.attempt,
            "exit_code": attempt.exit_code,
            "ended_at": attempt.ended_at or time.time(),
        }
        ops.append(etcd.op_put(ks.result(ref), dumps(result)))
    compare = [
        etcd.mod_revision_is(ks.claim(ref), f.claim_revision),
        etcd.absent(ks.result(ref)),
    ]
    return compare, ops


async def finish_attempts(etcd: Etcd, ks: Keyspace, items: Sequence[Finish]) -> int | None:
    """Record several attempts' ends in one transaction (see ``finish_attempt``).

    All or nothing: if any claim is no longer the attempt's, nothing is written
    and None is returned; the caller then records the items one by one.
    """
    compare: list[Any] = []
    ops: list[Any] = []
    for f in items:
        more_compare, more_ops = finish_ops(etcd, ks, f)
        compare += more_compare
        ops += more_ops
    done = await etcd.txn(compare, ops)
    return done.revision if done.succeeded else None


async def finish_attempt(
    etcd: Etcd,
    ks: Keyspace,
    ref: TaskRef,
    claim_revision: int,
    slot: int | None,
    attempt: Attempt,
    final_state: str | None,
) -> int | None:
    """Record an attempt's end, release its claim, and (if final) the task's result.

    Fenced: succeeds only while the claim is the one this attempt made. Returns
    the revision of the write, or None when the claim was lost (the node's lease
    expired, or it was revoked), in which case nothing is written.
    """
    return await finish_attempts(
        etcd, ks, [Finish(ref, claim_revision, slot, attempt, final_state)]
    )


async def add_task(
    etcd: Etcd,
    ks: Keyspace,
    ref: TaskRef,
    params: dict[str, Any],
    state_revision: int | None = None,
    block: bool = False,
) -> bool:
    """Write one task of an adaptive experiment, as a task key or (``block``) as a
    one-task block; False if that index already exists either way (another leader wrote
    it first) or a live change was made since the leader decided."""
    bref = BlockRef(ref.workflow, ref.experiment, ref.index)
    key, value = ((ks.block(bref), {"params": [params]}) if block
                  else (ks.task(ref), {"params": params}))
    done = await etcd.txn(
        [etcd.absent(ks.task(ref)), etcd.absent(ks.block(bref)),
         *state_guard(etcd, ks, ref.workflow, state_revision)],
        [etcd.op_put(key, dumps(value))],
    )
    return done.succeeded


async def put_metrics(
    etcd: Etcd, ks: Keyspace, ref: TaskRef, attempt: int, claim_revision: int, value: bytes,
    block: BlockRef | None = None,
) -> int | None:
    """Store an attempt's metrics, fenced like its result: only while the claim is the
    one this attempt made (for a task of a held ``block``, the block's claim, created at
    ``claim_revision``). The revision written, or None if the claim is gone."""
    fence = (
        etcd.created_at(ks.block_claim(block), claim_revision)
        if block is not None
        else etcd.mod_revision_is(ks.claim(ref), claim_revision)
    )
    done = await etcd.txn([fence], [etcd.op_put(ks.metrics(ref, attempt), value)])
    return done.revision if done.succeeded else None
