"""MeshView: the mirror of a namespace, fed the key/value events an etcd watch delivers."""

from __future__ import annotations

import random
import textwrap
from typing import Any

import pytest

from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import NodeRecord, WorkflowRecord, dumps
from hypermesh.state.view import MeshView

# prep (3 tasks) -> train (2 tasks) -> report (1 task)
CHAIN = """
experiments:
  prep:
    command: echo prep {{shard}}
    parameters:
      shard: {values: [0, 1, 2]}
  train:
    command: echo train {{lr}}
    after: prep
    parameters:
      lr: {values: [0.1, 0.2]}
  report:
    command: echo report
    after: [train]
"""

SINGLE = """
experiments:
  e:
    command: echo {{x}}
    parameters:
      x: {values: [a, b, c]}
"""


class Feed:
    """Applies puts and deletes to a MeshView with increasing revisions, as a watch would."""

    def __init__(self, namespace: str = "t") -> None:
        self.ks = Keyspace(namespace)
        self.view = MeshView(self.ks)
        self.rev = 0
        self.created: dict[str, int] = {}

    def put(self, key: str, value: dict[str, Any]) -> int:
        self.rev += 1
        create = self.created.setdefault(key, self.rev)
        self.view.apply(key, dumps(value), create, self.rev)
        return self.rev

    def delete(self, key: str) -> int:
        self.rev += 1
        self.created.pop(key, None)
        self.view.apply(key, None, 0, self.rev)
        return self.rev

    def workflow(
        self,
        wid: str,
        recipe: str = CHAIN,
        submitted_at: float = 100.0,
        state: str | None = "pending",
    ) -> WorkflowRecord:
        wf = WorkflowRecord(
            id=wid, name=f"name-{wid}", recipe=parse_recipe(textwrap.dedent(recipe)), seed=7,
            submitted_at=submitted_at, workdir="/tmp",
        )
        self.put(self.ks.workflow(wid), wf.to_json())
        if state is not None:
            self.state(wid, state)
        return wf

    def state(self, wid: str, state: str) -> None:
        self.put(self.ks.workflow_state(wid), {"state": state})

    def expand(self, wid: str, exp: str, count: int) -> list[TaskRef]:
        refs = [TaskRef(wid, exp, i) for i in range(count)]
        for ref in refs:
            self.put(self.ks.task(ref), {"params": {"i": ref.index}})
        self.put(self.ks.expanded(wid, exp), {"count": count})
        return refs

    def claim(self, ref: TaskRef, node: str = "n1", attempt: int = 1) -> int:
        self.attempt(ref, attempt, "running", node=node)
        return self.put(
            self.ks.claim(ref),
            {"node": node, "attempt": attempt, "slot": None, "lease": 9, "started_at": 1.0},
        )

    def attempt(
        self, ref: TaskRef, n: int, state: str, reason: str | None = None, node: str = "n1"
    ) -> int:
        code = None if state == "running" else (0 if state == "succeeded" else 1)
        return self.put(
            self.ks.attempt(ref, n),
            {"attempt": n, "node": node, "state": state, "exit_code": code, "reason": reason},
        )

    def finish(self, ref: TaskRef, state: str, attempt: int = 1) -> None:
        """What finish_attempt writes: the attempt's end, no claim, and the result."""
        self.attempt(ref, attempt, state, reason="exit")
        self.delete(self.ks.claim(ref))
        code = 0 if state == "succeeded" else 1
        self.put(
            self.ks.result(ref), {"state": state, "attempt": attempt, "exit_code": code,
                                  "ended_at": 5.0},
        )

    def node(self, name: str, **fields: Any) -> None:
        self.put(self.ks.node(name), NodeRecord(name, f"{name}:7000", **fields).to_json())


def summary(feed: Feed, wid: str, exp: str) -> dict[str, Any]:
    wf = feed.view.workflows[wid]
    return feed.view.experiment_summary(wf, wf.recipe.experiment(exp)).to_json()


def counts(state: str, total: int, **by_state: int) -> dict[str, Any]:
    row = {"state": state, "total": total, "pending": 0, "running": 0, "succeeded": 0,
           "failed": 0, "cancelled": 0}
    row.update(by_state)
    return row


# ------------------------------------------------------------------ task states


