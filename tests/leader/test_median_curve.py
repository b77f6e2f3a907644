"""The pruning medians kept between looks give ``median_curve``'s figures exactly.

``search.MedianCurve`` brings an experiment's per-step medians up to a view trial by
trial (what a node that sees every trial prunes by, and what the leader publishes for
those that do not); ``search.median_curve`` of ``search.trials_of`` works them out from
every trial (the reference). Random histories go through a real mirror (``Feed``), as a
watch delivers them: tasks created (some outside the space), reports, ends of every
kind, reports that come after the end, retries, tied, infinite and NaN values, tasks
deleted; after each change both must agree, and ``search.KeptTrials`` (which both the
medians and the leader's suggestions read) must give ``trials_of``'s trials."""

from __future__ import annotations

import asyncio
import random

import pytest

from hypermesh.agent.tasks import metrics_watch
from hypermesh.agent.tasks.metrics_watch import PruningMedians
from hypermesh.state import search
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import TaskRef
from tests.state.test_model import Feed

PRUNED = """
experiments:
  e:
    parameters: {lr: {range: [0, 1]}}
    samples: 8
    objective: {metric: loss, goal: minimize}
    pruning: median
    command: ["true {{lr}}"]
"""

VALUES = [0.5, 0.5, 1.0, 2.0, -0.0, 0.0, 3.25, float("inf"), float("-inf"), float("nan")]


def metrics(points: dict[int, float]) -> dict[str, object]:
    """A metrics record as the agent stores it, with ``points`` as the loss's reports."""
    history = [[step, value] for step, value in sorted(points.items())]
    last = {"loss": history[-1][1]} if history else {}
    return {"last": last, "history": {"loss": history} if history else {},
            "reports": {"loss": len(history)}, "ignored": 0}


@pytest.mark.parametrize("seed", range(6))
def test_kept_medians_equal_the_medians_of_every_trial(seed: int) -> None:
    rng = random.Random(seed)
    feed = Feed()
    feed.workflow("w", PRUNED, state="running")
    exp = feed.view.workflows["w"].recipe.experiment("e")
    curve = search.MedianCurve(exp)
    kept = search.KeptTrials(exp)
    last: dict[int, search.Trial] = {}
    attempt: dict[int, int] = {}  # task index -> its attempt
    reports: dict[int, dict[int, float]] = {}
    looked = completed = 0
    for _ in range(400):
        ref = TaskRef("w", "e", rng.randrange(40))
        n = attempt.get(ref.index)
        what = rng.random()
        if n is None:  # create it, and start its first attempt
            lr = rng.choice([rng.random()] * 5 + [5.0])  # 5.0: outside the space
            feed.put(feed.ks.task(ref), {"params": {"lr": lr}})
            attempt[ref.index], reports[ref.index] = 1, {}
            feed.claim(ref)
        elif what < 0.45:  # a report (also after the end: a late flush)
            steps = reports[ref.index]
            steps[rng.randrange(12)] = rng.choice(VALUES)
            feed.put(feed.ks.metrics(ref, n), metrics(steps))
        elif what < 0.75 and ref not in feed.view.results:  # its end
            end = rng.choice(["succeeded"] * 3 + ["failed", "pruned"])
            if not reports[ref.index] and rng.random() < 0.8:  # most report before the end
                reports[ref.index][rng.randrange(12)] = rng.choice(VALUES)
                feed.put(feed.ks.metrics(ref, n), metrics(reports[ref.index]))
            if end == "pruned":
                feed.attempt(ref, n, "failed", reason="pruned")
                feed.put(feed.ks.result(ref), {"state": "failed", "attempt": n,
                                               "exit_code": 1, "ended_at": 5.0})
            else:
                feed.finish(ref, end, attempt=n)
        elif what < 0.85 and ref in feed.view.results:  # retry: a new attempt
            feed.delete(feed.ks.result(ref))
            attempt[ref.index], reports[ref.index] = n + 1, {}
            feed.put(feed.ks.task(ref), dict(feed.view.tasks[ref]))
            feed.claim(ref, attempt=n + 1)
        elif what < 0.88:  # the task deleted (its workflow being purged)
            for key in (feed.ks.task(ref), feed.ks.result(ref), feed.ks.metrics(ref, n)):
                feed.delete(key)
            del attempt[ref.index], reports[ref.index]
        if rng.random() < 0.5:
            trials = search.trials_of(feed.view, "w", exp)
            expected = search.median_curve(exp, trials)
            assert curve.update(feed.view, "w") == expected
            now, changed = kept.update(feed.view, "w")
            assert now == trials
            remade = {index for index, _ in changed}
            for t in now:  # a trial not made again is the object of the last look
                assert (t is last.get(t.index)) == (t.index not in remade)
            last = {t.index: t for t in now}
            looked += 1
            completed = max(completed, expected[0])
    assert looked > 100 and completed >= 5  # the medians were compared, of several trials


def test_one_step_s_median_is_numpy_s_to_the_last_bit() -> None:
    """A step's median in plain floats equals NumPy's 50th percentile (what
    ``median_curve`` asks) on ties, signed zeros, infinities, and values whose
    difference overflows; None where that is not finite."""
    import numpy as np

    rng = random.Random(7)
    pool = [0.5, 1.0, -0.0, 0.0, 0.1, 0.2, 0.30000000000000004, 1e308, -1e308,
            float("inf"), float("-inf")]
    for _ in range(20_000):
        values = sorted(rng.choice([*pool, rng.uniform(-5, 5)]) for _ in range(rng.randint(1, 9)))
        with np.errstate(invalid="ignore"):
            expected = float(np.nanpercentile(np.array(values), 50))
        got = search._median(values)
        assert got == (expected if np.isfinite(expected) else None), values
    assert search._median([]) is None


def test_a_node_keeps_the_medians_of_a_few_experiments_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kept medians hold their trials' reports: a node keeps those of the experiments it
    looked at last, and works the others out again from all their trials."""
    monkeypatch.setattr(metrics_watch, "CURVES_KEPT", 2)
    feed = Feed()

    def finish(wid: str, i: int) -> None:
        ref = TaskRef(wid, "e", i)
        feed.put(feed.ks.task(ref), {"params": {"lr": 0.1 * i}})
        feed.claim(ref)
        feed.put(feed.ks.metrics(ref, 1), metrics({0: float(i), 1: 2.0 * i + len(wid)}))
        feed.finish(ref, "succeeded")

    for wid in ("a", "b", "c"):
        feed.workflow(wid, PRUNED, state="running")
        for i in range(3):
            finish(wid, i)
    medians = PruningMedians(Etcd(["127.0.0.1:1"]), feed.ks)  # never reads etcd here

    async def look(wid: str, completed: int) -> None:
        exp = feed.view.workflows[wid].recipe.experiment("e")
        expected = search.median_curve(exp, search.trials_of(feed.view, wid, exp))
        assert await medians.from_view(feed.view, wid, exp) == expected
        assert expected[0] == completed

    async def looks() -> None:
        for wid in ("a", "b", "c"):
            await look(wid, 3)
        assert list(medians._curves) == [("b", "e"), ("c", "e")]  # a's dropped
        finish("a", 3)
        await look("a", 4)  # from all its trials again
        assert list(medians._curves) == [("c", "e"), ("a", "e")]

    asyncio.run(looks())
