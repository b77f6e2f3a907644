"""Batched experiments: tasks written, claimed and recorded in blocks.

Per-task keys cost about six etcd changes per task, each delivered to every agent's
mirror; for short tasks that costs more than the tasks (``docs/batched-claims.md``).
An experiment that qualifies (``why_not_batched``, a rule of the recipe language in
``hypermesh.recipe.recipe``; on a large mesh, one that asks for GPUs or has ``inputs``,
``prefer_pools`` or a ``workers`` cap too: ``block_size``)
is therefore written as *blocks* of up to ``MAX_BLOCK`` consecutive tasks (``block/``
keys). A node claims a whole block (``bclaim/``, on its lease) in one transaction, runs
its tasks in its own slots, and records their attempts
and results in *batches* (``bdone/`` keys), each written by one transaction fenced on
the claim's create revision, so a holder whose lease is gone writes nothing. The mirror
(``hypermesh.state.mirror``) expands blocks and batches into the same per-task tables as
per-task keys, so every reader sees tasks as before.

The invariants are the per-task ones:

- at most one success per task: a batch is written only while the claim it is
  fenced on exists, and a block is claimed only while nobody holds it and no batch
  was written since the claimer's view (a range compare), so a new holder knows
  every outcome recorded before it;
- nothing is lost: a dead holder's claim goes with its lease; the next holder runs
  every task without a result, first recording the attempts the last holder left
  ``running`` as lost (reason ``node-lost``);
- retries: a failed attempt that counts is run again by the holder while the
  experiment's ``retries`` allow.

Pure: no I/O. The transactions are in ``hypermesh.state.block_txns``, the holder in
``agent/tasks/blocks.py``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from hypermesh.recipe.recipe import MAX_BLOCK, Experiment, why_not_batched
from hypermesh.state.keyspace import BlockRef

TASKS_PER_SLOT = 4
"""An automatic block is about 1/TASKS_PER_SLOT of the tasks per slot of the mesh, so
that a block is a small share of the work and the last blocks still spread."""

LARGE_MESH_SLOTS = 64
"""From this many slots on, an experiment that may be batched is always written in
blocks: per-task keys reach every member's watch, which on a mesh this size costs more
than anything they give, where a block's keys reach only its holder, the leader and the
nodes that watch everything (``agent start --watch own``). Its automatic blocks hold 2
tasks once there are 2 tasks per slot, and one task below that, so that every slot
still gets work."""


def block_size(exp: Experiment, count: int, mesh_slots: int) -> int | None:
    """Tasks per block for an experiment of ``count`` tasks on a mesh of ``mesh_slots``
    slots, or None for per-task keys: the recipe's ``batch`` if set (``batch: 1`` is
    per-task keys), else about ``count / (4 * slots)``, at most ``MAX_BLOCK``; below 2
    per-task keys on a small mesh, and on a mesh of ``LARGE_MESH_SLOTS`` blocks of 2 with
    2 tasks per slot, one-task blocks with fewer. There an experiment that asks for GPUs,
    has ``inputs``, ``prefer_pools`` or a ``workers`` cap, and for nothing else that keeps
    per-task keys, runs in one-task blocks too (``placed_per_block``)."""
    if why_not_batched(exp) is not None:
        return 1 if mesh_slots >= LARGE_MESH_SLOTS and placed_per_block(exp) else None
    if exp.batch is not None:
        return exp.batch if exp.batch > 1 else None
    size = min(MAX_BLOCK, count // (TASKS_PER_SLOT * max(1, mesh_slots)))
    if size >= 2:
        return size
    if mesh_slots >= LARGE_MESH_SLOTS:
        return 2 if count >= 2 * mesh_slots else 1
    return None


def placed_per_block(exp: Experiment) -> bool:
    """Whether what keeps ``exp`` from blocks (``why_not_batched``) is only what a
    one-task block can decide too, and no ``batch: 1`` asks for per-task keys:

    - GPUs: the holder books them as the task starts (``agent/claims/claimer.py``), and
      the leader offers GPU blocks where gossip says a GPU is free;
    - ``inputs``: the leader offers the block to the node that holds most of its data,
      and keeps it for that node for the locality delay (``agent/leader/offers.py``);
    - ``prefer_pools``: the leader keeps it for a node of a preferred pool with room
      for the pool delay;
    - a ``workers`` cap: the block's claim takes a slot of the cap (``bcap/``) in the
      same transaction, and gives it back with the claim, so that no more blocks run at
      once than the cap allows (the leader offers each block with a free slot);
    - an adaptive search: the leader writes each trial it suggests as a one-task block
      (it sees every result: ``agent/leader/duty.py``);
    - pruning: the holder asks the pruner with the per-step medians of the completed
      trials, from its view or, on a node that watches its own part, as the leader
      publishes them (``agent/leader/prune_medians.py``).
    """
    if exp.batch == 1 or not (
        exp.hardware.gpus or exp.inputs or exp.prefer_pools or exp.workers is not None
        or exp.sampling == "tpe" or exp.pruning is not None
    ):
        return False
    bare = replace(exp, hardware=replace(exp.hardware, gpu=None, gpus=0.0, gpu_memory=0),
                   inputs=(), prefer_pools=(), workers=None, sampling=None, pruning=None)
    return why_not_batched(bare) is None


# ---------------------------------------------------------------- batch values
class AttemptEntry(NamedTuple):
    """One attempt record in a batch (a start, an end, or a lost attempt). ``node``
    is where it ran when that is not the batch's writer (a lost attempt)."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, on purpose
    attempt: int
    state: str
    exit_code: int | None = None
    reason: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    node: str | None = None

    def to_json(self) -> list[Any]:
        row = [self.index, self.attempt, self.state, self.exit_code, self.reason,
               self.started_at, self.ended_at]
        return row if self.node is None else [*row, self.node]

    @classmethod
    def from_json(cls, row: list[Any]) -> AttemptEntry:
        index, attempt, state, exit_code, reason, started_at, ended_at, *node = row
        return cls(int(index), int(attempt), str(state), exit_code, reason, started_at,
                   ended_at, str(node[0]) if node else None)