def test_task_state_follows_claim_and_result() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    a, b, c = feed.expand("w", "e", 3)
    view = feed.view
    assert [view.task_state(r) for r in (a, b, c)] == ["pending"] * 3
    feed.claim(a)
    feed.claim(b)
    assert [view.task_state(r) for r in (a, b, c)] == ["running", "running", "pending"]
    feed.finish(a, "succeeded")
    feed.finish(b, "failed")
    assert [view.task_state(r) for r in (a, b, c)] == ["succeeded", "failed", "pending"]


def test_a_lost_claim_makes_a_task_pending_again() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    ref, *_ = feed.expand("w", "e", 3)
    feed.claim(ref)
    feed.delete(feed.ks.claim(ref))  # the node's lease expired
    assert feed.view.task_state(ref) == "pending"


def test_cancelled_workflow_cancels_open_tasks_but_not_finished_or_running_ones() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    done, running, idle = feed.expand("w", "e", 3)
    feed.claim(done)
    feed.finish(done, "succeeded")
    feed.claim(running)
    feed.state("w", "cancelled")
    view = feed.view
    assert view.task_state(done) == "succeeded"
    assert view.task_state(running) == "running"  # until its process is stopped
    assert view.task_state(idle) == "cancelled"
    feed.finish(running, "cancelled")
    assert view.task_state(running) == "cancelled"


def test_a_task_never_expanded_reads_pending_or_cancelled() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    ghost = TaskRef("w", "e", 99)
    assert feed.view.task_state(ghost) == "pending"
    feed.state("w", "cancelled")
    assert feed.view.task_state(ghost) == "cancelled"


# ------------------------------------------------------------------ failures and retries


def test_counted_failures_count_only_exit_and_timeout() -> None:
    feed = Feed()
    ref = TaskRef("w", "e", 0)
    feed.attempt(ref, 1, "failed", "exit")
    feed.attempt(ref, 2, "failed", "node-lost")
    feed.attempt(ref, 3, "failed", "timeout")
    feed.attempt(ref, 4, "failed", "preempted")
    feed.attempt(ref, 5, "cancelled", "cancelled")
    feed.attempt(ref, 6, "failed", "cancelled")
    feed.attempt(ref, 7, "succeeded", "exit")
    feed.attempt(ref, 8, "running")
    assert feed.view.counted_failures(ref) == 2
    assert feed.view.counted_failures(TaskRef("w", "e", 1)) == 0


@pytest.mark.parametrize(
    ("reason", "counted"),
    [("exit", 1), ("timeout", 1), ("node-lost", 0), ("preempted", 0), ("cancelled", 0)],
)
def test_each_reason_counts_or_not(reason: str, counted: int) -> None:
    feed = Feed()
    ref = TaskRef("w", "e", 0)
    feed.attempt(ref, 1, "failed", reason)
    assert feed.view.counted_failures(ref) == counted


def test_a_rewritten_attempt_is_counted_once() -> None:
    feed = Feed()
    ref = TaskRef("w", "e", 0)
    feed.attempt(ref, 1, "running")
    assert feed.view.counted_failures(ref) == 0
    feed.attempt(ref, 1, "failed", "exit")
    feed.attempt(ref, 1, "failed", "exit")
    assert feed.view.counted_failures(ref) == 1


# ------------------------------------------------------------------ experiment summaries


def test_experiments_are_pending_with_their_planned_size_before_expansion() -> None:
    feed = Feed()
    feed.workflow("w")
    assert summary(feed, "w", "prep") == counts("pending", 3, pending=3)
    assert summary(feed, "w", "train") == counts("pending", 2, pending=2)
    assert summary(feed, "w", "report") == counts("pending", 1, pending=1)


def test_expanded_but_unstarted_experiment_is_pending() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    feed.expand("w", "prep", 3)
    assert summary(feed, "w", "prep") == counts("pending", 3, pending=3)


def test_experiment_runs_while_tasks_run_or_some_have_ended() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a, b, _ = feed.expand("w", "prep", 3)
    feed.claim(a)
    assert summary(feed, "w", "prep") == counts("running", 3, pending=2, running=1)
    feed.finish(a, "succeeded")
    # nothing is running right now, but the experiment has started and not ended
    assert summary(feed, "w", "prep") == counts("running", 3, pending=2, succeeded=1)
    feed.claim(b)
    feed.finish(b, "failed")
    assert summary(feed, "w", "prep") == counts("running", 3, pending=1, succeeded=1, failed=1)
    assert summary(feed, "w", "train") == counts("pending", 2, pending=2)


