"""The leader's kept Optuna studies answer every suggestion as a study built for it would.

``search.Studies`` keeps one study per adaptive experiment between suggestions and brings
it up to the records before each; ``search.suggest`` builds a study from the records
every time (the reference: what a new leader, with nothing kept, computes). Random
searches drive both through what happens to trials on a mesh: asked and written, asked
but never written (another leader won), reports, ends of every kind, a reopening
(``retry``), a trial outside the space (set by hand), and the experiment's next
suggestion, and every answer must be the same."""

from __future__ import annotations

import math
import random

import pytest

from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state import search
from hypermesh.state.search import Studies, Trial

RECIPE = """
experiments:
  s:
    parameters:
      x: {range: [-10, 10]}
      n: {range: [1, 5], sampling: int}
      opt: {values: [sgd, adam]}
    samples: 400
    sampling: tpe
    objective: {metric: loss, goal: %s}
    command: ["train {{x}} {{n}} {{opt}}"]
"""


def loss(p: dict[str, object], rng: random.Random) -> float:
    """The trial's objective; now and then NaN (a trial Optuna does not take: a study
    built from the records leaves it out, a kept one must too)."""
    x = p["x"]
    assert isinstance(x, float)
    return float("nan") if rng.random() < 0.05 else (x - 2) ** 2 + rng.random()


# How running trials end: mostly completed, or mostly pruned (TPE then ranks the pruned
# ones by their last report, as it has too few completed trials).
ENDS = {
    "completed": ["running"] * 2 + ["complete"] * 3 + ["pruned"] * 2 + ["failed"],
    "pruned": ["running"] * 2 + ["complete"] + ["pruned"] * 8 + ["failed"],
}


@pytest.mark.parametrize("ends", ENDS)
@pytest.mark.parametrize("seed", range(3))
def test_a_kept_study_answers_as_a_new_one(seed: int, ends: str) -> None:
    rng = random.Random(seed)
    exp = parse_recipe(RECIPE % rng.choice(["minimize", "maximize"])).experiments[0]
    studies = Studies()
    trials: list[Trial] = []  # the records, by index
    rebuilds = 0  # what a kept study cannot be brought up to
    for step in range(80):
        index = len(trials)
        expected = search.suggest(exp, seed, index, trials)
        assert studies.suggest("s", exp, seed, index, trials) == expected, step
        what = rng.random()
        if what < 0.03 and index:  # asked, never written: asked again
            rebuilds += 1
            expected = search.suggest(exp, seed, index, trials)
            assert studies.suggest("s", exp, seed, index, trials) == expected
        elif what < 0.06:  # another leader wrote this trial first, with its parameters
            rebuilds += 1
            expected = {"x": rng.uniform(-10, 10), "n": 3, "opt": "adam"}
        trials.append(Trial(index, expected, "running"))
        if what > 0.97:  # a trial set by hand, outside the space
            trials.append(Trial(index + 1, {"x": 99.0, "n": 2, "opt": "sgd"}, "complete", 1.0))
        for k, t in enumerate(trials):
            if t.state != "running" or rng.random() < 0.5:
                continue
            reports = dict(t.intermediate)
            reports[len(reports)] = rng.random()
            end = rng.choice(ENDS[ends])
            value = loss(t.params, rng) if end == "complete" else None
            rebuilds += value is not None and math.isnan(value)  # now left out of the study
            trials[k] = Trial(t.index, t.params, end, value, reports)  # type: ignore[arg-type]
        ended = [k for k, t in enumerate(trials) if t.state != "running"]
        if ended and rng.random() < 0.03:
            k = rng.choice(ended)
            trials[k] = Trial(trials[k].index, trials[k].params, "running")  # retry
            rebuilds += 1
    # Built once, and again only for what it cannot be brought up to: most answers came
    # from a study kept and brought up to the records.
    assert studies.rebuilt <= 1 + rebuilds
    assert studies.rebuilt < 80 / 4


def test_a_trial_left_out_then_retried_is_taken_again() -> None:
    """A trial whose objective came out NaN is left out of the study (Optuna does not
    take it); retried, it runs again and counts as running, in its place by index."""
    exp = parse_recipe(RECIPE % "minimize").experiments[0]
    rng = random.Random(3)
    trials = [Trial(i, {"x": rng.uniform(-10, 10), "n": 2, "opt": "sgd"}, "complete",
                    float(i)) for i in range(12)]
    trials[4] = Trial(4, trials[4].params, "complete", float("nan"))
    studies = Studies()
    for index, retried in ((12, False), (13, True)):
        if retried:
            trials[4] = Trial(4, trials[4].params, "running")
        expected = search.suggest(exp, 5, index, trials)
        assert studies.suggest("s", exp, 5, index, trials) == expected
        trials.append(Trial(index, expected, "running"))
    assert studies.rebuilt == 2  # the retried trial's place is inside the study


def test_a_study_is_kept_per_experiment_and_the_least_recent_dropped() -> None:
    exp = parse_recipe(RECIPE % "minimize").experiments[0]
    studies = Studies(keep=2)
    records: dict[str, list[Trial]] = {"a": [], "b": [], "c": []}
    for key in ("a", "b", "a", "c", "a", "b"):
        trials = records[key]
        trials.append(Trial(len(trials), studies.suggest(key, exp, 1, len(trials), trials),
                            "running"))
    # a built, b built, a kept, c built (b dropped), a kept, b built again
    assert studies.rebuilt == 4
