"""Pure logic of ML workloads: metric reports, the ML recipe fields, the search rebuilt
from records (Optuna), pruning, ranking, and the leader's Suggest actions."""

from __future__ import annotations

import textwrap

import pytest

from hypermesh.agent.leader.policy import Suggest, plan
from hypermesh.errors import RecipeError
from hypermesh.recipe.ml import Objective
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import WorkflowRecord, dumps
from hypermesh.state.search import Trial, next_indices, ranked, should_prune, suggest, trials_of
from hypermesh.state.task_metrics import (
    MAX_HISTORY,
    MAX_METRICS,
    AttemptMetrics,
    MetricError,
    parse_report,
)
from hypermesh.state.task_metrics import report_in_line as line
from hypermesh.state.view import MeshView

TPE = """
experiments:
  s:
    parameters:
      x: {range: [-10, 10]}
      n: {range: [1, 5], sampling: int}
      opt: {values: [sgd, adam]}
    samples: 8
    workers: 3
    sampling: tpe
    objective: {metric: loss, goal: minimize}
    pruning: median
    command: ["train {{x}} {{n}} {{opt}}"]
"""


def tpe_experiment():  # type: ignore[no-untyped-def]
    return parse_recipe(TPE).experiments[0]


# --------------------------------------------------------------------------- metrics


def test_report_lines_and_values() -> None:
    assert line('HM_METRIC {"a": 1}') == '{"a": 1}'
    assert line("  HM_METRIC {}  ") == "{}"
    assert line("epoch 3 HM_METRIC {}") is None
    assert parse_report('{"val_loss": 0.5, "acc": 1, "step": 3}') == (
        {"val_loss": 0.5, "acc": 1.0},
        3,
    )
    assert parse_report('{"a": 2}') == ({"a": 2.0}, None)


@pytest.mark.parametrize(
    "text",
    ["not json", "[1]", '{"a": "x"}', '{"a": true}', '{"a": NaN}', '{"a": 1, "step": -1}',
     '{"a": 1, "step": 1.5}', '{"bad name": 1}'],
)
def test_malformed_reports_are_rejected(text: str) -> None:
    with pytest.raises(MetricError):
        parse_report(text)


def test_attempt_metrics_are_bounded_and_steps_default_to_report_count() -> None:
    m = AttemptMetrics()
    for i in range(MAX_HISTORY + 50):
        assert m.add_text(f'{{"loss": {i}}}')
    assert m.last == {"loss": MAX_HISTORY + 49.0}
    assert len(m.history["loss"]) == MAX_HISTORY
    assert m.history["loss"][-1] == (MAX_HISTORY + 49, MAX_HISTORY + 49.0)
    m.add({"loss": 1.0}, 7)
    m.add({"loss": 0.5}, 7)  # the same step again: the newer value replaces it
    assert m.history["loss"][-1] == (7, 0.5)
    assert not m.add_text("nonsense")
    for i in range(MAX_METRICS + 5):
        m.add({f"m{i}": 1.0}, None)
    assert len(m.last) == MAX_METRICS
    assert m.ignored == 1 + 6  # the bad line, and the metrics past the cap
    assert AttemptMetrics.from_json(m.to_json()) == m


# --------------------------------------------------------------------------- recipe


def problems(text: str) -> set[tuple[int | None, str]]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(textwrap.dedent(text).lstrip("\n"), "r.yaml")
    return {(p.line, p.path) for p in info.value.problems}


def test_ml_fields_parse_and_survive_json() -> None:
    exp = tpe_experiment()
    assert exp.objective == Objective("loss", "minimize")
    assert (exp.sampling, exp.pruning) == ("tpe", "median")
    recipe = parse_recipe(TPE)
    from hypermesh.recipe.recipe import Recipe

    assert Recipe.from_json(recipe.to_json()) == recipe


def test_ml_field_errors_name_field_and_line() -> None:
    assert problems("""
        experiments:
          s:
            parameters: {x: {range: [0, 1]}}
            samples: 4
            sampling: tpee
            objective: {metric: loss, goal: lowest}
            command: ["t {{x}}"]
        """) == {(5, "experiments.s.sampling"), (6, "experiments.s.objective.goal")}
    assert problems("""
        experiments:
          s:
            parameters: {x: {values: [1, 2]}}
            sampling: tpe
            pruning: median
            command: ["t {{x}}"]
        """) == {(2, "experiments.s.objective"), (2, "experiments.s.samples")}
    assert problems("""
        experiments:
          s:
            objective: {goal: minimize}
            command: ["t"]
        """) == {(3, "experiments.s.objective.metric")}


