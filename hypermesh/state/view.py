"""``MeshView``: the mirror of a namespace and the answers derived from it.

Everything that asks about the mesh asks here: who leads, what state a task or an
experiment is in, what ``hypermesh status`` and ``hypermesh tasks`` print, whether an
ended attempt decides its task, why a gang task waits. The agent, the leader and the
CLI all derive states through these methods, so ``hypermesh status`` and the scheduler
never disagree.

The methods here only read: the tables, and who may change them, are
``hypermesh.state.mirror.Mirror``'s. No I/O, no clock, but in ``load_view``, which reads a
whole view from etcd (for the CLI, and for a node that watches only its own part).
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from typing import TYPE_CHECKING, Any

from hypermesh.errors import NotFound
from hypermesh.recipe.recipe import Experiment
from hypermesh.recipe.sampling import planned_count
from hypermesh.state.fit import unmet_needs
from hypermesh.state.folding import FOLD_AFTER_TASKS
from hypermesh.state.gangs import waiting_reason
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.mirror import Mirror
from hypermesh.state.records import (
    COUNTED_REASONS,
    TERMINAL,
    ExperimentControl,
    ExperimentSummary,
    WorkflowRecord,
)

if TYPE_CHECKING:
    from hypermesh.state.etcd import Etcd


class MeshView(Mirror):
    """A mirror of a namespace (``Mirror``, fed by its owner) with the answers derived
    from it. Every method here reads the tables and changes nothing."""

    # ------------------------------------------------------------------ leadership
    def leader(self) -> str | None:
        """The leading node: the live candidate with the lowest create revision."""
        live = [c for c in self.candidates.values() if c[1] in self.nodes]
        return min(live)[1] if live else None

    def vacant_candidacies(self) -> list[str] | None:
        """None while a live node leads. Otherwise leadership is open, and these are the
        candidacy keys (their part under ``elect/``) left by nodes that are gone; a
        node that stands clears them in the same transaction."""
        if self.leader() is not None:
            return None
        return sorted(self.candidates)

    # ------------------------------------------------------------------ workflows and tasks
    def running_on(self, node: str) -> list[TaskRef]:
        return sorted(ref for ref, c in self.claims.items() if c.node == node)

    def workflow_state(self, wid: str) -> str:
        """The stored state; a workflow that is no longer stored (deleted, or its keys
        still being purged: ``hypermesh/state/cleanup.py``) counts as cancelled, so
        nothing of it runs or is claimed."""
        state = self.workflow_states.get(wid)
        if state is None:
            return "pending" if wid in self.workflows else "cancelled"
        return state

    def task_refs(self, wid: str, experiment: str | None = None) -> list[TaskRef]:
        return sorted(
            r
            for r in self.tasks
            if r.workflow == wid and (experiment is None or r.experiment == experiment)
        )

    def no_such_task(self, ref: TaskRef) -> str | None:
        """Why ``ref`` names no task of its workflow, or None when it does (whether or not
        the task was created yet). Reads the workflow record, and the experiment's
        ``expanded`` and live-change records when they are mirrored."""
        wf = self.workflows.get(ref.workflow)
        if wf is None:
            return f"no task {ref}: there is no workflow {ref.workflow!r}"
        names = [e.name for e in wf.recipe.experiments]
        where = f"no task {ref} in workflow {ref.workflow}"
        if ref.experiment not in names:
            return f"{where}: its experiments are {', '.join(names)}"
        exp = wf.recipe.experiment(ref.experiment)
        count = max(self.expanded.get((ref.workflow, ref.experiment)) or 0,
                    self.target_count(ref.workflow, exp))
        if ref.index >= count:
            return f"{where}: experiment {ref.experiment} has tasks 0 to {count - 1}"
        return None

    def control(self, wid: str, experiment: str) -> ExperimentControl:
        """The live changes made to an experiment (none: the recipe as submitted)."""
        return self.controls.get((wid, experiment)) or ExperimentControl()

    def experiment_cancelled(self, wid: str, experiment: str) -> bool:
        return self.control(wid, experiment).cancelled

    def workers(self, wid: str, exp: Experiment) -> int | None:
        """The experiment's ``workers`` cap now: a live change, else the recipe's."""
        control = self.control(wid, exp.name)
        return control.workers if control.workers_set else exp.workers

    def cap_held(self, key: tuple[str, str]) -> int:
        """The blocks of experiment ``key`` (workflow, name) that count against its
        ``workers`` cap now: those holding a slot, or every block held if more (claimed
        before a cap was set live)."""
        return max(len(self.block_slots.get(key, ())), self.block_claim_counts[key])

    def free_block_slots(self, wid: str, exp: Experiment, offered: bool = True) -> list[int]:
        """The slots of the ``workers`` cap of ``exp`` (one-task blocks on a large mesh,
        ``hypermesh.state.blocks.block_size``) that a block of it may claim now: below the
        cap, held by no block (``bcap/``) and, with ``offered``, given to none in the
        leader's offers; no more than the cap has room for above the blocks held now (a
        cap lowered live counts the blocks running above it, or with no slot)."""
        workers = self.workers(wid, exp)
        if workers is None:
            return []
        key = (wid, exp.name)
        taken = self.block_slots.get(key, {})
        assigned = {k for k in self.offered_slots.get(key, {}).values() if k not in taken}
        room = workers - self.cap_held(key) - (len(assigned) if offered else 0)
        if room <= 0:
            return []
        busy = taken.keys() | assigned if offered else taken.keys()
        return list(islice((k for k in range(workers) if k not in busy), room))

    def target_count(self, wid: str, exp: Experiment) -> int:
        """How many tasks the experiment is to have: the recipe's plus those added live."""
        return planned_count(exp) + self.control(wid, exp.name).extra_samples

    def task_state(self, ref: TaskRef) -> str:
        result = self.results.get(ref)
        if result is not None:
            return result.state
        if ref in self.claims:
            return "running"
        if self.workflow_state(ref.workflow) == "cancelled" or self.experiment_cancelled(
            ref.workflow, ref.experiment
        ):
            return "cancelled"
        return "pending"

    def counted_failures(self, ref: TaskRef) -> int:
        """Ended attempts that count against ``retries`` (failed exits and timeouts),
        since the last ``retry`` of the task (``retry_from`` in its key)."""
        reopened = self._reopened.get(ref)
        since = reopened[1] if reopened else int(self.tasks.get(ref, {}).get("retry_from", 0))
        return sum(
            1
            for a in self.attempts.get(ref, {}).values()
            if a.attempt > since and a.state == "failed" and a.reason in COUNTED_REASONS
        )

    def final_state(self, ref: TaskRef, state: str, reason: str, retries: int) -> str | None:
        """The task's result after an attempt ended ``state`` for ``reason``: None while
        it runs again (a lost or preempted node, or a counted failure within
        ``retries``), else ``state``."""
        if state != "failed":
            return state
        if reason not in COUNTED_REASONS:
            return None
        return "failed" if self.counted_failures(ref) + 1 > retries else None

    # ------------------------------------------------------------------ what status and tasks print
    def experiment_summary(self, wf: WorkflowRecord, exp: Experiment) -> ExperimentSummary:
        wstate = self.workflow_state(wf.id)
        stopped = wstate == "cancelled" or self.experiment_cancelled(wf.id, exp.name)
        count = self.expanded.get((wf.id, exp.name))
        if count is None:
            total = self.target_count(wf.id, exp)
            blocked = any(
                self.experiment_summary(wf, wf.recipe.experiment(dep)).state
                in ("failed", "cancelled")
                for dep in exp.after
            )
            if stopped or blocked:
                return ExperimentSummary("cancelled", total, cancelled=total)
            return ExperimentSummary("pending", total, pending=total)
        counts = self.counts.get((wf.id, exp.name), Counter())
        # Tasks count from the moment they are planned, before the leader writes them
        # (it writes a large experiment page by page, and samples added live later):
        # those of a stopped experiment never written count as cancelled.
        count = max(count, self.target_count(wf.id, exp))
        count = max(count, sum(counts.values()))
        summary = ExperimentSummary("pending", count)
        summary.running = counts["running"]
        summary.succeeded = counts["succeeded"]
        summary.failed = counts["failed"]
        summary.cancelled = counts["cancelled"]
        waiting = count - summary.running - summary.succeeded - summary.failed - summary.cancelled
        if stopped:
            summary.cancelled += waiting
        else:
            summary.pending = waiting
        done = summary.succeeded + summary.failed + summary.cancelled
        if done == count:
            summary.state = (
                "failed" if summary.failed else "cancelled" if summary.cancelled else "succeeded"
            )
        elif summary.running or done:
            summary.state = "running"
        return summary

    def workflow_summary(self, wid: str) -> dict[str, Any]:
        """The ``hypermesh status --json`` object of one workflow (with ``reason`` when
        the leader failed it because its planning raised)."""
        wf = self.workflows[wid]
        experiments = {exp.name: self.experiment_summary(wf, exp) for exp in wf.recipe.experiments}
        stored = self.workflow_state(wid)
        state = stored
        if stored not in TERMINAL:
            active = any(s.state == "running" for s in experiments.values())
            state = "running" if active or stored == "running" else "pending"
        return {
            "id": wid,
            "name": wf.name,
            "state": state,
            "submitted_at": wf.submitted_at,
            "experiments": {
                name: s.to_json() | self._waiting(wf, name, s) for name, s in experiments.items()
            },
        } | self.failure_reason(wid)

    def failure_reason(self, wid: str) -> dict[str, str]:
        """``{"reason": why}`` when the leader failed the workflow itself (its planning
        raised, ``agent/leader/policy.py``); empty otherwise."""
        reason = self.workflow_reasons.get(wid)
        return {} if reason is None else {"reason": reason}

    def _waiting(self, wf: WorkflowRecord, name: str, s: ExperimentSummary) -> dict[str, str]:
        """``{"waiting": why}`` for an experiment with pending tasks that no live node may
        run, or a gang experiment whose oldest pending task waits."""
        exp = wf.recipe.experiment(name)
        unmet = unmet_needs(exp, self.nodes.values()) if s.pending else None
        if unmet is not None:
            return {"waiting": unmet}
        pulling = self.pulling_reason(wf.id, name) if s.pending else None
        if pulling is not None:
            return {"waiting": pulling}
        if exp.nodes <= 1 or (wf.id, name) not in self.expanded:
            return {}
        for index in sorted(self.open.get((wf.id, name), ())):
            reason = waiting_reason(TaskRef(wf.id, name, index), exp, self.gangs, self.nodes,
                                    self.claims, self.results)
            if reason is not None:
                return {"waiting": reason}
        return {}

    def derived_final_state(self, wid: str) -> str | None:
        """The terminal state the workflow has reached, or None while work remains."""
        wf = self.workflows[wid]
        states = [self.experiment_summary(wf, e).state for e in wf.recipe.experiments]
        if any(s not in TERMINAL for s in states):
            return None
        if "failed" in states:
            return "failed"
        if "cancelled" in states:
            return "cancelled"
        return "succeeded"

    def task_json(self, ref: TaskRef) -> dict[str, Any]:
        """One entry of ``hypermesh tasks --json``."""
        attempts = [a.to_json() for _, a in sorted(self.attempts.get(ref, {}).items())]
        reported = self.metrics.get(ref, {})
        for a in attempts:
            m = reported.get(a["attempt"])
            a["metrics"] = dict(m.last) if m else {}
            a["intermediate"] = {k: [list(p) for p in v] for k, v in m.history.items()} if m else {}
        claim = self.claims.get(ref)
        node = claim.node if claim else (attempts[-1]["node"] if attempts else None)
        return {
            "id": ref.id,
            "experiment": ref.experiment,
            "index": ref.index,
            "params": self.tasks.get(ref, {}).get("params", {}),
            "state": self.task_state(ref),
            "node": node,
            "attempts": attempts,
            "metrics": self.task_metrics(ref),
            "pruned": self.pruned(ref),
        } | self._task_waiting(ref)

    def task_rows(self, wid: str, experiment: str | None = None) -> list[dict[str, Any]]:
        """``hypermesh tasks --json``: every task of the workflow (or of one experiment), in
        id order, with the tasks ``status`` counts as cancelled that were never written (an
        experiment cancelled, or stopped by a failed dependency, before its tasks were
        created): those have no parameters and no attempts. Tasks of folded blocks are
        left out (as they always were), and not taken for unwritten ones."""
        rows = [self.task_json(ref) for ref in self.task_refs(wid, experiment)]
        wf = self.workflows[wid]
        unwritten: list[dict[str, Any]] = []
        for exp in wf.recipe.experiments:
            if experiment is not None and exp.name != experiment:
                continue
            listed = [r for r in rows if r["experiment"] == exp.name]
            folded = [(b.first, f) for b, f in self.folded.items()
                      if (b.workflow, b.experiment) == (wid, exp.name)]
            missing = self.experiment_summary(wf, exp).cancelled - sum(
                r["state"] == "cancelled" for r in listed
            ) - sum(f.states["cancelled"] for _, f in folded)
            written = {r["index"] for r in listed}
            written.update(i for first, f in folded for i in range(first, first + f.size))
            free = (i for i in range(len(written) + missing) if i not in written)
            for index in islice(free, max(0, missing)):
                unwritten.append(
                    {"id": TaskRef(wid, exp.name, index).id, "experiment": exp.name,
                     "index": index, "params": {}, "state": "cancelled", "node": None,
                     "attempts": [], "metrics": {}, "pruned": False}
                )
        if not unwritten:
            return rows
        return sorted(rows + unwritten, key=lambda r: (r["experiment"], r["index"]))

    def _task_waiting(self, ref: TaskRef) -> dict[str, str]:
        wf = self.workflows.get(ref.workflow)
        if wf is None or self.task_state(ref) != "pending":
            return {}
        exp = wf.recipe.experiment(ref.experiment)
        reason = (unmet_needs(exp, self.nodes.values())
                  or self.pulling_reason(ref.workflow, ref.experiment)
                  or waiting_reason(ref, exp, self.gangs, self.nodes, self.claims, self.results))
        return {} if reason is None else {"waiting": reason}

    def pulling_reason(self, wid: str, name: str) -> str | None:
        """``pulling image REF on NODE, ...`` while nodes pull the experiment's image
        before they claim its tasks (``NodeRecord.pulling``); None when none does."""
        key = f"{wid}/{name}"
        by_image: dict[str, list[str]] = {}
        for node, rec in sorted(self.nodes.items()):
            image = rec.pulling.get(key) if rec.pulling else None
            if image is not None:
                by_image.setdefault(image, []).append(node)
        if not by_image:
            return None
        return "; ".join(f"pulling image {image} on {', '.join(nodes)}"
                         for image, nodes in sorted(by_image.items()))

    def task_metrics(self, ref: TaskRef) -> dict[str, float]:
        """Last metric values of the attempt that decided the task (or the newest that
        reported any): what ``best`` and the search rank it by."""
        reported = self.metrics.get(ref, {})
        result = self.results.get(ref)
        if result is not None and result.attempt in reported:
            return dict(reported[result.attempt].last)
        for n in sorted(reported, reverse=True):
            if reported[n].last:
                return dict(reported[n].last)
        return {}

    def pruned(self, ref: TaskRef) -> bool:
        result = self.results.get(ref)
        attempt = self.attempts.get(ref, {}).get(result.attempt) if result else None
        return attempt is not None and attempt.reason == "pruned"