def test_experiment_succeeds_when_every_task_succeeded() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    for ref in feed.expand("w", "prep", 3):
        feed.claim(ref)
        feed.finish(ref, "succeeded")
    assert summary(feed, "w", "prep") == counts("succeeded", 3, succeeded=3)
    assert summary(feed, "w", "train") == counts("pending", 2, pending=2)


def test_a_failed_task_fails_the_experiment_and_cancels_its_dependents() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a, b, c = feed.expand("w", "prep", 3)
    for ref, state in ((a, "succeeded"), (b, "failed"), (c, "cancelled")):
        feed.claim(ref)
        feed.finish(ref, state)
    assert summary(feed, "w", "prep") == counts("failed", 3, succeeded=1, failed=1, cancelled=1)
    # train is blocked by prep, report by train: both are cancelled without being expanded
    assert summary(feed, "w", "train") == counts("cancelled", 2, cancelled=2)
    assert summary(feed, "w", "report") == counts("cancelled", 1, cancelled=1)
    # ... and `tasks` lists them as status counts them: cancelled, never written.
    rows = feed.view.task_rows("w")
    assert [(r["id"], r["state"]) for r in rows] == [
        ("w.prep.0", "succeeded"), ("w.prep.1", "failed"), ("w.prep.2", "cancelled"),
        ("w.report.0", "cancelled"), ("w.train.0", "cancelled"), ("w.train.1", "cancelled"),
    ]
    assert rows[5] == {
        "id": "w.train.1", "experiment": "train", "index": 1, "params": {},
        "state": "cancelled", "node": None, "attempts": [], "metrics": {}, "pruned": False}
    assert [r["id"] for r in feed.view.task_rows("w", "train")] == ["w.train.0", "w.train.1"]
    # A cancelled workflow whose experiment was expanded in part: the rest is listed too.
    feed.workflow("v", SINGLE, state="running")
    feed.put(feed.ks.task(TaskRef("v", "e", 1)), {"params": {"x": "b"}})
    feed.state("v", "cancelled")
    assert [(r["index"], r["params"]) for r in feed.view.task_rows("v")] == [
        (0, {}), (1, {"x": "b"}), (2, {})]


def test_a_cancelled_task_without_failures_cancels_the_experiment() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    a, b, c = feed.expand("w", "e", 3)
    for ref, state in ((a, "succeeded"), (b, "cancelled"), (c, "succeeded")):
        feed.claim(ref)
        feed.finish(ref, state)
    assert summary(feed, "w", "e") == counts("cancelled", 3, succeeded=2, cancelled=1)


def test_a_cancelled_workflow_cancels_unexpanded_and_idle_experiments() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a, _, _ = feed.expand("w", "prep", 3)
    feed.claim(a)
    feed.finish(a, "succeeded")
    feed.state("w", "cancelled")
    assert summary(feed, "w", "prep") == counts("cancelled", 3, succeeded=1, cancelled=2)
    assert summary(feed, "w", "train") == counts("cancelled", 2, cancelled=2)
    assert summary(feed, "w", "report") == counts("cancelled", 1, cancelled=1)


def test_a_cancelled_workflow_still_shows_a_task_that_has_not_stopped_yet() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    a, _, _ = feed.expand("w", "e", 3)
    feed.claim(a)
    feed.state("w", "cancelled")
    assert summary(feed, "w", "e") == counts("running", 3, running=1, cancelled=2)


# ------------------------------------------------------------------ workflow summaries


def test_workflow_summary_has_exactly_the_status_json_shape() -> None:
    feed = Feed()
    feed.workflow("w", submitted_at=1234.5, state="running")
    feed.node("n1")  # a node that may run every experiment: nothing waits for hardware
    a, _, _ = feed.expand("w", "prep", 3)
    feed.claim(a)
    assert feed.view.workflow_summary("w") == {
        "id": "w",
        "name": "name-w",
        "state": "running",
        "submitted_at": 1234.5,
        "experiments": {
            "prep": counts("running", 3, pending=2, running=1),
            "train": counts("pending", 2, pending=2),
            "report": counts("pending", 1, pending=1),
        },
    }