def test_gpu_memory_and_fractional_gpus() -> None:
    exp = parse_recipe("experiments: {s: {command: ['t'], hardware: {gpu_memory: 10GiB}}}")
    hw = exp.experiments[0].hardware
    assert (hw.gpus, hw.gpu_memory) == (1.0, 10 << 30)
    assert problems("""
        experiments:
          s:
            hardware: {gpus: 1.5}
            command: ["t"]
          t:
            hardware: {gpus: 0.5, gpu_memory: 1GiB}
            command: ["t"]
        """) == {(3, "experiments.s.hardware.gpus"), (6, "experiments.t.hardware.gpu_memory")}


# --------------------------------------------------------------------------- search


def done(index: int, x: float, loss: float | None, state: str = "complete") -> Trial:
    return Trial(index, {"x": x, "n": 2, "opt": "sgd"}, state, loss)  # type: ignore[arg-type]


def test_suggest_is_deterministic_and_within_the_space() -> None:
    exp = tpe_experiment()
    history = [done(i, x, (x - 2) ** 2) for i, x in enumerate([-8.0, -3.0, 1.0, 6.0, 9.0])]
    history.append(Trial(5, {"x": 0.0, "n": 1, "opt": "adam"}, "running"))
    a = suggest(exp, 11, 6, history)
    assert a == suggest(exp, 11, 6, history)  # a new leader computes the same trial
    assert a != suggest(exp, 11, 7, history)
    assert -10 <= a["x"] <= 10 and isinstance(a["n"], int) and 1 <= a["n"] <= 5
    assert a["opt"] in ("sgd", "adam") and type(a["x"]) is float  # plain JSON values


def test_next_indices_keep_budget_and_parallelism() -> None:
    assert list(next_indices(8, 3, 0, 0)) == [0, 1, 2]
    assert list(next_indices(8, 3, 3, 1)) == [3]
    assert list(next_indices(8, 3, 3, 0)) == []
    assert list(next_indices(8, 3, 7, 7)) == [7]
    assert list(next_indices(8, 3, 8, 8)) == []
    assert list(next_indices(10, 3, 8, 8)) == [8, 9]  # samples added live


def test_ranked_orders_by_goal_and_skips_unfinished() -> None:
    trials = [done(0, 1, 3.0), done(1, 1, 1.0), done(2, 1, None, "running"),
              done(3, 1, None, "pruned"), done(4, 1, 2.0)]
    assert [t.index for t in ranked(Objective("loss", "minimize"), trials)] == [1, 4, 0]
    assert [t.index for t in ranked(Objective("loss", "maximize"), trials)] == [0, 4, 1]


def test_median_pruner_stops_a_trial_worse_than_the_median() -> None:
    exp = tpe_experiment()
    others = [
        Trial(i, {"x": 0.0, "n": 1, "opt": "sgd"}, "complete", float(i), {0: float(i), 1: i / 2})
        for i in range(1, 6)
    ]
    bad = Trial(9, {"x": 0.0, "n": 1, "opt": "sgd"}, "running", None, {0: 10.0})
    good = Trial(9, {"x": 0.0, "n": 1, "opt": "sgd"}, "running", None, {0: 1.0})
    assert should_prune(exp, others, bad)
    assert not should_prune(exp, others, good)
    assert not should_prune(exp, others[:3], bad)  # fewer than 5 completed: no verdict yet


# --------------------------------------------------------------------------- leader


def test_leader_suggests_trials_up_to_parallelism_and_budget() -> None:
    ks = Keyspace("t")
    view = MeshView(ks)
    rev = 0

    def put(key: str, value: dict) -> None:  # type: ignore[type-arg]
        nonlocal rev
        rev += 1
        view.apply(key, dumps(value), rev, rev)

    wf = WorkflowRecord("w", "w", parse_recipe(TPE), 3, 1.0, "/tmp")
    put(ks.workflow("w"), wf.to_json())
    put(ks.workflow_state("w"), {"state": "running"})
    put(ks.expanded("w", "s"), {"count": 8})
    assert [a for a in plan(view) if isinstance(a, Suggest)] == [Suggest("w", "s", (0, 1, 2))]
    for i in range(3):
        put(ks.task(TaskRef("w", "s", i)), {"params": {"x": 1.0, "n": 1, "opt": "sgd"}})
    assert not [a for a in plan(view) if isinstance(a, Suggest)]
    ref = TaskRef("w", "s", 0)
    put(ks.attempt(ref, 1), {"attempt": 1, "node": "n", "state": "succeeded"})
    put(ks.metrics(ref, 1), {"last": {"loss": 0.5}, "history": {"loss": [[0, 0.5]]}})
    put(ks.result(ref), {"state": "succeeded", "attempt": 1, "exit_code": 0, "ended_at": 1.0})
    assert [a for a in plan(view) if isinstance(a, Suggest)] == [Suggest("w", "s", (3,))]
    trials = trials_of(view, "w", wf.recipe.experiments[0])
    assert [(t.state, t.value) for t in trials] == [
        ("complete", 0.5), ("running", None), ("running", None)
    ]
