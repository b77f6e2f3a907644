"""The leader's round: carry out what ``policy.plan`` decided, and publish progress.

On every wake-up of the scheduling loop after the view changed (or when a progress summary
held back falls due), while this node leads, it expands experiments into tasks (in blocks
when they are large, ``hypermesh.state.blocks``), writes the tasks of samples added live,
creates the next trials of adaptive searches (Optuna runs in a thread), and records
workflows' states; every write is fenced on the workflow's state revision the decision saw
(``agent/leader/policy.py``). Then it publishes the summary of each running workflow that changed
(``progress/<wid>``), at most every ``PROGRESS_S``.

Nothing here must survive a change of leader: the next one recomputes everything from
etcd, and what it does not know of what this one published it publishes again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

from hypermesh.agent.claims.wake_timer import WakeTimer
from hypermesh.agent.leader import policy as leader
from hypermesh.errors import HypermeshError
from hypermesh.recipe.sampling import expand, expand_more, experiment_seed
from hypermesh.state import search
from hypermesh.state.blocks import block_size
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
    from hypermesh.config import AgentConfig
    from hypermesh.recipe.recipe import Experiment
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

    def handed_over(self) -> None:
        """This node took over or handed over leadership: what another leader published
        meanwhile is unknown."""
        self._published.clear()

    def _lead_again(self) -> None:
        self.dirty = True
        self.agent.wake()

    async def lead(self) -> None:
        """One round: carry out ``leader.plan``'s actions, then publish progress."""
        a = self.agent
        view = a.view
        for action in leader.plan(view):
            if isinstance(action, leader.Expand | leader.Extend):
                wf = view.workflows[action.workflow]
                exp = wf.recipe.experiment(action.experiment)
                seed = experiment_seed(wf.seed, exp)
                start = action.start if isinstance(action, leader.Extend) else 0
                count = None
                if is_adaptive(exp):  # only the budget: trials come one by one (Suggest)
                    params: list[dict[str, Any]] = []
                    count = start + (action.count if isinstance(action, leader.Extend)
                                     else view.target_count(wf.id, exp))
                elif isinstance(action, leader.Extend):
                    params = expand_more(exp, seed, action.start, action.count)
                else:
                    params = expand(exp, seed)
                if await expand_experiment(
                    a.etcd, a.ks, wf.id, exp.name, params, action.state_revision, start,
                    count, self._block_size(wf.id, exp, start + len(params)),
                    view.revision,
                ):
                    what = "extended" if start else "expanded"
                    added = len(params) if count is None else count - start
                    a.decide(f"{what} {wf.id}/{exp.name} by {added} tasks")
            elif isinstance(action, leader.Suggest):
                await self._suggest(action)
            else:
                summary = view.workflow_summary(action.workflow) | {"state": action.state}
                if await set_workflow_state(
                    a.etcd,
                    a.ks,
                    action.workflow,
                    action.expected,
                    action.state,
                    action.state_revision,
                    summary,
                ):
                    self._published[action.workflow] = (summary, time.monotonic())
                    a.decide(f"workflow {action.workflow} is {action.state}")
        await self._publish_progress()

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
            summary = view.workflow_summary(wid)
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

    def _block_size(self, wid: str, exp: Experiment, count: int) -> int:
        """Tasks per block of an expansion: the size of the experiment's blocks written
        so far (by this leader or one before it), else one chosen for its size."""
        view = self.agent.view
        written = view.blocks.get((wid, exp.name))
        if written:
            return written[min(written)]
        if any(ref.workflow == wid and ref.experiment == exp.name for ref in view.tasks):
            return 1  # written task by task already
        if view.workers(wid, exp) is not None:
            return 1  # capped live before its expansion (hypermesh scale): slot keys
        mesh_slots = sum(n.slots for n in view.nodes.values())
        return block_size(exp, count, mesh_slots)

    async def _suggest(self, action: leader.Suggest) -> None:
        """Create the next trials of an adaptive search (Optuna runs in a thread)."""
        a = self.agent
        wf = a.view.workflows[action.workflow]
        exp = wf.recipe.experiment(action.experiment)
        seed = experiment_seed(wf.seed, exp)
        trials = search.trials_of(a.view, wf.id, exp)
        for index in action.indices:
            params = await asyncio.to_thread(search.suggest, exp, seed, index, trials)
            ref = TaskRef(wf.id, exp.name, index)
            if not await add_task(a.etcd, a.ks, ref, params, action.state_revision):
                return  # another leader got there first; the watch brings its tasks
            trials.append(search.Trial(index, params, "running"))
            a.decide(f"suggested {ref}: {params}")
