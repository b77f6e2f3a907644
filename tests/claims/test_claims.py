"""choose_claims: which tasks a node claims next, given a view of the mesh and its own load."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.recipe.recipe import Hardware, parse_recipe
from hypermesh.state.fit import fits, gpu_type_matches
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import NodeRecord, WorkflowRecord, dumps
from hypermesh.state.txns import ClaimPlan
from hypermesh.state.view import MeshView

GIB = 1024**3


class Feed:
    """Applies puts and deletes to a MeshView with increasing revisions, as a watch would."""

    def __init__(self) -> None:
        self.ks = Keyspace("t")
        self.view = MeshView(self.ks)
        self.rev = 0

    def put(self, key: str, value: dict[str, Any]) -> int:
        self.rev += 1
        self.view.apply(key, dumps(value), self.rev, self.rev)
        return self.rev

    def delete(self, key: str) -> None:
        self.rev += 1
        self.view.apply(key, None, 0, self.rev)

    def workflow(
        self, wid: str, recipe: str, submitted_at: float = 100.0, state: str = "running"
    ) -> None:
        wf = WorkflowRecord(
            id=wid, name=wid, recipe=parse_recipe(textwrap.dedent(recipe)), seed=1,
            submitted_at=submitted_at, workdir="/tmp",
        )
        self.put(self.ks.workflow(wid), wf.to_json())
        self.put(self.ks.workflow_state(wid), {"state": state})

    def tasks(self, wid: str, exp: str, count: int, marker: bool = True) -> list[TaskRef]:
        refs = [TaskRef(wid, exp, i) for i in range(count)]
        for ref in refs:
            self.put(self.ks.task(ref), {"params": {}})
        if marker:
            self.put(self.ks.expanded(wid, exp), {"count": count})
        return refs

    def claim(self, ref: TaskRef, node: str = "other", attempt: int = 1) -> None:
        self.attempt(ref, attempt, "running", node)
        self.put(self.ks.claim(ref), {"node": node, "attempt": attempt, "slot": None, "lease": 1,
                                      "started_at": 0.0})

    def attempt(self, ref: TaskRef, n: int, state: str, node: str = "other",
                reason: str | None = None) -> int:
        return self.put(self.ks.attempt(ref, n), {"attempt": n, "node": node, "state": state,
                                                  "reason": reason, "started_at": 3.0})

    def slot(self, wid: str, exp: str, k: int) -> None:
        self.put(self.ks.slot(wid, exp, k), {"task": "x"})


def recipe(**experiments: str) -> str:
    """A recipe whose experiments each have a 'values' parameter plus ``extra`` YAML lines."""
    text = "experiments:\n"
    for name, extra in experiments.items():
        body = f"command: echo {{{{x}}}}\nparameters:\n  x: {{values: [1, 2]}}\n{extra}\n"
        text += f"  {name}:\n" + textwrap.indent(body, "    ")
    return text


def one(extra: str = "") -> str:
    return recipe(e=extra)


def node(**fields: Any) -> NodeRecord:
    fields.setdefault("slots", 8)
    return NodeRecord("me", "me:7000", **fields)


def refs(plans: list[ClaimPlan]) -> list[str]:
    return [p.ref.id for p in plans]


# ------------------------------------------------------------------ slots and limits


def test_fresh_tasks_are_planned_as_first_attempts_in_index_order() -> None:
    feed = Feed()
    feed.workflow("w", one())
    feed.tasks("w", "e", 5)
    plans = choose_claims(feed.view, node(slots=3), LocalLoad(), limit=10)
    assert plans == [
        ClaimPlan(TaskRef("w", "e", i), attempt=1, slot=None, lost=None) for i in range(3)
    ]


@pytest.mark.parametrize(
    ("slots", "running", "limit", "expected"),
    [(4, 0, 10, 4), (4, 1, 10, 3), (4, 4, 10, 0), (4, 5, 10, 0), (4, 0, 2, 2), (4, 3, 2, 1),
     (4, 0, 0, 0), (0, 0, 5, 0)],
)
def test_plans_never_exceed_free_node_slots_or_the_limit(
    slots: int, running: int, limit: int, expected: int
) -> None:
    feed = Feed()
    feed.workflow("w", one())
    feed.tasks("w", "e", 20)
    busy = {TaskRef("elsewhere", "x", i) for i in range(running)}
    plans = choose_claims(feed.view, node(slots=slots), LocalLoad(running=busy), limit)
    assert len(plans) == expected


def test_tasks_this_node_already_runs_are_not_planned_again() -> None:
    # The node claimed w.e.0 and w.e.2 but the view has not seen those claims yet.
    feed = Feed()
    feed.workflow("w", one())
    feed.tasks("w", "e", 6)
    load = LocalLoad(running={TaskRef("w", "e", 0), TaskRef("w", "e", 2)})
    plans = choose_claims(feed.view, node(slots=5), load, limit=10)
    assert refs(plans) == ["w.e.1", "w.e.3", "w.e.4"]


def test_claimed_and_finished_tasks_are_not_planned() -> None:
    feed = Feed()
    feed.workflow("w", one())
    a, _, c, _ = feed.tasks("w", "e", 4)
    feed.claim(a)
    feed.put(feed.ks.result(c), {"state": "succeeded", "attempt": 1, "exit_code": 0,
                                 "ended_at": 1.0})
    assert refs(choose_claims(feed.view, node(), LocalLoad(), 10)) == ["w.e.1", "w.e.3"]


def test_nothing_to_do_gives_no_plans() -> None:
    assert choose_claims(MeshView(Keyspace("t")), node(), LocalLoad(), 5) == []


# ------------------------------------------------------------------ workers cap


def test_workers_cap_hands_out_only_free_slot_indices() -> None:
    feed = Feed()
    feed.workflow("w", one(extra="workers: 4"))
    feed.tasks("w", "e", 10)
    feed.slot("w", "e", 1)  # held by another node
    load = LocalLoad(slots_held={("w", "e", 2)})  # held by us, not yet in the view
    plans = choose_claims(feed.view, node(slots=8), load, limit=8)
    assert [(p.ref.index, p.slot) for p in plans] == [(0, 0), (1, 3)]


def test_workers_cap_full_gives_nothing() -> None:
    feed = Feed()
    feed.workflow("w", one(extra="workers: 2"))
    feed.tasks("w", "e", 10)
    feed.slot("w", "e", 0)
    load = LocalLoad(running={TaskRef("w", "e", 9)}, slots_held={("w", "e", 1)})
    assert choose_claims(feed.view, node(slots=8), load, limit=8) == []


def test_workers_cap_plans_are_bounded_by_the_limit_too() -> None:
    feed = Feed()
    feed.workflow("w", one(extra="workers: 5"))
    feed.tasks("w", "e", 10)
    plans = choose_claims(feed.view, node(slots=8), LocalLoad(), limit=2)
    assert [(p.ref.index, p.slot) for p in plans] == [(0, 0), (1, 1)]


def test_slots_of_another_experiment_do_not_count_against_the_cap() -> None:
    feed = Feed()
    feed.workflow("w", recipe(a="workers: 1", b="workers: 1"))
    feed.tasks("w", "a", 3)
    feed.tasks("w", "b", 3)
    feed.slot("w", "a", 0)
    load = LocalLoad(slots_held={("other-wf", "b", 0)})
    plans = choose_claims(feed.view, node(slots=8), load, limit=8)
    assert [(p.ref.id, p.slot) for p in plans] == [("w.b.0", 0)]


def test_capped_and_uncapped_experiments_fill_the_node_together() -> None:
    feed = Feed()
    feed.workflow("w", recipe(capped="workers: 2", free=""))
    feed.tasks("w", "capped", 5)
    feed.tasks("w", "free", 5)
    plans = choose_claims(feed.view, node(slots=5), LocalLoad(), limit=10)
    assert [(p.ref.id, p.slot) for p in plans] == [
        ("w.capped.0", 0), ("w.capped.1", 1), ("w.free.0", None), ("w.free.1", None),
        ("w.free.2", None),
    ]


@pytest.mark.parametrize("workers", [1, 2, 3, 6])
@pytest.mark.parametrize("taken", [set(), {0}, {1, 2}, {0, 1, 2, 3, 4}])
def test_slot_indices_are_unique_free_and_within_the_cap(workers: int, taken: set[int]) -> None:
    feed = Feed()
    feed.workflow("w", one(extra=f"workers: {workers}"))
    feed.tasks("w", "e", 10)
    for k in taken:
        feed.slot("w", "e", k)
    plans = choose_claims(feed.view, node(slots=10), LocalLoad(), limit=10)
    slots = [p.slot for p in plans]
    free = set(range(workers)) - taken
    # Slots above the cap (held by tasks that started before a live `scale` lowered
    # it) count against the cap too: the mesh converges to the new cap.
    room = max(0, workers - len(taken))
    assert len(slots) == len(set(slots)) == min(len(free), room)
    assert set(slots) <= free


# ------------------------------------------------------------------ hardware


@pytest.mark.parametrize(
    ("hw", "machine", "ok"),
    [
        (Hardware(), {}, True),
        (Hardware(gpu="k80", gpus=1), {"gpus": 1, "gpu_type": "Tesla K80"}, True),
        (Hardware(gpu="K80", gpus=1), {"gpus": 4, "gpu_type": "tesla k80"}, True),
        (Hardware(gpu="k80", gpus=1), {"gpus": 1, "gpu_type": "Tesla V100-SXM2-16GB"}, False),
        (Hardware(gpu="k80", gpus=1), {"gpus": 0, "gpu_type": "Tesla K80"}, False),
        (Hardware(gpu="k80", gpus=1), {"gpus": 0}, False),
        (Hardware(gpus=2), {"gpus": 1, "gpu_type": "A100"}, False),
        (Hardware(gpus=2), {"gpus": 2, "gpu_type": "A100"}, True),
        (Hardware(gpus=0.5), {"gpus": 1}, True),
        (Hardware(gpus=1), {}, False),
        (Hardware(cpus=4), {"cpus": 2.0}, False),
        (Hardware(cpus=4), {"cpus": 4.0}, True),
        (Hardware(memory=8 * GIB), {"memory": 4 * GIB}, False),
        (Hardware(memory=4 * GIB), {"memory": 4 * GIB}, True),
        (Hardware(memory=8 * GIB), {"memory": 0}, True),  # node memory unknown
    ],
)
def test_fits(hw: Hardware, machine: dict[str, Any], ok: bool) -> None:
    assert fits(hw, NodeRecord("n", "a", **machine)) is ok


@pytest.mark.parametrize(
    ("wanted", "have", "ok"),
    [
        ("k80", "Tesla K80", True),
        ("K80", "tesla k80", True),
        ("v100", "Tesla V100-SXM2-16GB", True),
        ("k80", "Tesla V100", False),
        ("a100", "", False),
        (None, "", True),
        ("", "Tesla K80", True),
        (None, "Tesla K80", True),
    ],
)
def test_gpu_type_matches(wanted: str | None, have: str, ok: bool) -> None:
    assert gpu_type_matches(wanted, have) is ok


def test_experiments_that_do_not_fit_are_skipped_and_others_claimed() -> None:
    text = """
    experiments:
      big:
        command: echo big
        hardware: {gpu: v100, memory: 64GiB}
      k80:
        command: echo k80
        hardware: {gpu: k80}
      cpu:
        command: echo cpu
        hardware: {cpus: 64}
    """
    feed = Feed()
    feed.workflow("w", text)
    for name in ("big", "k80", "cpu"):
        feed.tasks("w", name, 1)
    machine = node(gpus=1, gpu_type="Tesla K80", cpus=8.0, memory=16 * GIB)
    assert refs(choose_claims(feed.view, machine, LocalLoad(), 10)) == ["w.k80.0"]


@pytest.mark.parametrize(
    ("gpus", "used", "per_task", "expected"),
    [(2, 0.0, 1, 2), (2, 1.0, 1, 1), (2, 2.0, 1, 0), (1, 0.0, 0.5, 2), (4, 0.5, 1, 3)],
)
def test_free_gpus_bound_the_plans(gpus: int, used: float, per_task: float, expected: int) -> None:
    feed = Feed()
    feed.workflow("w", one(extra=f"hardware: {{gpus: {per_task}}}"))
    feed.tasks("w", "e", 10)
    load = LocalLoad(gpus_used=used)
    plans = choose_claims(feed.view, node(slots=8, gpus=gpus), load, limit=8)
    assert len(plans) == expected


# ------------------------------------------------------------------ workflow and experiment state


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_tasks_of_ended_workflows_are_not_claimed(state: str) -> None:
    feed = Feed()
    feed.workflow("w", one(), state=state)
    feed.tasks("w", "e", 3)
    assert choose_claims(feed.view, node(), LocalLoad(), 10) == []


@pytest.mark.parametrize("state", ["pending", "running"])
def test_tasks_of_live_workflows_are_claimed(state: str) -> None:
    feed = Feed()
    feed.workflow("w", one(), state=state)
    feed.tasks("w", "e", 3)
    assert refs(choose_claims(feed.view, node(), LocalLoad(), 10)) == ["w.e.0", "w.e.1", "w.e.2"]


def test_a_workflow_cancelled_after_expansion_stops_being_claimed() -> None:
    feed = Feed()
    feed.workflow("w", one())
    feed.tasks("w", "e", 3)
    assert len(choose_claims(feed.view, node(), LocalLoad(), 10)) == 3
    feed.put(feed.ks.workflow_state("w"), {"state": "cancelled"})
    assert choose_claims(feed.view, node(), LocalLoad(), 10) == []


def test_tasks_of_an_experiment_still_being_expanded_are_not_claimed() -> None:
    feed = Feed()
    feed.workflow("w", one())
    feed.tasks("w", "e", 3, marker=False)  # the leader wrote tasks but not the marker yet
    assert choose_claims(feed.view, node(), LocalLoad(), 10) == []
    feed.put(feed.ks.expanded("w", "e"), {"count": 3})
    assert len(choose_claims(feed.view, node(), LocalLoad(), 10)) == 3


# ------------------------------------------------------------------ order


def test_older_workflows_first_then_topological_order_then_index() -> None:
    # file order is 'late' then 'early', but 'late' comes after 'early'
    text = """
    experiments:
      late:
        command: echo late
        after: early
      early:
        command: echo early
    """
    feed = Feed()
    feed.workflow("a-new", text, submitted_at=200.0)
    feed.workflow("z-old", text, submitted_at=100.0)
    for wid in ("a-new", "z-old"):
        # out-of-order arrival; both experiments open (e.g. retries of 'early')
        for index in (11, 2, 10):
            feed.put(feed.ks.task(TaskRef(wid, "late", index)), {"params": {}})
            feed.put(feed.ks.task(TaskRef(wid, "early", index)), {"params": {}})
        feed.put(feed.ks.expanded(wid, "late"), {"count": 12})
        feed.put(feed.ks.expanded(wid, "early"), {"count": 12})
    plans = choose_claims(feed.view, node(slots=20), LocalLoad(), limit=20)
    assert refs(plans) == [
        "z-old.early.2", "z-old.early.10", "z-old.early.11",
        "z-old.late.2", "z-old.late.10", "z-old.late.11",
        "a-new.early.2", "a-new.early.10", "a-new.early.11",
        "a-new.late.2", "a-new.late.10", "a-new.late.11",
    ]
    first = choose_claims(feed.view, node(slots=20), LocalLoad(), limit=1)
    assert refs(first) == ["z-old.early.2"]


def test_workflows_submitted_at_the_same_time_go_by_id() -> None:
    feed = Feed()
    for wid in ("wf-b", "wf-a", "wf-c"):
        feed.workflow(wid, one(), submitted_at=5.0)
        feed.tasks(wid, "e", 1)
    assert refs(choose_claims(feed.view, node(), LocalLoad(), 10)) == [
        "wf-a.e.0", "wf-b.e.0", "wf-c.e.0",
    ]


# ------------------------------------------------------------------ attempts


def test_next_attempt_follows_the_last_one() -> None:
    feed = Feed()
    feed.workflow("w", one())
    a, b, c = feed.tasks("w", "e", 3)
    feed.attempt(a, 1, "failed", reason="exit")
    feed.attempt(a, 2, "failed", reason="node-lost")
    feed.attempt(b, 1, "failed", reason="timeout")
    feed.attempt(b, 3, "failed", reason="exit")  # numbering gap: still last + 1
    plans = {p.ref: p for p in choose_claims(feed.view, node(), LocalLoad(), 10)}
    assert (plans[a].attempt, plans[b].attempt, plans[c].attempt) == (3, 4, 1)
    assert all(p.lost is None for p in plans.values())


def test_a_running_attempt_without_a_claim_is_lost_and_closed_out() -> None:
    feed = Feed()
    feed.workflow("w", one())
    a, b = feed.tasks("w", "e", 2)
    feed.attempt(a, 1, "failed", reason="exit")
    feed.claim(a, node="dead", attempt=2)
    revision = feed.attempt(a, 2, "running", node="dead")
    feed.delete(feed.ks.claim(a))  # the dead node's lease expired
    plans = {p.ref: p for p in choose_claims(feed.view, node(), LocalLoad(), 10)}
    assert plans[a].attempt == 3
    lost = plans[a].lost
    assert lost is not None
    assert (lost.attempt, lost.node, lost.state, lost.revision) == (2, "dead", "running", revision)
    assert plans[b].lost is None


def test_a_finished_last_attempt_is_not_lost() -> None:
    feed = Feed()
    feed.workflow("w", one())
    (a,) = feed.tasks("w", "e", 1)
    feed.attempt(a, 1, "running")
    feed.attempt(a, 2, "failed", reason="preempted")
    (plan,) = choose_claims(feed.view, node(), LocalLoad(), 10)
    assert (plan.attempt, plan.lost) == (3, None)