def test_workflow_summary_keeps_recipe_order_of_experiments() -> None:
    feed = Feed()
    feed.workflow("w")
    assert list(feed.view.workflow_summary("w")["experiments"]) == ["prep", "train", "report"]


def test_workflow_summary_state_is_derived_until_it_is_stored_terminal() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="pending")
    assert feed.view.workflow_summary("w")["state"] == "pending"
    a, _, _ = feed.expand("w", "e", 3)
    feed.claim(a)  # the leader has not stored "running" yet: the summary says so anyway
    assert feed.view.workflow_summary("w")["state"] == "running"
    feed.state("w", "running")
    feed.finish(a, "succeeded")
    assert feed.view.workflow_summary("w")["state"] == "running"
    feed.state("w", "failed")
    assert feed.view.workflow_summary("w")["state"] == "failed"


def test_workflow_without_a_state_key_is_pending() -> None:
    feed = Feed()
    feed.workflow("w", state=None)
    assert feed.view.workflow_state("w") == "pending"
    assert feed.view.workflow_summary("w")["state"] == "pending"


def test_workflow_summary_of_an_unknown_workflow_raises() -> None:
    with pytest.raises(KeyError):
        Feed().view.workflow_summary("nope")


# ------------------------------------------------------------------ final state


def _run_all(feed: Feed, wid: str, exp: str, count: int, state: str = "succeeded") -> None:
    for ref in feed.expand(wid, exp, count):
        feed.claim(ref)
        feed.finish(ref, state)


def test_derived_final_state_is_none_while_work_remains() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    assert feed.view.derived_final_state("w") is None
    _run_all(feed, "w", "prep", 3)
    _run_all(feed, "w", "train", 2)
    assert feed.view.derived_final_state("w") is None  # report is not expanded yet
    _run_all(feed, "w", "report", 1)
    assert feed.view.derived_final_state("w") == "succeeded"


def test_derived_final_state_failed_when_a_dependency_failed() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    _run_all(feed, "w", "prep", 3, "failed")
    assert feed.view.derived_final_state("w") == "failed"


def test_derived_final_state_failed_wins_over_cancelled() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    a, b, c = feed.expand("w", "prep", 3)
    for ref, state in ((a, "cancelled"), (b, "failed"), (c, "succeeded")):
        feed.claim(ref)
        feed.finish(ref, state)
    assert feed.view.derived_final_state("w") == "failed"


def test_derived_final_state_cancelled_for_a_cancelled_workflow() -> None:
    feed = Feed()
    feed.workflow("w", state="running")
    _run_all(feed, "w", "prep", 3)
    feed.state("w", "cancelled")
    assert feed.view.derived_final_state("w") == "cancelled"


def test_derived_final_state_waits_for_a_running_task_of_a_cancelled_workflow() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    a, _, _ = feed.expand("w", "e", 3)
    feed.claim(a)
    feed.state("w", "cancelled")
    assert feed.view.derived_final_state("w") is None
    feed.finish(a, "cancelled")
    assert feed.view.derived_final_state("w") == "cancelled"


# ------------------------------------------------------------------ leader


def test_leader_is_the_registered_candidate_with_the_lowest_create_revision() -> None:
    feed = Feed()
    view = feed.view
    assert view.leader() is None
    feed.node("n2")
    feed.node("n3")
    view.apply(feed.ks.candidate(0x30), dumps({"node": "n3"}), 30, 30)
    view.apply(feed.ks.candidate(0x20), dumps({"node": "n2"}), 20, 20)
    # n1 campaigned first but is not registered (its node key is gone)
    view.apply(feed.ks.candidate(0x10), dumps({"node": "n1"}), 10, 10)
    assert view.leader() == "n2"
    feed.node("n1")
    assert view.leader() == "n1"
    feed.delete(feed.ks.candidate(0x10))
    assert view.leader() == "n2"
    feed.delete(feed.ks.node("n2"))
    assert view.leader() == "n3"
    feed.delete(feed.ks.node("n3"))
    assert view.leader() is None


