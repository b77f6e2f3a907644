"""leader.plan: expansions and workflow state moves, recomputed from the view alone."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from hypermesh.agent.leader.policy import Expand, SetState, plan
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.keyspace import Keyspace, TaskRef
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