BLOCKS_PER_READ = 64
"""Blocks ``load_view`` reads at a time, each time with their batches: what it holds of
a large workflow before folding it (64 blocks: at most 16,384 tasks)."""


async def load_view(
    etcd: Etcd, ks: Keyspace, wid: str | None = None, *, fold: bool = False
) -> MeshView:
    """A view of the whole namespace, or of one workflow (raises NotFound), read in pages
    at one revision.

    With ``fold`` (``status``), settled blocks past ``FOLD_AFTER_TASKS`` are kept as
    counts (``hypermesh/state/folding.py``): enough for every summary, in memory
    bounded whatever the workflow's size. For that, blocks are read a page at a time,
    each page after the batches of its blocks (``bdone`` keys sort as ``block`` keys
    do), so that a settled block folds as it arrives, without per-task records."""
    view = MeshView(ks)
    if fold:
        view.fold_after = FOLD_AFTER_TASKS
        view.defer_batches = True  # a batch waits for its block, then folds with it
    blocks, batches = ks.kind_prefix("block", wid), ks.kind_prefix("bdone", wid)
    done: tuple[str, ...] = (blocks, batches)  # read first, skipped in the rest
    if wid is None:
        done += (ks.kind_prefix("wf"),)  # what folding needs to know of an experiment
        rest = [ks.kind_prefix("wf"), ks.root]
    else:
        for key in (ks.workflow(wid), ks.workflow_state(wid)):
            found = await etcd.get(key)
            if found is not None:
                view.apply(key, found[0], 0, found[1])
        if wid not in view.workflows:
            raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
        rest = [p for p in ks.workflow_prefixes(wid) if p.endswith("/") and p not in done]
        rest.append(ks.nodes)  # how many nodes could run a waiting gang

    def apply(kvs: list[Any], skip: tuple[str, ...] = ()) -> None:
        for kv in kvs:
            key = kv.key.decode()
            if not (skip and key.startswith(skip)):
                view.apply(key, kv.value, kv.create_revision, kv.mod_revision)
        view.fold_settled()

    at = 0  # every range read at the revision of the first page
    if wid is None:  # workflows first
        async for kvs, read_at in etcd.pages(rest.pop(0), at):
            at = read_at
            apply(kvs)
    cursor = batches
    async for kvs, read_at in etcd.pages(blocks, at, most=BLOCKS_PER_READ):
        at = read_at
        if kvs:  # first the batches of these blocks: up to the last one's, "S/..." < "S0"
            upto = batches + kvs[-1].key.decode()[len(blocks):] + "0"
            async for more, _ in etcd.pages(batches, at, start=cursor, end=upto):
                apply(more)
            cursor = upto
        apply(kvs)  # a settled block folds as it arrives, its batches in hand
    async for more, _ in etcd.pages(batches, at, start=cursor):  # batches of no block
        apply(more)
    for prefix in rest:  # page by page, each applied and dropped
        async for kvs, _ in etcd.pages(prefix, at):
            apply(kvs, done)
    view.set_defer_batches(False)
    return view