def test_leadership_is_vacant_while_no_registered_node_stands() -> None:
    feed = Feed()
    view = feed.view
    assert view.vacant_candidacies() == []  # nobody stood yet
    feed.node("n1")
    feed.node("n2")
    view.apply(feed.ks.candidate(0x10), dumps({"node": "n1"}), 10, 10)
    assert view.vacant_candidacies() is None  # n1 leads
    feed.delete(feed.ks.node("n1"))
    # n1's node is gone while its candidacy's lease still runs: the next one to
    # stand clears the key
    assert view.vacant_candidacies() == [f"{0x10:016x}"]
    view.apply(feed.ks.candidate(0x20), dumps({"node": "n2"}), 20, 20)
    assert view.vacant_candidacies() is None and view.leader() == "n2"


def test_leader_ignores_a_later_modification_of_a_candidate_key() -> None:
    feed = Feed()
    feed.node("a")
    feed.node("b")
    feed.view.apply(feed.ks.candidate(1), dumps({"node": "a"}), 5, 5)
    feed.view.apply(feed.ks.candidate(2), dumps({"node": "b"}), 6, 6)
    feed.view.apply(feed.ks.candidate(1), dumps({"node": "a"}), 5, 50)  # rewritten later
    assert feed.view.leader() == "a"


def test_nodes_register_and_deregister() -> None:
    feed = Feed()
    feed.node("gpu1", gpus=4, gpu_type="Tesla K80", slots=4, labels={"zone": "a"})
    assert feed.view.nodes["gpu1"] == NodeRecord(
        "gpu1", "gpu1:7000", gpus=4, gpu_type="Tesla K80", slots=4, labels={"zone": "a"}
    )
    feed.delete(feed.ks.node("gpu1"))
    assert feed.view.nodes == {}


# ------------------------------------------------------------------ open index


def test_open_index_tracks_tasks_without_claim_or_result() -> None:
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    a, b, c = feed.expand("w", "e", 3)
    view = feed.view
    assert view.open[("w", "e")] == {0, 1, 2}
    feed.claim(a)
    assert view.open[("w", "e")] == {1, 2}
    feed.delete(feed.ks.claim(a))  # claim lost: claimable again
    assert view.open[("w", "e")] == {0, 1, 2}
    feed.claim(b)
    feed.finish(b, "succeeded")  # result written, claim released: stays closed
    assert view.open[("w", "e")] == {0, 2}
    feed.put(feed.ks.result(c), {"state": "failed", "attempt": 1, "exit_code": 1, "ended_at": 1})
    assert view.open[("w", "e")] == {0}
    feed.delete(feed.ks.task(a))
    assert view.open[("w", "e")] == set()


def test_a_claim_seen_before_its_task_keeps_the_task_closed() -> None:
    feed = Feed()
    ref = TaskRef("w", "e", 4)
    feed.claim(ref)
    assert not feed.view.open.get(("w", "e"))
    feed.put(feed.ks.task(ref), {"params": {}})
    assert not feed.view.open.get(("w", "e"))
    feed.delete(feed.ks.claim(ref))
    assert feed.view.open[("w", "e")] == {4}


def test_claim_and_attempt_records_carry_their_mod_revision() -> None:
    feed = Feed()
    ref = TaskRef("w", "e", 0)
    claim_rev = feed.claim(ref, node="n7", attempt=3)
    claim = feed.view.claims[ref]
    assert (claim.node, claim.attempt, claim.slot, claim.lease, claim.revision) == (
        "n7", 3, None, 9, claim_rev
    )
    attempt_rev = feed.attempt(ref, 3, "failed", "exit", node="n7")
    attempt = feed.view.attempts[ref][3]
    assert (attempt.state, attempt.reason, attempt.exit_code, attempt.revision) == (
        "failed", "exit", 1, attempt_rev
    )
    assert feed.view.running_on("n7") == [ref]
    assert feed.view.running_on("n1") == []


def test_slots_and_expansion_markers_come_and_go() -> None:
    feed = Feed()
    feed.put(feed.ks.slot("w", "e", 0), {"task": "w.e.0"})
    feed.put(feed.ks.slot("w", "e", 3), {"task": "w.e.1"})
    feed.put(feed.ks.expanded("w", "e"), {"count": 12})
    assert feed.view.slots[("w", "e")] == {0, 3}
    assert feed.view.expanded == {("w", "e"): 12}
    feed.delete(feed.ks.slot("w", "e", 0))
    feed.delete(feed.ks.expanded("w", "e"))
    assert feed.view.slots[("w", "e")] == {3}
    assert feed.view.expanded == {}


