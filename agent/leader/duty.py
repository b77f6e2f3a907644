"""The leader's round: carry out what ``policy.plan`` decided, and publish progress.

On every wake-up of the scheduling loop after the view changed (or when a progress summary
held back falls due), while this node leads, it expands experiments into tasks (in blocks
when they are large, ``hypermesh.state.blocks``), writes the tasks of samples added live,
creates the next trials of adaptive searches (Optuna runs in a thread), and records
workflows' states; every write is fenced on the workflow's state revision the decision saw
(``agent/leader/policy.py``). Then it publishes the summary of each running workflow that changed
(``progress/<wid>``), at most every ``PROGRESS_S``, and the offers of blocks to nodes that
do not watch them (``agent/leader/offers.py``).

Nothing here must survive a change of leader: the next one recomputes everything from
etcd, and what it does not know of what this one published it publishes again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from itertools import groupby
from typing import TYPE_CHECKING, Any, Protocol

from hypermesh.agent.claims.wake_timer import WakeTimer
from hypermesh.agent.leader import policy as leader
from hypermesh.agent.leader.offers import Offers
from hypermesh.agent.leader.prune_medians import PruneMedians
from hypermesh.errors import HypermeshError, LeaseLost, TransientError
from hypermesh.recipe.sampling import expand_more, experiment_seed
from hypermesh.state import search
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import TERMINAL
from hypermesh.state.search import is_adaptive
from hypermesh.state.txns import (
    add_task,
    expand_experiment,
    publish_progress,
    set_workflow_state,
)

if TYPE_CHECKING:
    from hypermesh.agent.tasks.metrics_watch import PruningMedians
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")

PROGRESS_S = 1.0
"""Least time between two progress summaries of one workflow the leader publishes
(``progress/<wid>``, followed by ``submit --wait`` and ``status --watch``), seconds."""


class LeaderHost(Protocol):
    """What :class:`LeaderDuty` uses of its agent."""

    cfg: AgentConfig
    view: MeshView
    etcd: Etcd
    ks: Keyspace
    pruning_medians: PruningMedians  # the leader publishes what its own checks use

    def decide(self, message: str) -> None: ...

    def wake(self) -> None: ...


class LeaderDuty:
    """The leader's work of one agent, done by the scheduling loop (one round at a time)
    while the agent leads. ``dirty`` says the view changed since the last round: the
    agent sets it on every batch the mirror applies, the scheduling loop clears it when
    it starts a round (and sets it again when the round failed)."""

    def __init__(self, agent: LeaderHost) -> None:
        self.agent = agent
        self.dirty = True
        # The summaries this node published as leader (``progress/``), and when.
        self._published: dict[str, tuple[dict[str, Any] | None, float]] = {}
        self._progress_timer = WakeTimer(self._lead_again)
        self.offers = Offers(agent)  # to nodes that do not watch the blocks (--watch own)
        self._offers_timer = WakeTimer(self._lead_again)  # when a block's keeping ends
        self.offers.wake_at = self._offers_timer.at
        # what a node that sees no metrics prunes by (prunemed/)
        self.prune_medians = PruneMedians(agent, WakeTimer(self._lead_again).at)
        self.studies = search.Studies()  # adaptive searches' Optuna studies, kept

    def handed_over(self) -> None:
        """This node took over or handed over leadership: what another leader published
        meanwhile is unknown."""
        self._published.clear()
        self.offers.handed_over()
        self.prune_medians.handed_over()

    def _lead_again(self) -> None:
        self.dirty = True
        self.agent.wake()

    async def lead(self) -> None:
        """One round: carry out ``leader.plan``'s actions, then publish progress.

        A failure stays in its workflow: when carrying out a workflow's actions raises
        (anything but an unreachable etcd or a lost lease, which end the round), that
        workflow is failed with the error as its reason and the others go on."""
        for wid, actions in groupby(leader.plan(self.agent.view), key=lambda x: x.workflow):
            action: leader.Action | None = None
            try:
                for action in actions:
                    await self._carry_out(action)
            except (TransientError, LeaseLost):
                raise
            except Exception as exc:
                assert action is not None
                reason = leader.failure_reason(_what(action), exc)
                log.warning("%s: workflow %s: %s", self.agent.cfg.name, wid, reason,
                            exc_info=exc)
                await self._fail(wid, action.state_revision, reason)
        await self._publish_progress()
        await self.prune_medians.publish()
        if self.offers.wanted():
            await self.offers.publish()

    async def _carry_out(self, action: leader.Action) -> None:
        a = self.agent
        if action.workflow not in a.view.workflows:
            return  # deleted since the plan (hypermesh/state/cleanup.py): nothing to write
        if isinstance(action, leader.Expand | leader.Extend):
            await self._expand(action)
        elif isinstance(action, leader.Suggest):
            await self._suggest(action)
        elif action.state == "failed" and action.reason is not None:
            await self._fail(action.workflow, action.state_revision, action.reason,
                             action.expected)
        else:
            summary = a.view.workflow_summary(action.workflow) | {"state": action.state}
            if await set_workflow_state(
                a.etcd, a.ks, action.workflow, action.expected, action.state,
                action.state_revision, summary,
            ):
                self._published[action.workflow] = (summary, time.monotonic())
                a.decide(f"workflow {action.workflow} is {action.state}")

    async def _expand(self, action: leader.Expand | leader.Extend) -> None:
        """Write a page of an experiment's tasks: its first (``Expand``) or its next
        (``Extend``). The parameters are drawn in a thread: a page must not hold the
        loop, and drawing a page costs the page alone (``expand_more``)."""
        a = self.agent
        view = a.view
        wf = view.workflows[action.workflow]
        exp = wf.recipe.experiment(action.experiment)
        seed = experiment_seed(wf.seed, exp)
        start = action.start if isinstance(action, leader.Extend) else 0
        count = None
        params: list[dict[str, Any]] = []
        if is_adaptive(exp):  # only the budget: trials come one by one (Suggest)
            count = start + action.count
        else:
            params = await asyncio.to_thread(expand_more, exp, seed, start, action.count)
        if await expand_experiment(
            a.etcd, a.ks, wf.id, exp.name, params, action.state_revision, start,
            count, leader.block_of(view, wf.id, exp), view.revision,
        ):
            what = "extended" if start else "expanded"
            added = len(params) if count is None else count - start
            a.decide(f"{what} {wf.id}/{exp.name} by {added} tasks")

    async def _fail(self, wid: str, state_revision: int | None, reason: str,
                    expected: str | None = None) -> None:
        """Fail workflow ``wid`` with ``reason``, fenced like every decision on the state
        key as the plan saw it (``state_revision``): a workflow changed since is planned
        again at the next round instead."""
        a = self.agent
        expected = expected or a.view.workflow_state(wid)
        if expected in TERMINAL:
            return
        summary = self._summary(wid) | {"state": "failed", "reason": reason}
        if await set_workflow_state(a.etcd, a.ks, wid, expected, "failed", state_revision,
                                    summary, reason):
            self._published[wid] = (summary, time.monotonic())
            a.decide(f"workflow {wid} is failed: {reason}")

    def _summary(self, wid: str) -> dict[str, Any]:
        """The workflow's summary, or the least of one when even that raises (a
        workflow whose recipe cannot be planned, or whose record cannot be read)."""
        view = self.agent.view
        try:
            return view.workflow_summary(wid)
        except Exception:
            wf = view.workflows.get(wid)
            return {"id": wid, "name": wf.name if wf else "", "state": view.workflow_state(wid),
                    "submitted_at": wf.submitted_at if wf else 0.0, "experiments": {}}

    async def _publish_progress(self) -> None:
        """Publish the summary of each running workflow that changed (``progress/``),
        at most every ``PROGRESS_S`` each; a change held back wakes the loop when due."""
        a = self.agent
        view = a.view
        now = time.monotonic()
        due = math.inf
        for wid in list(view.workflows):
            revision = view.workflow_state_revisions.get(wid)
            if revision is None or view.workflow_state(wid) in TERMINAL:
                self._published.pop(wid, None)
                continue
            last, at = self._published.get(wid, (None, -math.inf))
            if now - at < PROGRESS_S:  # not even looked at: at most once a period
                due = min(due, at + PROGRESS_S)
                continue
            summary = self._summary(wid)
            if summary == last:
                continue
            try:
                written = await publish_progress(a.etcd, a.ks, wid, summary, revision)
            except HypermeshError as exc:  # best effort: try again in a period
                log.info("%s: publishing the progress of %s: %s", a.cfg.name, wid, exc)
                self._published[wid] = (last, now)
                due = min(due, now + PROGRESS_S)
                continue
            if written is not None:
                self._published[wid] = (summary, now)
        if due < math.inf:
            self._progress_timer.at(due)

    async def _suggest(self, action: leader.Suggest) -> None:
        """Create the next trials of an adaptive search (Optuna runs in a thread), each
        a one-task block where the experiment runs in blocks (on a large mesh)."""
        a = self.agent
        wf = a.view.workflows[action.workflow]
        exp = wf.recipe.experiment(action.experiment)
        seed = experiment_seed(wf.seed, exp)
        trials = self.studies.trials_of(a.view, wf.id, exp)  # on the loop: reads the view
        block = leader.block_of(a.view, wf.id, exp) is not None
        for index in action.indices:
            params = await asyncio.to_thread(
                self.studies.suggest, (wf.id, exp.name), exp, seed, index, trials)
            ref = TaskRef(wf.id, exp.name, index)
            if not await add_task(a.etcd, a.ks, ref, params, action.state_revision, block):
                return  # another leader got there first; the watch brings its tasks
            trials.append(search.Trial(index, params, "running"))
            a.decide(f"suggested {ref}: {params}")


def _what(action: leader.Action) -> str:
    """What carrying out ``action`` does, for a failure's reason."""
    if isinstance(action, leader.Expand | leader.Extend):
        return f"expanding experiment {action.experiment!r}"
    if isinstance(action, leader.Suggest):
        return f"suggesting trials of experiment {action.experiment!r}"
    return f"recording state {action.state!r}"
