"""The etcd transactions of batched experiments (``hypermesh.state.blocks``).

- ``claim_block``: take a block nobody holds, provided no batch of it was written
  since the claimer's view (so the claimer knows every recorded outcome), and record
  the attempts the last holder left running as lost, in the same transaction; for an
  experiment with a ``workers`` cap, take a free slot of the cap (``bcap/``) with it.
- ``flush_block``: write one batch of attempt records and results, fenced on the
  claim's create revision; optionally release the claim (and its cap slot) in the
  same transaction.
- ``claim_open_block`` and ``read_block``: the claim of a node that does not watch the
  blocks (``agent start --watch own``): take a block nobody holds, then read what its
  batches say (``block_view``); they are all older than the claim, which fences every
  later one.
- ``claimable``: the compares of a claim, which ``hypermesh retry`` also uses to reopen
  failed tasks of a block nobody holds (``hypermesh.state.live``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hypermesh.state.blocks import AttemptEntry, Batch
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace
from hypermesh.state.records import dumps
from hypermesh.state.view import MeshView


def lost_entries(
    running: Sequence[tuple[int, int, str, float | None]], now: float
) -> list[AttemptEntry]:
    """Records closing attempts (index, attempt, node, started_at) left running."""
    return [
        AttemptEntry(index, attempt, "failed", None, "node-lost", started_at, now, node)
        for index, attempt, node, started_at in running
    ]


def claimable(etcd: Etcd, ks: Keyspace, bref: BlockRef, seen_revision: int) -> list[Any]:
    """Nobody holds ``bref`` and no batch of it was written since ``seen_revision``."""
    return [
        etcd.absent(ks.block_claim(bref)),
        etcd.none_created_since(ks.block_batches(bref), seen_revision),
    ]


async def claim_block(
    etcd: Etcd,
    ks: Keyspace,
    bref: BlockRef,
    node: str,
    lease: int,
    seen_revision: int,
    batch_key: str,
    lost: Sequence[AttemptEntry] = (),
    refused: Callable[[int], None] | None = None,
    slot: int | None = None,
) -> int | None:
    """Claim ``bref`` for ``node`` (and slot ``slot`` of its experiment's ``workers``
    cap, when given); the claim's create revision (the fence of every later batch), or
    None when someone holds it (or the slot) or wrote a batch the view has not seen
    (then ``refused`` is told the revision etcd answered at)."""
    compare = claimable(etcd, ks, bref, seen_revision)
    claim = {"node": node, "lease": lease, "started_at": time.time()}
    ops = [etcd.op_put(ks.block_claim(bref), dumps(claim), lease=lease)]
    _take_slot(etcd, ks, bref, node, lease, slot, compare, ops)
    if lost:
        ops.append(etcd.op_put(batch_key, dumps(Batch(node, tuple(lost)).to_json())))
    done = await etcd.txn(compare, ops)
    if not done.succeeded and refused is not None:
        refused(done.revision)
    return done.revision if done.succeeded else None


def _take_slot(etcd: Etcd, ks: Keyspace, bref: BlockRef, node: str, lease: int,
               slot: int | None, compare: list[Any], ops: list[Any]) -> None:
    """Add to a block claim's transaction the taking of cap slot ``slot`` (if any): it
    must be free, and is held on the claimer's lease, as the claim is."""
    if slot is None:
        return
    key = ks.block_slot(bref.workflow, bref.experiment, slot)
    compare.append(etcd.absent(key))
    ops.append(etcd.op_put(key, dumps({"node": node, "first": bref.first}), lease=lease))


async def flush_block(
    etcd: Etcd,
    ks: Keyspace,
    bref: BlockRef,
    fence: int,
    batch_key: str,
    batch: Batch,
    release: bool = False,
    slot: int | None = None,
) -> int | None:
    """Write ``batch`` while the claim made at revision ``fence`` is still in place
    (and with ``release``, delete the claim and the cap slot ``slot`` it took with it);
    the revision, or None if it is gone."""
    ops = [etcd.op_put(batch_key, dumps(batch.to_json()))]
    if release:
        ops.append(etcd.op_delete(ks.block_claim(bref)))
        if slot is not None:
            ops.append(etcd.op_delete(ks.block_slot(bref.workflow, bref.experiment, slot)))
    done = await etcd.txn([etcd.created_at(ks.block_claim(bref), fence)], ops)
    return done.revision if done.succeeded else None


async def claim_open_block(
    etcd: Etcd, ks: Keyspace, bref: BlockRef, node: str, lease: int,
    refused: Callable[[int], None] | None = None, slot: int | None = None,
) -> int | None:
    """Claim ``bref`` for ``node`` (and cap slot ``slot``, when given) if nobody holds
    it, whatever its batches say; the claim's create revision, or None (then
    ``refused`` is told the revision etcd answered at). The claimer learns the block's
    state with ``read_block`` next."""
    claim = {"node": node, "lease": lease, "started_at": time.time()}
    compare = [etcd.absent(ks.block_claim(bref))]
    ops = [etcd.op_put(ks.block_claim(bref), dumps(claim), lease=lease)]
    _take_slot(etcd, ks, bref, node, lease, slot, compare, ops)
    done = await etcd.txn(compare, ops)
    if not done.succeeded and refused is not None:
        refused(done.revision)
    return done.revision if done.succeeded else None


async def read_block(etcd: Etcd, ks: Keyspace, bref: BlockRef) -> list[Any]:
    """The block's key and its batches, read at one revision (key-values, block first)."""
    key, batches = ks.block(bref), ks.block_batches(bref)
    kvs, _ = await etcd.get_prefix(key, ranges=[(key, key + "\0"),
                                                (batches, batches[:-1] + "0")])
    return kvs


def block_view(ks: Keyspace, kvs: Sequence[Any]) -> MeshView:
    """A view of one block alone, from its key and batches (``read_block``)."""
    view = MeshView(ks)
    for kv in kvs:
        view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    return view