def test_task_refs_are_sorted_and_filtered() -> None:
    feed = Feed()
    for ref in (TaskRef("w", "b", 10), TaskRef("w", "b", 2), TaskRef("w", "a", 5),
                TaskRef("x", "a", 0)):
        feed.put(feed.ks.task(ref), {"params": {}})
    view = feed.view
    assert view.task_refs("w") == [
        TaskRef("w", "a", 5), TaskRef("w", "b", 2), TaskRef("w", "b", 10),
    ]
    assert view.task_refs("w", "b") == [TaskRef("w", "b", 2), TaskRef("w", "b", 10)]
    assert view.task_refs("nope") == []


# ------------------------------------------------------------------ robustness


def _snapshot(view: MeshView) -> tuple[Any, ...]:
    return (
        view.nodes, view.candidates, view.workflows, view.workflow_states, view.expanded,
        view.tasks, view.claims, {k: v for k, v in view.attempts.items() if v}, view.results,
        {k: v for k, v in view.slots.items() if v}, {k: v for k, v in view.open.items() if v},
    )


REF = TaskRef("w", "e", 0)
KS = Keyspace("t")
MALFORMED_KEYS = {
    "node": KS.node("n1"),
    "elect": KS.candidate(1),
    "wf": KS.workflow("w"),
    "wfstate": KS.workflow_state("w"),
    "expanded": KS.expanded("w", "e"),
    "task": KS.task(REF),
    "claim": KS.claim(REF),
    "attempt": KS.attempt(REF, 1),
    "result": KS.result(REF),
}


@pytest.mark.parametrize("value", [b"{not json", b"[]", b'"text"', b"3", b"\xff\xfe"])
@pytest.mark.parametrize("kind", list(MALFORMED_KEYS))
def test_a_malformed_value_is_ignored(kind: str, value: bytes) -> None:
    view = MeshView(KS)
    view.apply(MALFORMED_KEYS[kind], value, 1, 1)
    assert _snapshot(view) == _snapshot(MeshView(KS))
    assert view.revision == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (KS.node("n1"), {"address": "x"}),  # no name
        (KS.candidate(1), {"name": "n1"}),  # no node
        (KS.workflow_state("w"), {"status": "running"}),
        (KS.expanded("w", "e"), {"count": "many"}),
        (KS.claim(REF), {"attempt": 1}),  # no node
        (KS.result(REF), {"attempt": 1}),  # no state
        (KS.workflow("w"), {"id": "w", "name": "n", "seed": 1, "submitted_at": 0}),  # no recipe
        (KS.workflow("w"), {"id": "w", "name": "n", "recipe": {}, "seed": 1, "submitted_at": 0}),
        (KS.attempt(REF, 1), {}),  # no attempt number, node or state
        (KS.root + "task/w/e/x", {"params": {}}),  # index not a number
        (KS.root + "task/w/e", {"params": {}}),  # too few parts
        (KS.root + "attempt/w/e/0", {"attempt": 1, "node": "n", "state": "running"}),
        (KS.root + "node", {"name": "n", "address": "a"}),
    ],
)
def test_a_value_missing_fields_or_a_bad_key_is_ignored(key: str, value: dict[str, Any]) -> None:
    view = MeshView(KS)
    view.apply(key, dumps(value), 1, 1)
    assert _snapshot(view) == _snapshot(MeshView(KS))


def test_keys_of_other_namespaces_and_unknown_kinds_are_ignored() -> None:
    view = MeshView(KS)
    view.apply("/hypermesh/other/node/n1", dumps(NodeRecord("n1", "a").to_json()), 1, 3)
    view.apply(KS.root + "telemetry/n1", dumps({"x": 1}), 4, 4)
    view.apply(KS.root + "ref/w/e/0", dumps({"x": 1}), 5, 5)
    assert _snapshot(view) == _snapshot(MeshView(KS))
    assert view.revision == 5


