"""leader.plan: expansions and workflow state moves, recomputed from the view alone."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from hypermesh.agent.leader.policy import (
    BACKLOG_BLOCKS_PER_SLOT,
    BACKLOG_MIN_TASKS,
    Expand,
    Extend,
    SetState,
    backlog,
    block_of,
    plan,
)
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import WorkflowRecord, dumps
from hypermesh.state.view import MeshView

# 'a' and 'b' are roots; 'c' needs both; 'd' needs 'c'. File order is not dependency order.
DIAMOND = """
experiments:
  d:
    command: echo d
    after: c
  a:
    command: echo a {{x}}
    parameters:
      x: {values: [1, 2]}
  c:
    command: echo c
    after: [a, b]
  b:
    command: echo b
"""

SIZES = {"a": 2, "b": 1, "c": 1, "d": 1}


class Feed:
    """Applies puts to a MeshView with increasing revisions, as a watch would."""

    def __init__(self) -> None:
        self.ks = Keyspace("t")
        self.view = MeshView(self.ks)
        self.rev = 0

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.rev += 1
        self.view.apply(key, dumps(value), self.rev, self.rev)

    def workflow(
        self, wid: str, submitted_at: float = 100.0, state: str | None = "pending",
        recipe: str = DIAMOND,
    ) -> None:
        wf = WorkflowRecord(
            id=wid, name=wid, recipe=parse_recipe(textwrap.dedent(recipe)), seed=3,
            submitted_at=submitted_at, workdir="/tmp",
        )
        self.put(self.ks.workflow(wid), wf.to_json())
        if state is not None:
            self.state(wid, state)

    def state(self, wid: str, state: str) -> None:
        self.put(self.ks.workflow_state(wid), {"state": state})

    def expand(self, wid: str, exp: str) -> list[TaskRef]:
        refs = [TaskRef(wid, exp, i) for i in range(SIZES[exp])]
        for ref in refs:
            self.put(self.ks.task(ref), {"params": {}})
        self.put(self.ks.expanded(wid, exp), {"count": len(refs)})
        return refs

    def finish(self, ref: TaskRef, state: str) -> None:
        self.put(self.ks.result(ref), {"state": state, "attempt": 1, "exit_code": 0,
                                       "ended_at": 1.0})

    def claim(self, ref: TaskRef) -> None:
        self.put(self.ks.claim(ref), {"node": "n", "attempt": 1, "slot": None, "lease": 1,
                                      "started_at": 0.0})

    def run(self, wid: str, exp: str, state: str = "succeeded") -> None:
        for ref in self.expand(wid, exp):
            self.finish(ref, state)


def test_a_new_workflow_expands_its_roots_and_starts_running() -> None:
    feed = Feed()
    feed.workflow("w")
    assert plan(feed.view) == [
        Expand("w", "a"), Expand("w", "b"), SetState("w", "pending", "running"),
    ]


def test_a_workflow_without_a_state_key_is_treated_as_pending() -> None:
    feed = Feed()
    feed.workflow("w", state=None)
    assert plan(feed.view) == [
        Expand("w", "a"), Expand("w", "b"), SetState("w", "pending", "running"),
    ]


def test_nothing_to_do_while_roots_run() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a0, _ = feed.expand("w", "a")
    feed.expand("w", "b")
    feed.claim(a0)
    assert plan(feed.view) == []


def test_a_dependent_waits_for_every_dependency() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    feed.run("w", "a")
    (b0,) = feed.expand("w", "b")  # expanded, not started
    assert plan(feed.view) == []
    feed.claim(b0)
    assert plan(feed.view) == []
    feed.finish(b0, "succeeded")
    assert plan(feed.view) == [Expand("w", "c")]


def test_a_dependent_waits_for_every_task_of_a_dependency() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a0, _ = feed.expand("w", "a")
    feed.run("w", "b")
    feed.finish(a0, "succeeded")  # a.1 has not run
    assert plan(feed.view) == []


def test_a_dependent_is_expanded_once_its_dependencies_succeeded() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    feed.run("w", "a")
    feed.run("w", "b")
    assert plan(feed.view) == [Expand("w", "c")]
    feed.run("w", "c")
    assert plan(feed.view) == [Expand("w", "d")]
    feed.expand("w", "d")
    assert plan(feed.view) == []


def test_a_workflow_that_succeeded_everywhere_is_marked_succeeded() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    for exp in ("a", "b", "c", "d"):
        feed.run("w", exp)
    assert plan(feed.view) == [SetState("w", "running", "succeeded")]


def test_a_failed_dependency_never_expands_its_dependents_and_fails_the_workflow() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a0, a1 = feed.expand("w", "a")
    feed.finish(a0, "succeeded")
    feed.finish(a1, "failed")
    feed.run("w", "b")
    actions = plan(feed.view)
    assert actions == [SetState("w", "running", "failed")]
    assert not any(isinstance(x, Expand) for x in actions)


def test_a_failed_dependency_still_running_elsewhere_blocks_without_ending() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a0, a1 = feed.expand("w", "a")
    feed.finish(a0, "failed")
    feed.claim(a1)
    feed.run("w", "b")
    assert plan(feed.view) == []


def test_a_cancelled_task_ends_the_workflow_cancelled() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    feed.run("w", "a")
    feed.run("w", "b", state="cancelled")
    assert plan(feed.view) == [SetState("w", "running", "cancelled")]


def test_failure_wins_over_cancellation() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    feed.run("w", "a", state="failed")
    feed.run("w", "b", state="cancelled")
    assert plan(feed.view) == [SetState("w", "running", "failed")]


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_ended_workflows_get_no_actions(state: str) -> None:
    feed = Feed()
    feed.workflow("w", state=state)
    assert plan(feed.view) == []
    feed.run("w", "a")
    feed.run("w", "b")
    assert plan(feed.view) == []


def test_workflows_are_planned_oldest_first() -> None:
    feed = Feed()
    feed.workflow("young", submitted_at=300.0)
    feed.workflow("old", submitted_at=100.0)
    feed.workflow("middle", submitted_at=200.0, state="running")
    feed.run("middle", "a")
    feed.run("middle", "b")
    assert plan(feed.view) == [
        Expand("old", "a"), Expand("old", "b"), SetState("old", "pending", "running"),
        Expand("middle", "c"),
        Expand("young", "a"), Expand("young", "b"), SetState("young", "pending", "running"),
    ]


def test_a_new_leader_finishes_an_interrupted_start() -> None:
    # The last leader expanded the roots and died before it stored "running": the state in
    # etcd is still "pending" with every root expanded. The module promises that a new leader
    # "picks up exactly where the last one stopped", so it must still move pending -> running.
    feed = Feed()
    feed.workflow("w", state="pending")
    feed.expand("w", "a")
    feed.expand("w", "b")
    assert plan(feed.view) == [SetState("w", "pending", "running")]


def test_plan_is_a_pure_read_of_the_view() -> None:
    feed = Feed()
    feed.workflow("w")
    before = plan(feed.view)
    assert plan(feed.view) == before
    assert feed.view.expanded == {}
    assert feed.view.workflow_state("w") == "pending"


# ---------------------------------------------------------------- a failure stays in its workflow
def test_a_workflow_whose_planning_raises_is_failed_alone() -> None:
    """A recipe that cannot be planned (a range without ``samples`` that got into etcd
    past the loader) fails its own workflow, with the error as the reason; a workflow
    submitted after it is planned as usual."""
    feed = Feed()
    feed.workflow("broken", submitted_at=100.0)
    wf = feed.view.workflows["broken"].to_json()
    wf["recipe"]["experiments"][0]["parameters"] = [
        {"name": "x", "kind": "range", "low": 0.0, "high": 1.0}
    ]
    wf["recipe"]["experiments"][0]["samples"] = None
    feed.put(feed.ks.workflow("broken"), wf)
    feed.workflow("fine", submitted_at=200.0)
    actions = plan(feed.view)
    failed, *rest = actions
    assert isinstance(failed, SetState) and (failed.workflow, failed.state) == ("broken", "failed")
    assert failed.reason is not None and failed.reason.startswith("planning failed: ValueError")
    assert "samples" in failed.reason
    assert rest == [
        Expand("fine", "a"), Expand("fine", "b"), SetState("fine", "pending", "running"),
    ]


def test_a_workflow_record_that_cannot_be_read_is_failed() -> None:
    feed = Feed()
    feed.workflow("fine")
    feed.put(feed.ks.workflow("garbled"), {"id": "garbled", "name": "g", "recipe": {}})
    feed.state("garbled", "pending")
    assert "garbled" not in feed.view.workflows
    (*_, failed) = plan(feed.view)
    assert (failed.workflow, failed.expected, failed.state) == ("garbled", "pending", "failed")
    assert isinstance(failed, SetState) and "cannot be read" in (failed.reason or "")
    feed.state("garbled", "failed")
    assert all(a.workflow == "fine" for a in plan(feed.view))


# ---------------------------------------------------------------- bounded work (issue 22)
LARGE = """
experiments:
  big: {samples: 10000, command: ["true"]}