class ResultEntry(NamedTuple):
    """A task's final outcome in a batch."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, on purpose
    state: str
    attempt: int
    exit_code: int | None
    ended_at: float

    def to_json(self) -> list[Any]:
        return [self.index, self.state, self.attempt, self.exit_code, self.ended_at]

    @classmethod
    def from_json(cls, row: list[Any]) -> ResultEntry:
        index, state, attempt, exit_code, ended_at = row
        return cls(int(index), str(state), int(attempt), exit_code, float(ended_at))


@dataclass(frozen=True)
class Batch:
    """One ``bdone/`` value: what a block's holder recorded in one transaction.

    ``reopened`` are tasks ``hypermesh retry`` made runnable again: their result is
    dropped and only attempts after ``retry_from`` count against ``retries``."""

    node: str
    attempts: tuple[AttemptEntry, ...] = ()
    results: tuple[ResultEntry, ...] = ()
    reopened: tuple[tuple[int, int], ...] = ()  # (index, retry_from)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node}
        if self.attempts:
            out["a"] = [a.to_json() for a in self.attempts]
        if self.results:
            out["r"] = [r.to_json() for r in self.results]
        if self.reopened:
            out["o"] = [list(pair) for pair in self.reopened]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Batch:
        return cls(
            node=str(data["node"]),
            attempts=tuple(AttemptEntry.from_json(row) for row in data.get("a", ())),
            results=tuple(ResultEntry.from_json(row) for row in data.get("r", ())),
            reopened=tuple((int(i), int(f)) for i, f in data.get("o", ())),
        )


def decision_rows(batch: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The task indices a ``bdone`` value decides (results) and reopens."""
    return [int(row[0]) for row in batch.get("r", ())], [int(row[0]) for row in batch.get("o", ())]


# ---------------------------------------------------------------- offers and cap slots
class OfferTables:
    """The mirror's tables of what the leader gives nodes that choose from offers: the
    offers (``offer/<node>``), the slots of ``workers`` caps those offers give blocks,
    the slots one-task blocks hold (``bcap/``), and the counts of what is held (per
    experiment and per node), kept by the mirror as claims come and go. Part of
    ``hypermesh.state.mirror.Mirror`` (which calls ``_init_offer_tables``), fed by its
    ``apply``."""

    def _init_offer_tables(self) -> None:
        # The leader's offers (``offer/<node>``): node -> (blocks, the revision of the view
        # the leader planned them from, else the key's mod revision). A node does not claim
        # again a block it gave back at or after that revision (``agent/tasks/blocks.py``):
        # a leader lagging behind it still offered it, not knowing it was done.
        self.offers: dict[str, tuple[tuple[BlockRef, ...], int]] = {}
        # The cap slots the offers give blocks of capped experiments, per experiment:
        # block -> slot; and each node's, to undo when its offer changes.
        self.offered_slots: dict[tuple[str, str], dict[BlockRef, int]] = defaultdict(dict)
        self._offer_slot_rows: dict[str, list[BlockRef]] = {}
        # Slots of ``workers`` caps held by one-task blocks (``bcap/``): slot -> block first.
        self.block_slots: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
        self.block_claim_counts: Counter[tuple[str, str]] = Counter()  # held, per experiment
        # Per node: the tasks it runs (claims) and the blocks it holds; and, while the
        # leader plans offers (``offer_blocks`` set), the nodes either count fell for.
        self.node_running: Counter[str] = Counter()
        self.node_blocks: Counter[str] = Counter()
        self.load_dropped: set[str] = set()

    def _apply_offer(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        for bref in self._offer_slot_rows.pop(parts[0], ()):
            bucket = self.offered_slots[(bref.workflow, bref.experiment)]
            bucket.pop(bref, None)
            if not bucket:
                del self.offered_slots[(bref.workflow, bref.experiment)]
        if data is None:
            self.offers.pop(parts[0], None)
            return
        blocks: list[BlockRef] = []
        for w, e, f, *slot in data["blocks"]:  # [workflow, experiment, first, cap slot?]
            bref = BlockRef(str(w), str(e), int(f))
            blocks.append(bref)
            if slot:
                self._offer_slot_rows.setdefault(parts[0], []).append(bref)
                self.offered_slots[(bref.workflow, bref.experiment)][bref] = int(slot[0])
        self.offers[parts[0]] = (tuple(blocks), int(data.get("at", mrev)))

    def _apply_bcap(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        key, k = (parts[0], parts[1]), int(parts[2])
        if data is None:
            self.block_slots[key].pop(k, None)
            if not self.block_slots[key]:
                del self.block_slots[key]
        else:
            self.block_slots[key][k] = int(data["first"])