def test_the_mirror_keeps_working_after_a_malformed_value() -> None:
    feed = Feed()
    feed.view.apply(feed.ks.claim(REF), b"{oops", 1, 1)
    feed.workflow("w", SINGLE, state="running")
    feed.expand("w", "e", 3)
    assert feed.view.open[("w", "e")] == {0, 1, 2}


def test_revision_only_moves_forward() -> None:
    view = MeshView(KS)
    view.apply(KS.node("a"), dumps({"name": "a", "address": "x"}), 10, 10)
    view.apply(KS.node("b"), dumps({"name": "b", "address": "x"}), 4, 4)
    assert view.revision == 10


def test_reset_forgets_everything_but_the_namespace() -> None:
    feed = Feed()
    feed.node("n1")
    feed.view.apply(feed.ks.candidate(1), dumps({"node": "n1"}), 2, 2)
    feed.workflow("w", SINGLE, state="running")
    a, _, _ = feed.expand("w", "e", 3)
    feed.claim(a)
    feed.put(feed.ks.slot("w", "e", 0), {"task": a.id})
    feed.finish(a, "failed")
    view = feed.view
    assert view.revision > 0
    view.reset()
    assert view.ks is feed.ks
    assert view.revision == 0
    assert _snapshot(view) == _snapshot(MeshView(feed.ks))
    assert view.leader() is None
    # and it can be fed again from scratch
    feed.workflow("w", SINGLE, state="running")
    feed.expand("w", "e", 3)
    assert view.open[("w", "e")] == {0, 1, 2}
    assert view.task_state(a) == "pending"


# ------------------------------------------------------------------ incremental counts


@pytest.mark.parametrize("seed", range(8))
def test_summaries_match_a_recount_after_any_sequence_of_events(seed: int) -> None:
    """Random claims, results, deletions, duplicate deliveries and cancel toggles: the
    summary the view keeps incrementally equals one recounted from scratch."""
    rng = random.Random(seed)
    feed = Feed()
    feed.workflow("w", SINGLE, state="running")
    refs = feed.expand("w", "e", 3)
    claims: set[int] = set()
    results: dict[int, str] = {}
    cancelled = False
    for _ in range(300):
        ref = rng.choice(refs)
        roll = rng.random()
        if roll < 0.3:
            feed.claim(ref)
            claims.add(ref.index)
        elif roll < 0.5:
            feed.delete(feed.ks.claim(ref))
            claims.discard(ref.index)
        elif roll < 0.7:
            state = rng.choice(["succeeded", "failed", "cancelled"])
            feed.put(feed.ks.result(ref), {"state": state, "attempt": 1, "exit_code": 0,
                                           "ended_at": 1.0})
            results[ref.index] = state
        elif roll < 0.85:
            feed.delete(feed.ks.result(ref))
            results.pop(ref.index, None)
        elif roll < 0.95:
            feed.put(feed.ks.task(ref), {"params": {"i": ref.index}})  # redelivered
        else:
            cancelled = not cancelled
            feed.state("w", "cancelled" if cancelled else "running")

        states = [
            results.get(i) or ("running" if i in claims else
                               "cancelled" if cancelled else "pending")
            for i in range(3)
        ]
        by_state = {s: states.count(s) for s in set(states)}
        done = sum(states.count(s) for s in ("succeeded", "failed", "cancelled"))
        if done == 3:
            expected_state = ("failed" if "failed" in states else
                              "cancelled" if "cancelled" in states else "succeeded")
        else:
            expected_state = "running" if by_state.get("running") or done else "pending"
        assert summary(feed, "w", "e") == counts(expected_state, 3, **by_state)
        assert feed.view.open[("w", "e")] == {i for i in range(3)
                                              if i not in claims and i not in results}

    # A fresh view loaded from the final keys (as after a compacted watch) agrees.
    replay = Feed()
    replay.workflow("w", SINGLE, state="cancelled" if cancelled else "running")
    replay.expand("w", "e", 3)
    for i in claims:
        replay.claim(refs[i])
    for i, state in results.items():
        replay.put(replay.ks.result(refs[i]), {"state": state, "attempt": 1, "exit_code": 0,
                                               "ended_at": 1.0})
    assert summary(replay, "w", "e") == summary(feed, "w", "e")
