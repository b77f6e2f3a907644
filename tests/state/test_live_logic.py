"""The pure side of live changes: the view's reading of ``expctl/`` keys and
``retry_from``, the leader's Extend and fencing revisions, claims under a changed
cap or a cancelled experiment, and the seeded parameters of added samples."""

from __future__ import annotations

import textwrap

import pytest

from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.agent.leader.policy import Expand, Extend, SetState, plan
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.recipe.sampling import expand, expand_more
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import ExperimentControl, WorkflowRecord
from tests.claims.test_claims import Feed as ClaimFeed
from tests.claims.test_claims import node, one
from tests.leader.test_leader import Feed as LeaderFeed

CHAIN = """
experiments:
  a:
    command: echo {{lr}}
    parameters: {lr: {range: [0.1, 0.2]}}
    samples: 2
  b: {command: echo b, after: [a]}
"""


def leader_feed() -> LeaderFeed:
    feed = LeaderFeed()
    feed.workflow("w", recipe=CHAIN, state="running")
    return feed


def control(feed: LeaderFeed | ClaimFeed, exp: str, **value: object) -> None:
    feed.put(feed.ks.experiment_control("w", exp), value)


def test_added_samples_are_written_by_the_leader_before_dependents_start() -> None:
    feed = leader_feed()
    refs = [TaskRef("w", "a", i) for i in range(2)]
    for ref in refs:
        feed.put(feed.ks.task(ref), {"params": {}})
        feed.finish(ref, "succeeded")
    feed.put(feed.ks.expanded("w", "a"), {"count": 2})
    assert plan(feed.view) == [Expand("w", "b")]
    control(feed, "a", extra_samples=3)
    actions = plan(feed.view)
    assert actions == [Extend("w", "a", 2, 3)]  # b waits for the new tasks
    summary = feed.view.workflow_summary("w")["experiments"]["a"]
    assert (summary["state"], summary["total"], summary["pending"]) == ("running", 5, 3)
    feed.state("w", "running")  # a live change rewrites the state key
    assert plan(feed.view)[0].state_revision == feed.view.workflow_state_revisions["w"]


def test_the_leader_fences_every_action_on_the_state_revision() -> None:
    feed = leader_feed()
    revision = feed.view.workflow_state_revisions["w"]
    actions = plan(feed.view)
    assert actions == [Expand("w", "a")]
    assert all(a.state_revision == revision for a in actions)
    for exp, count in (("a", 2), ("b", 1)):
        for i in range(count):
            feed.put(feed.ks.task(TaskRef("w", exp, i)), {"params": {}})
            feed.finish(TaskRef("w", exp, i), "succeeded")
        feed.put(feed.ks.expanded("w", exp), {"count": count})
    done = plan(feed.view)
    assert done == [SetState("w", "running", "succeeded")]
    assert done[0].state_revision == revision


def test_a_cancelled_experiment_is_not_expanded_and_cancels_its_dependents() -> None:
    feed = leader_feed()
    control(feed, "a", cancelled=True)
    status = feed.view.workflow_summary("w")["experiments"]
    assert status["a"]["state"] == status["b"]["state"] == "cancelled"
    assert plan(feed.view) == [SetState("w", "running", "cancelled")]


def test_a_cancelled_experiment_stops_pending_tasks_and_claims() -> None:
    feed = ClaimFeed()
    feed.workflow("w", one())
    refs = feed.tasks("w", "e", 4)
    feed.claim(refs[0])
    control(feed, "e", cancelled=True)
    assert choose_claims(feed.view, node(), LocalLoad(), limit=10) == []
    assert [feed.view.task_state(r) for r in refs] == ["running"] + ["cancelled"] * 3
    summary = feed.view.workflow_summary("w")["experiments"]["e"]
    assert (summary["running"], summary["cancelled"], summary["pending"]) == (1, 3, 0)


@pytest.mark.parametrize(
    ("cap", "running", "expected"),
    [(None, 0, 6), (3, 0, 3), (3, 2, 1), (0, 0, 0), (1, 3, 0), (5, 1, 4)],
)
def test_a_changed_cap_counts_every_running_task(
    cap: int | None, running: int, expected: int
) -> None:
    feed = ClaimFeed()
    feed.workflow("w", one("samples: 8\nworkers: 2"))
    refs = feed.tasks("w", "e", 8)
    for ref in refs[:running]:  # started before the cap changed: no slot keys
        feed.claim(ref)
    control(feed, "e", workers=cap)
    plans = choose_claims(feed.view, node(slots=6), LocalLoad(), limit=10)
    assert len(plans) == min(expected, 6)
    assert all((p.slot is None) == (cap is None) for p in plans)


def test_retry_from_restarts_the_count_of_failures() -> None:
    feed = ClaimFeed()
    feed.workflow("w", one())
    ref = feed.tasks("w", "e", 1)[0]
    feed.attempt(ref, 1, "failed", reason="exit")
    feed.attempt(ref, 2, "failed", reason="node-lost")
    feed.attempt(ref, 3, "failed", reason="timeout")
    assert feed.view.counted_failures(ref) == 2
    feed.put(feed.ks.task(ref), {"params": {}, "retry_from": 3})
    assert feed.view.counted_failures(ref) == 0
    feed.attempt(ref, 4, "failed", reason="exit")
    assert feed.view.counted_failures(ref) == 1


def test_control_values_are_checked() -> None:
    assert ExperimentControl.from_json({}).workers_set is False
    assert ExperimentControl.from_json({"workers": None}).workers_set is True
    for bad in (-1, "3", 1.5):
        with pytest.raises(TypeError):
            ExperimentControl.from_json({"workers": bad})


def test_added_samples_are_seeded_and_within_range() -> None:
    wf = WorkflowRecord(id="w", name="w", recipe=parse_recipe(textwrap.dedent(CHAIN)), seed=1,
                        submitted_at=0.0, workdir="/tmp")
    exp = wf.recipe.experiment("a")
    more = expand_more(exp, 7, 2, 5)
    assert more == expand_more(exp, 7, 2, 5)  # any leader writes the same tasks
    assert len(more) == 5 and all(0.1 <= p["lr"] <= 0.2 for p in more)
    assert more != expand_more(exp, 7, 7, 5)  # a second extension draws afresh
    assert more[:2] != expand(exp, 7)
