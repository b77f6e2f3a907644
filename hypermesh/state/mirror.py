"""The mirror: one namespace's etcd keys kept as local tables, changed only by events.

``Mirror`` is fed key/value events (a range read, then a watch) through ``apply``
and keeps a table per kind of key: nodes, workflows, tasks, claims, attempts,
results, metrics, gangs, bursting records. Batched experiments
(``hypermesh.state.blocks``) are expanded here into the same per-task tables, so no
reader needs to know whether a task was written alone or in a block. Besides the raw
tables it keeps a few incrementally: the open tasks and the count of tasks per state
of each experiment, so that summaries cost O(1) per experiment.

The mirror does no I/O and reads no clock. Only its owner (one agent task, or the
CLI) changes it, through ``apply``, ``reset``, ``settle`` and ``set_defer_batches``;
everything else reads, through ``hypermesh.state.view.MeshView``, which adds the
answers derived from these tables.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any, cast

from hypermesh.errors import HypermeshError
from hypermesh.etcd_watch import Following
from hypermesh.state.blocks import Batch, OfferTables, decision_rows
from hypermesh.state.folding import (
    AttemptKey,
    FoldedBlock,
    attempt_tally,
    decided_states,
    pack,
    unpack,
)
from hypermesh.state.gangs import GangTable
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.pools import BurstTables
from hypermesh.state.records import (
    TERMINAL,
    Attempt,
    Claim,
    ExperimentControl,
    NodeRecord,
    Result,
    WorkflowRecord,
)
from hypermesh.state.settings import MeshSettings
from hypermesh.state.task_metrics import AttemptMetrics

log = logging.getLogger(__name__)


_BLOCK_KINDS = frozenset({"block", "bclaim", "bdone"})
_PLAN_KINDS = frozenset({"node", "wf", "wfstate", "expctl", "expanded"})
# What an own part's mirror receives that names a workflow, or ends following it (_follow_named).
_NAMING_KINDS = frozenset({"wf", "wfstate", "offer", "task", "claim", "attempt", "result",
                           "slot", "gang"})


class Mirror(OfferTables, BurstTables):
    """An in-memory mirror of a namespace, kept current by ``apply``.

    Only the owner of the mirror (one agent task, or the CLI) calls ``apply``,
    ``reset``, ``settle`` and ``set_defer_batches``; everything else reads, mostly
    through ``MeshView``, the subclass that adds the derived answers. ``revision`` is
    the etcd revision the mirror reflects. After every call the incremental tables
    (``open``, ``counts``, ``block_open``) agree with ``tasks``, ``claims`` and
    ``results``; with ``defer_batches`` set, a block's batches reach the per-task
    tables only when it is settled.
    """

    def __init__(self, keyspace: Keyspace) -> None:
        self.ks = keyspace
        self.revision = 0
        # ``--watch own``: which workflows' own keys the watch follows (see _follow_named).
        self.following: Following | None = None
        self.settings = MeshSettings()  # the mesh's ``settings`` key, or the defaults
        self.nodes: dict[str, NodeRecord] = {}
        self.candidates: dict[str, tuple[int, str]] = {}  # key -> (create_revision, node)
        self.workflows: dict[str, WorkflowRecord] = {}
        self.workflow_states: dict[str, str] = {}
        self.workflow_state_revisions: dict[str, int] = {}
        # Why the leader failed a workflow itself (its planning raised), per workflow.
        self.workflow_reasons: dict[str, str] = {}
        # Workflow records this mirror could not read, and why: the leader fails them.
        self.unreadable: dict[str, str] = {}
        self.controls: dict[tuple[str, str], ExperimentControl] = {}
        self.expanded: dict[tuple[str, str], int] = {}
        self.tasks: dict[TaskRef, dict[str, Any]] = {}
        self.claims: dict[TaskRef, Claim] = {}
        self.attempts: dict[TaskRef, dict[int, Attempt]] = defaultdict(dict)
        self.results: dict[TaskRef, Result] = {}
        self.slots: dict[tuple[str, str], set[int]] = defaultdict(set)
        self.metrics: dict[TaskRef, dict[int, AttemptMetrics]] = defaultdict(dict)
        # Tasks with neither a claim nor a result, per (workflow, experiment).
        self.open: dict[tuple[str, str], set[int]] = defaultdict(set)
        # Known tasks per (workflow, experiment) by raw state: open, running, or
        # their result's state. Kept incrementally so summaries cost O(1).
        self.counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        # What the leader last published of each workflow (``progress/<wid>``): the
        # ``workflow_summary`` of its view then, followed by ``submit --wait``.
        self.progress: dict[str, dict[str, Any]] = {}
        self._init_burst_tables()
        self.gangs = GangTable()  # seats, rendezvous and member ends of gang tasks
        self._init_offer_tables()
        # For the leader's offer planning (agent/leader/offers.py): the blocks whose keys
        # changed since it last looked (kept only while it sets a set here), and a count
        # of the changes to nodes and workflows, after which it plans everything again.
        self.offer_blocks: set[BlockRef] | None = None
        self.offer_epoch = 0
        # Batched experiments (hypermesh/state/blocks.py), expanded into the tables above: a
        # block's tasks into ``tasks``, a batch's records into ``attempts`` and
        # ``results``, and the running attempts of a held block into ``claims`` (a
        # Claim whose revision is the block claim's create revision, the fence).
        self.blocks: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)  # first -> size
        self.block_claims: dict[BlockRef, Claim] = {}
        self._block_indices: dict[BlockRef, set[int]] = defaultdict(set)  # with attempts
        # Per block, bdone key -> (revision, its value): parsed again only to undo it.
        self._batches: dict[BlockRef, dict[str, tuple[int, Any]]] = defaultdict(dict)
        self._result_revisions: dict[TaskRef, int] = {}  # batch revision of a block result
        self._reopened: dict[TaskRef, tuple[int, int]] = {}  # (revision, retry_from)
        self.block_open: Counter[BlockRef] = Counter()  # open tasks per block
        self._block_of: dict[TaskRef, BlockRef] = {}
        self._firsts: dict[tuple[str, str], list[int]] = {}  # sorted, cached
        # Deferred batches (``defer_batches``): a non-leading agent only needs what a
        # batch says in detail about a block it is about to claim, so batches wait
        # here, per block and in arrival order, until ``settle``. What every view keeps
        # up to date is cheap: per block, the revision of each task's last result and
        # last reopening, and how many tasks are decided (``block_unfinished``).
        self.defer_batches = False
        self._deferred: dict[BlockRef, list[tuple[str, int, dict[str, Any]]]] = {}
        self._result_at: dict[BlockRef, dict[int, int]] = defaultdict(dict)
        self._reopened_at: dict[BlockRef, dict[int, int]] = defaultdict(dict)
        self._decided: Counter[BlockRef] = Counter()
        # Folding (``hypermesh/state/folding.py``): past ``fold_after`` tasks of settled
        # blocks (None: never, the default), the oldest are kept as counts and a packed
        # copy in ``folded`` instead of per-task records. ``_settled``: the settled blocks
        # not folded, oldest first, with their sizes; ``_touched``: blocks to look at again.
        self.fold_after: int | None = None
        self.folded: dict[BlockRef, FoldedBlock] = {}
        self._settled: dict[BlockRef, int] = {}
        self._settled_tasks = 0
        self._touched: set[BlockRef] = set()
        self._thawing: set[BlockRef] = set()  # being unfolded

    # ------------------------------------------------------------------ feeding
    def reset(self) -> None:
        """Forget everything (before a full reload after a compacted watch) but whether
        batches are deferred, when blocks are folded and which workflows are followed."""
        defer, fold_after, epoch = self.defer_batches, self.fold_after, self.offer_epoch
        following = self.following
        self.__init__(self.ks)  # type: ignore[misc]
        self.defer_batches, self.fold_after, self.following = defer, fold_after, following
        self.offer_epoch = epoch + 1  # and the offers are planned whole again

    def apply(
        self, key: str, value: bytes | None, create_revision: int = 0, mod_revision: int = 0
    ) -> None:
        """Apply one put (``value`` set) or delete (``value`` None) of ``key``."""
        self.revision = max(self.revision, mod_revision)
        split = self.ks.split(key)
        if split is None:
            return
        kind, parts = split
        handler = getattr(self, f"_apply_{kind}", None)
        if handler is None:
            return
        try:
            data: dict[str, Any] | None = json.loads(value) if value else None
            if data is not None and not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            handler(parts, data, create_revision, mod_revision)
            if self.following is not None and kind in _NAMING_KINDS:
                self._follow_named(kind, parts[0], data)
            if kind in _BLOCK_KINDS:
                if self.offer_blocks is not None:
                    self.offer_blocks.add(BlockRef(parts[0], parts[1], int(parts[2])))
            elif kind in _PLAN_KINDS:
                self.offer_epoch += 1
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, HypermeshError) as exc:
            # A malformed key must not stop the mirror; it is skipped and reported.
            log.warning("ignoring malformed key %s: %s", key, exc)

    def _follow_named(self, kind: str, name: str, data: Any) -> None:
        """A mirror of a node's own part follows each workflow from the first key naming
        it (its offer, a per-task key) until it ends (kept as last read, the oldest past
        ``ENDED_KEPT`` forgotten; an offer or a task key, which ``retry`` rewrites, follow
        it again) or is deleted (forgotten: the purge's other keys never reach it)."""
        following = cast(Following, self.following)  # the caller checked
        if kind == "offer":
            for wid in {bref.workflow for bref in self.offers.get(name, ((), 0))[0]}:
                following.want(wid)
        elif kind not in ("wf", "wfstate"):
            if data is not None:
                following.want(name, again=kind == "task")
        elif data is None:
            following.drop(name)
            self._forget_workflow(name)
        elif kind == "wfstate" and data["state"] in TERMINAL:
            for gone in following.end(name):
                self._forget_workflow(gone)

    def _forget_workflow(self, wid: str) -> None:
        for table in (self.workflows, self.workflow_states, self.workflow_state_revisions,
                      self.workflow_reasons, self.unreadable):
            table.pop(wid, None)
        for plans in (self.expanded, self.controls):
            for key in [k for k in plans if k[0] == wid]:
                del plans[key]

    def _apply_settings(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        self.settings = MeshSettings() if data is None else MeshSettings.from_json(data)

    def _apply_node(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        if data is None:
            self.nodes.pop(parts[0], None)
        else:
            self.nodes[parts[0]] = NodeRecord.from_json(data)
            if parts[0] in self.instances:
                self.booted.add(parts[0])

    def _apply_elect(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        if data is None:
            self.candidates.pop(parts[0], None)
        else:
            self.candidates[parts[0]] = (crev, data["node"])

    def _apply_wf(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        self.unreadable.pop(parts[0], None)
        if data is None:
            self.workflows.pop(parts[0], None)
            return
        try:
            self.workflows[parts[0]] = WorkflowRecord.from_json(data)
        except (ValueError, KeyError, TypeError, HypermeshError) as exc:
            self.unreadable[parts[0]] = f"the workflow record cannot be read: {exc}"
            raise

    def _apply_wfstate(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        self.workflow_reasons.pop(parts[0], None)
        if data is None:
            self.workflow_states.pop(parts[0], None)
            self.workflow_state_revisions.pop(parts[0], None)
        else:
            self.workflow_states[parts[0]] = data["state"]
            self.workflow_state_revisions[parts[0]] = mrev
            if data.get("reason") is not None:
                self.workflow_reasons[parts[0]] = str(data["reason"])

    def _apply_progress(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        if data is None:
            self.progress.pop(parts[0], None)
        else:
            if not isinstance(data.get("experiments"), dict) or "state" not in data:
                raise TypeError("a progress record needs state and experiments")
            self.progress[parts[0]] = data

    def _apply_expctl(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        if data is None:
            self.controls.pop((parts[0], parts[1]), None)
        else:
            self.controls[(parts[0], parts[1])] = ExperimentControl.from_json(data, mrev)

    def _apply_expanded(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        if data is None:
            self.expanded.pop((parts[0], parts[1]), None)
        else:
            self.expanded[(parts[0], parts[1])] = int(data["count"])

    def _ref(self, parts: list[str]) -> TaskRef:
        return TaskRef(parts[0], parts[1], int(parts[2]))

    def _raw_state(self, ref: TaskRef) -> str | None:
        if ref not in self.tasks:
            return None
        result = self.results.get(ref)
        if result is not None:
            return result.state
        return "running" if ref in self.claims else "open"

    def _refresh_open(self, ref: TaskRef, before: str | None) -> None:
        after = self._raw_state(ref)
        if before == after:
            return  # the tables already agree with this state
        key = (ref.workflow, ref.experiment)
        if after == "open":
            self.open[key].add(ref.index)
        else:
            self.open[key].discard(ref.index)
        if (before == "open" or after == "open") and ref in self._block_of:
            self.block_open[self._block_of[ref]] += 1 if after == "open" else -1
        if before is not None:
            self.counts[key][before] -= 1
        if after is not None:
            self.counts[key][after] += 1

    def _apply_task(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        ref = self._ref(parts)
        before = self._raw_state(ref)
        if data is None:
            self.tasks.pop(ref, None)
        else:
            if not isinstance(data.get("params", {}), dict):
                raise TypeError("task params must be an object")
            self.tasks[ref] = data
        self._refresh_open(ref, before)

    def _count(self, table: Counter[Any], key: Any, delta: int) -> None:
        """Change a count kept per experiment, or per node (keyed by its name)."""
        table[key] += delta
        if table[key] <= 0:
            del table[key]
        if delta < 0 and self.offer_blocks is not None and isinstance(key, str):
            self.load_dropped.add(key)

    def _set_claim(self, ref: TaskRef, claim: Claim | None) -> None:
        old = self.claims.pop(ref, None) if claim is None else self.claims.get(ref)
        if claim is not None:
            self.claims[ref] = claim
        if old is None or claim is None or old.node != claim.node:
            for c, delta in ((old, -1), (claim, 1)):
                if c is not None:
                    self._count(self.node_running, c.node, delta)

    def _apply_claim(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        ref = self._ref(parts)
        before = self._raw_state(ref)
        if data is None:
            self._set_claim(ref, None)
        else:
            self._set_claim(ref, Claim(
                node=data["node"],
                attempt=int(data["attempt"]),
                slot=data.get("slot"),
                lease=int(data.get("lease", 0)),
                started_at=float(data.get("started_at", 0.0)),
                revision=mrev,
            ))
        self._refresh_open(ref, before)

    def _apply_attempt(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        ref, n = self._ref(parts), int(parts[3])
        if data is None:
            self.attempts[ref].pop(n, None)
        else:
            self.attempts[ref][n] = Attempt(
                attempt=int(data["attempt"]),
                node=str(data["node"]),
                state=str(data["state"]),
                exit_code=data.get("exit_code"),
                reason=data.get("reason"),
                started_at=data.get("started_at"),
                ended_at=data.get("ended_at"),
                revision=mrev,
            )

    def _apply_result(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        ref = self._ref(parts)
        before = self._raw_state(ref)
        if data is None:
            self.results.pop(ref, None)
        else:
            self.results[ref] = Result(
                state=data["state"],
                attempt=int(data["attempt"]),
                exit_code=data.get("exit_code"),
                ended_at=float(data.get("ended_at", 0.0)),
            )
        self._refresh_open(ref, before)

    # ------------------------------------------------------------------ blocks
    def _apply_block(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        bref = BlockRef(parts[0], parts[1], int(parts[2]))
        self._touched.add(bref)
        if bref in self.folded:
            if data is None:
                self._drop_folded(bref)
                return
            self.unfold(bref)
        sizes = self.blocks[(bref.workflow, bref.experiment)]
        self._firsts.pop((bref.workflow, bref.experiment), None)
        if data is None:
            size = sizes.pop(bref.first, 0)
            for offset in range(size):
                ref = bref.task(offset)
                before = self._raw_state(ref)
                self.tasks.pop(ref, None)
                self._refresh_open(ref, before)
                self._block_of.pop(ref, None)
            self.block_open.pop(bref, None)
            self._deferred.pop(bref, None)
            for table in (self._result_at, self._reopened_at, self._decided):
                table.pop(bref, None)
            return
        params = data["params"]
        if not isinstance(params, list) or not all(isinstance(p, dict) for p in params):
            raise TypeError("block params must be a list of objects")
        sizes[bref.first] = len(params)
        if self._fold_on_arrival(bref, params):
            return
        for offset, p in enumerate(params):
            ref = bref.task(offset)
            before = self._raw_state(ref)
            self.tasks[ref] = {"params": p}
            self._block_of[ref] = bref
            self._refresh_open(ref, before)

    def _apply_bclaim(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        bref = BlockRef(parts[0], parts[1], int(parts[2]))
        self._touched.add(bref)
        if bref in self.folded:
            if data is None:
                return  # nothing of it is shown running
            self.unfold(bref)
        key = (bref.workflow, bref.experiment)
        old = self.block_claims.pop(bref, None)
        node = None if data is None else str(data["node"])
        if (old is None) != (node is None):
            self._count(self.block_claim_counts, key, -1 if node is None else 1)
        if old is not None and old.node != node:
            self._count(self.node_blocks, old.node, -1)
        if node is not None and (old is None or old.node != node):
            self._count(self.node_blocks, node, 1)
        if node is not None:
            self.block_claims[bref] = Claim(
                node=node,
                attempt=0,
                slot=None,
                lease=int(data.get("lease", 0)),
                started_at=float(data.get("started_at", 0.0)),
                revision=crev,
            )
        if bref in self._deferred:
            return  # its tasks' claims are worked out when its batches are applied
        self._refresh_block_claims(bref)

    def _refresh_block_claims(self, bref: BlockRef) -> None:
        """Show the block's running attempts as claims of its holder (or of no one)."""
        holder = self.block_claims.get(bref)
        for index in list(self._block_indices.get(bref, ())):
            ref = TaskRef(bref.workflow, bref.experiment, index)
            if ref in self.results and ref not in self.claims:
                continue  # decided and not shown running: no holder changes that
            self._refresh_block_task(ref, holder, self._raw_state(ref))

    def _apply_bdone(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        bref = BlockRef(parts[0], parts[1], int(parts[2]))
        key = "/".join(parts)
        self._touched.add(bref)
        if bref in self.folded:
            if data is None:  # its workflow is being deleted: the block goes next
                self.folded[bref].dropped.add(key)
                return
            self.unfold(bref)
        if data is None:
            deferred = self._deferred.get(bref, [])
            kept = [entry for entry in deferred if entry[0] != key]
            if len(kept) == len(deferred):
                self._undo_batch(bref, key)
            elif kept:
                self._deferred[bref] = kept  # never applied: nothing to undo
            else:
                del self._deferred[bref]
                self._refresh_block_claims(bref)
            self._recount_decisions(bref)
            return
        results, reopened = decision_rows(data)
        if self.defer_batches:
            self._deferred.setdefault(bref, []).append((key, mrev, data))
        else:
            if bref in self._deferred:
                self.settle(bref)
            self._expand_batch(bref, key, data, mrev)
        self._note_decisions(bref, mrev, results, reopened)

    def _note_decisions(
        self, bref: BlockRef, mrev: int, results: list[int], reopened: list[int]
    ) -> None:
        """Count the block's decided tasks: those whose last result is newer than their
        last reopening (batches may arrive in key order, not revision order)."""
        result_at, reopened_at = self._result_at[bref], self._reopened_at[bref]
        for indices, table in ((reopened, reopened_at), (results, result_at)):
            for index in indices:
                was = result_at.get(index, 0) > reopened_at.get(index, 0)
                if table.get(index, 0) < mrev:
                    table[index] = mrev
                now = result_at.get(index, 0) > reopened_at.get(index, 0)
                self._decided[bref] += now - was

    def block_unfinished(self, bref: BlockRef) -> int:
        """Tasks of the block without a result (deferred batches included)."""
        size = self.blocks.get((bref.workflow, bref.experiment), {}).get(bref.first, 0)
        return size - self._decided[bref]

    def settle(self, bref: BlockRef | None = None) -> None:
        """Apply the deferred batches (of ``bref``, or of every block), so that the
        per-task tables are complete."""
        for b in [bref] if bref is not None else list(self._deferred):
            for key, mrev, data in self._deferred.pop(b, []):
                try:
                    self._expand_batch(b, key, data, mrev)
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    log.warning("ignoring malformed key %s: %s", key, exc)
            self._refresh_block_claims(b)

    def set_defer_batches(self, defer: bool) -> None:
        """Defer batches from now on (a node that does not lead), or apply them as they
        come, after applying those deferred so far (the leader, the CLI)."""
        self.defer_batches = defer
        if not defer:
            self.settle()

    def _undo_batch(self, bref: BlockRef, key: str) -> None:
        """The workflow was deleted: undo what the batch ``key`` recorded."""
        touched: set[TaskRef] = set()
        applied = self._batches.get(bref, {})
        revision, raw = applied.pop(key, (0, {"node": ""}))
        if not applied:
            self._batches.pop(bref, None)
        batch = Batch.from_json(raw)
        for a in batch.attempts:
            ref = TaskRef(bref.workflow, bref.experiment, a.index)
            mine = self.attempts.get(ref, {}).get(a.attempt)
            if mine is not None and mine.revision == revision:
                self.attempts[ref].pop(a.attempt, None)
            touched.add(ref)
        for r in batch.results:
            ref = TaskRef(bref.workflow, bref.experiment, r.index)
            if self._result_revisions.get(ref) == revision:
                before = self._raw_state(ref)
                self.results.pop(ref, None)
                self._result_revisions.pop(ref, None)
                self._refresh_open(ref, before)
                touched.add(ref)
        holder = self.block_claims.get(bref)
        for ref in touched:
            self._refresh_block_task(ref, holder, self._raw_state(ref))

    def _recount_decisions(self, bref: BlockRef) -> None:
        """Count the block's decided tasks again from the batches left (one was deleted)."""
        for table in (self._result_at, self._reopened_at, self._decided):
            table.pop(bref, None)
        left = list(self._batches.get(bref, {}).values())
        left += [(rev, data) for _, rev, data in self._deferred.get(bref, [])]
        for rev, data in left:
            self._note_decisions(bref, rev, *decision_rows(data))

    def _expand_batch(self, bref: BlockRef, key: str, data: dict[str, Any], mrev: int) -> None:
        """Apply one batch to the per-task tables."""
        # Rows straight from the value (the layouts of blocks.AttemptEntry/ResultEntry,
        # without their objects: every agent applies every batch), all checked before
        # any is applied, so a malformed value changes nothing.
        writer = str(data["node"])
        attempt_rows = [
            (int(index), int(n), str(state), exit_code, reason, started_at, ended_at,
             str(node[0]) if node else writer)
            for index, n, state, exit_code, reason, started_at, ended_at, *node in data.get("a", ())
        ]
        result_rows = [
            (int(index), str(state), int(n), exit_code, float(ended_at))
            for index, state, n, exit_code, ended_at in data.get("r", ())
        ]
        reopened_rows = [(int(index), int(since)) for index, since in data.get("o", ())]
        self._batches[bref][key] = (mrev, data)
        wid, exp = bref.workflow, bref.experiment
        # Each task's raw state before the batch, to count its change once at the end.
        prior: dict[TaskRef, str | None] = {}
        raw_state = self._raw_state
        indices = self._block_indices[bref]
        for index, n, state, exit_code, reason, started_at, ended_at, node in attempt_rows:
            ref = TaskRef(wid, exp, index)
            if ref not in prior:
                prior[ref] = raw_state(ref)
            known_attempts = self.attempts[ref]
            known = known_attempts.get(n)
            if known is None or known.revision <= mrev:
                known_attempts[n] = Attempt(n, node, state, exit_code, reason, started_at,
                                            ended_at, mrev)
            indices.add(index)
        for index, retry_from in reopened_rows:
            ref = TaskRef(wid, exp, index)
            if self._reopened.get(ref, (0, 0))[0] < mrev:
                self._reopened[ref] = (mrev, retry_from)
            if self._result_revisions.get(ref, mrev) < mrev:
                if ref not in prior:
                    prior[ref] = raw_state(ref)
                self.results.pop(ref, None)
                self._result_revisions.pop(ref, None)
        reopened = self._reopened
        for index, state, n, exit_code, ended_at in result_rows:
            ref = TaskRef(wid, exp, index)
            self._block_of.setdefault(ref, bref)
            if reopened and reopened.get(ref, (0, 0))[0] > mrev:
                continue  # reopened by a later retry
            if ref not in prior:
                prior[ref] = raw_state(ref)
            self.results[ref] = Result(state, n, exit_code, ended_at)
            self._result_revisions[ref] = mrev
        holder = self.block_claims.get(bref)
        for ref, was in prior.items():  # each task whose attempts or result changed
            self._refresh_block_task(ref, holder, was)

    def _refresh_block_task(self, ref: TaskRef, holder: Claim | None, before: str | None) -> None:
        """Set the block task's claim from ``holder`` and count its change of state
        from ``before``."""
        self._set_block_claim(ref, holder)
        self._refresh_open(ref, before)

    def _set_block_claim(self, ref: TaskRef, holder: Claim | None) -> None:
        """A block task runs while its newest attempt is running on the block's holder
        (``holder``): then it has a claim in ``claims``, else none. Counts are left to
        the caller (``_refresh_open``)."""
        attempts = self.attempts.get(ref)
        latest = attempts[max(attempts)] if attempts else None
        if latest is not None and latest.state == "running" and holder is not None and (
            holder.node == latest.node and ref not in self.results
        ):
            self._set_claim(ref, Claim(latest.node, latest.attempt, None, holder.lease,
                                       latest.started_at or holder.started_at,
                                       holder.revision))
        else:
            self._set_claim(ref, None)

    # ------------------------------------------------------------------ folding
    def fold_settled(self) -> None:
        """Fold the oldest settled blocks while more than ``fold_after`` tasks of settled
        blocks are unfolded. The owner calls it after applying a batch of changes."""
        touched, self._touched = self._touched, set()
        if self.fold_after is None:
            return
        for bref in touched:
            size = self.blocks.get((bref.workflow, bref.experiment), {}).get(bref.first)
            settled = (
                size is not None and bref not in self.folded and bref not in self.block_claims
                and self._decided[bref] >= size and self._foldable(bref)
            )
            if settled and bref not in self._settled:
                assert size is not None
                self._settled[bref] = size
                self._settled_tasks += size
            elif not settled and bref in self._settled:
                self._settled_tasks -= self._settled.pop(bref)
        while self._settled_tasks > self.fold_after:
            bref, size = next(iter(self._settled.items()))
            del self._settled[bref]
            self._settled_tasks -= size
            self._fold(bref, size)

    def _fold_on_arrival(self, bref: BlockRef, params: list[dict[str, Any]]) -> bool:
        """Fold a block as it arrives, without making its per-task records, when it is
        settled already and would be folded at once: a deferring view reading a large
        namespace, its batches before its blocks (``hypermesh status``)."""
        if (
            self.fold_after is None or not self.defer_batches or bref in self._thawing
            or bref in self.block_claims or bref in self._batches
            or self._decided[bref] < len(params) or not self._foldable(bref)
        ):
            return False
        if self._settled_tasks < self.fold_after:  # kept whole: the most recent settled
            if bref not in self._settled:
                self._settled[bref] = len(params)
                self._settled_tasks += len(params)
            return False
        key = (bref.workflow, bref.experiment)
        batches = self._deferred.pop(bref, [])
        final = decided_states(batches)
        states = Counter(final.get(bref.first + offset, "open") for offset in range(len(params)))
        self.counts[key].update(states)
        for table in (self._result_at, self._reopened_at):
            table.pop(bref, None)
        self.folded[bref] = FoldedBlock(len(params), states, attempt_tally(batches),
                                        pack(params, batches))
        return True

    def _foldable(self, bref: BlockRef) -> bool:
        """Blocks of an experiment ranked by a metric (``objective``) are never folded:
        ``best`` reads every task's results."""
        wf = self.workflows.get(bref.workflow)
        try:
            return wf is not None and wf.recipe.experiment(bref.experiment).objective is None
        except (KeyError, ValueError, HypermeshError):
            return False

    def _fold(self, bref: BlockRef, size: int) -> None:
        """Replace a settled block's per-task records by a ``FoldedBlock``; the counts
        per state stay as its results say (a deferring view learns them here)."""
        key = (bref.workflow, bref.experiment)
        batches = [(k, rev, data) for k, (rev, data) in self._batches.pop(bref, {}).items()]
        batches += self._deferred.pop(bref, [])
        final = decided_states(batches)
        counts, indices = self.counts[key], self.open.get(key, set())
        params: list[dict[str, Any]] = []
        states: Counter[str] = Counter()
        for offset in range(size):
            ref = bref.task(offset)
            params.append(self.tasks.get(ref, {}).get("params", {}))
            before = self._raw_state(ref)
            after = final.get(ref.index, before)
            if before is not None:
                counts[before] -= 1
            if after is not None:
                counts[after] += 1
                states[after] += 1
            indices.discard(ref.index)
            for table in (self.tasks, self.results, self.attempts, self.claims, self._block_of,
                          self._result_revisions, self._reopened):
                table.pop(ref, None)  # type: ignore[attr-defined]
        for per_block in (self._block_indices, self._result_at, self._reopened_at,
                          self.block_open):
            per_block.pop(bref, None)  # type: ignore[attr-defined]
        self.folded[bref] = FoldedBlock(size, states, attempt_tally(batches),
                                        pack(params, batches))

    def unfold(self, bref: BlockRef) -> None:
        """Bring a folded block's per-task records back: its keys are applied again from
        the packed copy, as they first arrived (a change to it is about to be)."""
        folded = self.folded.pop(bref)
        self.counts[(bref.workflow, bref.experiment)].subtract(folded.states)
        for table in (self._result_at, self._reopened_at, self._decided):
            table.pop(bref, None)  # type: ignore[attr-defined]
        params, batches = unpack(folded.packed)
        self._thawing.add(bref)  # not to be folded again on the way
        try:
            self._apply_block(list(bref.path.split("/")), {"params": params}, 0, 0)
            for key, mrev, data in sorted(batches, key=lambda batch: batch[1]):
                if key not in folded.dropped:
                    self._apply_bdone(key.split("/"), data, 0, mrev)
        finally:
            self._thawing.discard(bref)

    def _drop_folded(self, bref: BlockRef) -> None:
        """A folded block was deleted (its workflow is): forget it and its counts."""
        key = (bref.workflow, bref.experiment)
        self.counts[key].subtract(self.folded.pop(bref).states)
        self.blocks[key].pop(bref.first, None)
        self._firsts.pop(key, None)
        self._decided.pop(bref, None)

    def folded_attempts(self) -> Counter[AttemptKey]:
        """The attempts of every folded block, counted as the metrics count them."""
        total: Counter[AttemptKey] = Counter()
        for folded in self.folded.values():
            total.update(folded.attempts)
        return total

    def batched(self, wid: str, experiment: str) -> bool:
        """Whether the experiment's tasks were written in blocks."""
        return bool(self.blocks.get((wid, experiment)))

    def open_task_by_task(self) -> bool:
        """Whether any experiment has open tasks that are claimed one by one (not in
        blocks): when none has, a node with free slots has no per-task claim to try."""
        return any(indices and not self.blocks.get(key) for key, indices in self.open.items())

    def block_firsts(self, wid: str, experiment: str) -> list[int]:
        """The first indices of the experiment's blocks, in order."""
        key = (wid, experiment)
        firsts = self._firsts.get(key)
        if firsts is None:
            firsts = self._firsts[key] = sorted(self.blocks.get(key, ()))
        return firsts

    def open_blocks(
        self, wid: str, experiment: str, cursors: dict[tuple[str, str], int] | None = None
    ) -> Iterator[BlockRef]:
        """The experiment's blocks with a task without a result, in order. ``cursors``
        (per experiment, the position of its first block not finished; the caller keeps
        it between calls, and clears it now and then for blocks a retry reopened) skips
        the finished blocks an earlier call passed, and moves past those at the start."""
        key = (wid, experiment)
        firsts = self.block_firsts(wid, experiment)
        finished_so_far = True
        for i in range(cursors.get(key, 0) if cursors is not None else 0, len(firsts)):
            bref = BlockRef(wid, experiment, firsts[i])
            if self.block_unfinished(bref) > 0:
                finished_so_far = False
                yield bref
            elif finished_so_far and cursors is not None:
                cursors[key] = i + 1

    def block_of(self, ref: TaskRef) -> BlockRef | None:
        return self._block_of.get(ref)

    def _apply_metrics(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        ref, n = self._ref(parts), int(parts[3])
        if data is None:
            self.metrics[ref].pop(n, None)
        else:
            self.metrics[ref][n] = AttemptMetrics.from_json(data)

    def _apply_gang(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        self.gangs.apply(self._ref(parts), parts[3:], data, mrev)

    def _apply_slot(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        bucket = self.slots[(parts[0], parts[1])]
        if data is None:
            bucket.discard(int(parts[2]))
        else:
            bucket.add(int(parts[2]))