"""


def test_a_large_experiment_is_written_page_by_page_as_its_backlog_runs_low() -> None:
    """The leader writes a large experiment's first page (``backlog``: whole blocks,
    ``BACKLOG_MIN_TASKS`` on a small mesh), then the next each time the tasks written
    and not finished fall below a page, never past the planned count."""
    feed = Feed()
    feed.workflow("w", recipe=LARGE)
    (expand, _) = plan(feed.view)
    assert isinstance(expand, Expand) and expand.count == BACKLOG_MIN_TASKS
    block = 256  # MAX_BLOCK: 10,000 tasks on a mesh of no slots yet

    def write(start: int, count: int) -> None:
        for first in range(start, start + count, block):
            feed.put(feed.ks.block(BlockRef("w", "big", first)), {"params": [{}] * block})
        feed.put(feed.ks.expanded("w", "big"), {"count": start + count})

    def decide(first: int) -> None:
        feed.put(feed.ks.block_batch(BlockRef("w", "big", first), 1, first), {
            "node": "n", "r": [[i, "succeeded", 1, 0, 1.0] for i in range(first, first + block)],
        })

    write(0, expand.count)
    feed.state("w", "running")
    assert plan(feed.view) == []  # a full page waits
    decide(0)
    assert plan(feed.view) == [Extend("w", "big", 4096, 4096)]
    write(4096, 4096)
    for first in range(256, 8192, block):
        decide(first)
    assert plan(feed.view) == [Extend("w", "big", 8192, 10000 - 8192)]
    summary = feed.view.workflow_summary("w")["experiments"]["big"]
    assert (summary["total"], summary["succeeded"], summary["pending"]) == (10000, 8192, 1808)


def test_a_small_mesh_backlog_grows_with_its_slots() -> None:
    feed = Feed()
    feed.workflow("w", recipe=LARGE.replace("10000", "1000000"))
    for n in range(8):
        feed.put(feed.ks.node(f"n{n}"), {"name": f"n{n}", "address": "x:1", "slots": 4})
    exp = feed.view.workflows["w"].recipe.experiment("big")
    assert block_of(feed.view, "w", exp) == 256
    assert backlog(feed.view, "w", exp) == BACKLOG_BLOCKS_PER_SLOT * 32 * 256
