"""Adaptive search and pruning through Optuna, rebuilt from the mesh's records.

No study lives anywhere but in etcd's task, attempt and metrics records: to choose the
parameters of a new trial, ``suggest`` builds an in-memory Optuna study from the trials
so far (finished ones with their objective values, running ones as running) and asks
Optuna's TPE sampler, seeded from the experiment's seed and the trial's index. A new
leader therefore continues a search exactly where the old one stopped, and the same
history and seed always give the same parameters. ``should_prune`` asks Optuna's
``MedianPruner`` the same way about one running trial; ``prune_by_medians`` gives its
answer from the per-step medians of the completed trials (``median_curve``) alone,
which is what agents ask.

Pure: reads a ``MeshView`` or plain values; no etcd, no gRPC, no clock. Optuna is
imported on first use (it costs about a second), so commands that only rank trials do
not pay for it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hypermesh.recipe.ml import Objective
from hypermesh.recipe.recipe import Experiment, Parameter
from hypermesh.state.keyspace import BlockRef, TaskRef
from hypermesh.state.records import TERMINAL
from hypermesh.state.view import MeshView

if TYPE_CHECKING:
    import optuna

TrialState = Literal["complete", "pruned", "running", "failed"]

MAX_STARTUP_TRIALS = 10  # Optuna's default; fewer for small budgets (see startup_trials)
PRUNER_STARTUP_TRIALS = 5  # MedianPruner's defaults: compare once 5 trials completed,
PRUNER_WARMUP_STEPS = 0  # from the first reported step on


@dataclass(frozen=True)
class Trial:
    """One task of a search as Optuna sees it."""

    index: int
    params: dict[str, Any]
    state: TrialState
    value: float | None = None
    intermediate: dict[int, float] = field(default_factory=dict)


def is_adaptive(exp: Experiment) -> bool:
    """Whether the experiment's tasks are created one by one from the results so far."""
    return exp.sampling == "tpe"


DEFAULT_PARALLELISM = 4  # unfinished trials of an adaptive search without a workers cap


def startup_trials(samples: int) -> int:
    """Random trials before TPE models the results: Optuna's 10, or a quarter of a
    smaller budget (at least 2), so a small budget still gets adaptive trials."""
    return max(2, min(MAX_STARTUP_TRIALS, samples // 4))


def trial_seed(seed: int, index: int) -> int:
    """The sampler seed of trial ``index``: the same on every agent (SHA-256, not hash())."""
    digest = hashlib.sha256(f"hypermesh-tpe:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def settle_experiment(view: MeshView, wid: str, experiment: str) -> int:
    """Apply the batches of the experiment's blocks that the view deferred (an agent
    that does not lead), where its trials' results and attempts are; how many of its
    tasks have finished (a count that changes whenever a trial completes). A view that
    defers nothing (the leader's) has nothing to apply: its blocks are not gone through."""
    if view.defer_batches:
        for first in list(view.blocks.get((wid, experiment), ())):
            view.settle(BlockRef(wid, experiment, first))
    counts = view.counts.get((wid, experiment))
    return sum(counts[s] for s in TERMINAL) if counts else 0


def trials_of(view: MeshView, wid: str, exp: Experiment) -> list[Trial]:
    """Every created trial of experiment ``exp`` of workflow ``wid``, by index (its
    deferred batches applied first: ``settle_experiment``)."""
    settle_experiment(view, wid, exp.name)
    metric = exp.objective.metric if exp.objective else None
    trials = []
    for ref in view.task_refs(wid, exp.name):
        params = view.tasks[ref].get("params", {})
        trials.append(_trial(view, ref, params, metric))
    return trials


def _trial(view: MeshView, ref: TaskRef, params: dict[str, Any], metric: str | None) -> Trial:
    result = view.results.get(ref)
    reported = view.metrics.get(ref, {})
    n = result.attempt if result else max(reported, default=0)
    m = reported.get(n)
    value = m.last.get(metric) if m and metric else None
    intermediate = m.intermediate(metric) if m and metric else {}
    state: TrialState
    if result is None:
        state = "running"
    elif view.pruned(ref):
        state = "pruned"
    elif result.state == "succeeded" and value is not None:
        state = "complete"
    else:
        state = "failed"  # failed, cancelled, or succeeded without the objective metric
    return Trial(ref.index, dict(params), state, value, intermediate)


def next_indices(budget: int, parallel: int, created: int, finished: int) -> range:
    """Indices of the trials to create now: up to the ``budget`` (the experiment's
    samples, plus any added live), with at most ``parallel`` (its ``workers`` cap, live
    or from the recipe) unfinished."""
    room = parallel - (created - finished)
    return range(created, created + max(0, min(budget - created, room)))


# --------------------------------------------------------------------------- Optuna


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def distributions(exp: Experiment) -> dict[str, Any]:
    optuna = _optuna()
    return {p.name: _distribution(optuna, p) for p in exp.parameters}


def _distribution(optuna: Any, p: Parameter) -> Any:
    d = optuna.distributions
    if p.kind == "values":
        return d.CategoricalDistribution(list(p.values))
    assert p.low is not None and p.high is not None
    if p.sampling == "int":
        return d.IntDistribution(math.ceil(p.low), math.floor(p.high))
    return d.FloatDistribution(p.low, p.high, log=p.sampling == "loguniform")


def _study(
    exp: Experiment, trials: list[Trial], sampler: Any = None
) -> tuple[optuna.Study, dict[str, Any]]:
    optuna = _optuna()
    assert exp.objective is not None
    dists = distributions(exp)
    study = optuna.create_study(direction=exp.objective.goal, sampler=sampler)
    study.add_trials(_frozen(trials, dists))
    return study, dists


def _frozen(trials: list[Trial], dists: dict[str, Any]) -> list[optuna.trial.FrozenTrial]:
    """The trials as Optuna's, those it can compare with ``dists`` (a study holds copies
    of these)."""
    optuna = _optuna()
    states = {
        "complete": optuna.trial.TrialState.COMPLETE,
        "pruned": optuna.trial.TrialState.PRUNED,
        "running": optuna.trial.TrialState.RUNNING,
        "failed": optuna.trial.TrialState.FAIL,
    }
    frozen = []
    for t in trials:
        params = {k: v for k, v in t.params.items() if k in dists}
        if len(params) != len(dists):
            continue  # a trial of another parameter space: not comparable
        try:
            frozen.append(
                optuna.trial.create_trial(
                    params=params,
                    distributions=dists,
                    value=t.value if t.state == "complete" else None,
                    intermediate_values=dict(t.intermediate),
                    state=states[t.state],
                )
            )
        except ValueError:
            continue  # a value outside the space (set by hand): not comparable
    return frozen


def suggest(exp: Experiment, seed: int, index: int, trials: list[Trial]) -> dict[str, Any]:
    """The parameters of trial ``index`` given the trials so far (TPE, seeded per index)."""
    optuna = _optuna()
    assert exp.samples is not None
    sampler = optuna.samplers.TPESampler(
        seed=trial_seed(seed, index),
        n_startup_trials=startup_trials(exp.samples),
        constant_liar=True,  # running trials count as bad: parallel asks spread out
    )
    study, dists = _study(exp, trials, sampler)
    asked = study.ask(dists)
    return {p.name: _plain(asked.params[p.name]) for p in exp.parameters}


def _plain(value: Any) -> Any:
    """numpy scalars (from Optuna) as plain Python values, storable as JSON."""
    return value.item() if hasattr(value, "item") else value


def should_prune(exp: Experiment, others: list[Trial], current: Trial) -> bool:
    """Whether Optuna's ``MedianPruner`` stops ``current`` given the other trials: the
    reference ``prune_by_medians`` answers like (agents ask that one: a study of every
    trial costs about 350 ms at 4,096 trials, ``scripts/bench_prune_medians.py``)."""
    if exp.pruning is None or exp.objective is None or not current.intermediate:
        return False
    optuna = _optuna()
    study, dists = _study(exp, [t for t in others if t.index != current.index])
    trial = optuna.trial.create_trial(
        params={k: v for k, v in current.params.items() if k in dists},
        distributions={k: v for k, v in dists.items() if k in current.params},
        intermediate_values=dict(current.intermediate),
        state=optuna.trial.TrialState.RUNNING,
    )
    pruner = optuna.pruners.MedianPruner(
        n_startup_trials=PRUNER_STARTUP_TRIALS, n_warmup_steps=PRUNER_WARMUP_STEPS
    )
    return bool(pruner.prune(study, trial))


def median_curve(exp: Experiment, trials: list[Trial]) -> tuple[int, dict[int, float]]:
    """What ``MedianPruner`` compares a trial with, from ``trials`` (those of ``exp``):
    how many completed trials it counts, and per step the median of their intermediate
    values (a step none of them reported is left out). A node that sees every trial
    works it out from its view (``agent/tasks/metrics_watch.py``); the leader publishes
    it for those that do not (``agent/leader/prune_medians.py``)."""
    if exp.objective is None:
        return 0, {}
    import numpy as np  # Optuna's own dependency: the same percentile as its pruner's

    # The completed trials a study of them would hold, without the study: adding them
    # to one copies each (most of the cost, on a search of thousands of trials).
    done = _frozen([t for t in trials if t.state == "complete"], distributions(exp))
    by_step: dict[int, list[float]] = {}
    for t in done:
        for step, value in t.intermediate_values.items():
            by_step.setdefault(step, []).append(value)
    medians = {}
    for step in sorted(by_step):
        median = float(np.nanpercentile(np.array(by_step[step], dtype=float), 50))
        if math.isfinite(median):
            medians[step] = median
    return len(done), medians


def medians_value(completed: int, medians: dict[int, float]) -> bytes:
    """``median_curve``'s figures as the leader stores them (``prunemed/``)."""
    return json.dumps({"completed": completed, "medians": list(medians.items())},
                      separators=(",", ":")).encode()


def parse_medians(value: bytes) -> tuple[int, dict[int, float]]:
    """``(completed, {step: median})`` of a ``prunemed/`` value."""
    data = json.loads(value)
    return int(data["completed"]), {int(s): float(m) for s, m in data["medians"]}


def prune_by_medians(
    exp: Experiment, completed: int, medians: dict[int, float], current: Trial
) -> bool:
    """``should_prune``'s answer from ``median_curve``'s figures instead of the trials:
    Optuna's ``MedianPruner`` asked with ``min(completed, its start-up count)`` completed
    trials whose every step holds the median, so it counts and compares as it would
    with the trials themselves."""
    if exp.pruning is None or exp.objective is None or not current.intermediate:
        return False
    optuna = _optuna()
    study = optuna.create_study(direction=exp.objective.goal)
    complete = optuna.trial.TrialState.COMPLETE
    study.add_trials([
        optuna.trial.create_trial(value=0.0, intermediate_values=medians, state=complete)
        for _ in range(min(completed, PRUNER_STARTUP_TRIALS))
    ])
    trial = optuna.trial.create_trial(
        intermediate_values=dict(current.intermediate), state=optuna.trial.TrialState.RUNNING
    )
    pruner = optuna.pruners.MedianPruner(
        n_startup_trials=PRUNER_STARTUP_TRIALS, n_warmup_steps=PRUNER_WARMUP_STEPS
    )
    return bool(pruner.prune(study, trial))


# --------------------------------------------------------------------------- ranking


def ranked(objective: Objective, trials: list[Trial]) -> list[Trial]:
    """Completed trials, best first (ties by index)."""
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    sign = 1.0 if objective.goal == "minimize" else -1.0
    return sorted(done, key=lambda t: (sign * (t.value or 0.0), t.index))


# --------------------------------------------------------------------------- rows
# What `hypermesh best --json`, `compare` and the dashboard's trials view show of a trial.

def curve_summary(curve: Sequence[Sequence[float]], goal: str) -> dict[str, Any]:
    """``{"first", "best", "last", "steps"}`` of a curve ``[[step, value], ...]`` (the
    values None when it is empty); ``best`` is the lowest value, or the highest when
    ``goal`` is ``maximize``."""
    values = [v for _, v in curve]
    pick = max if goal == "maximize" else min
    return {"first": values[0] if values else None, "best": pick(values) if values else None,
            "last": values[-1] if values else None, "steps": len(values)}


def trial_row(wid: str, exp: Experiment, t: Trial, rank: int | None) -> dict[str, Any]:
    """One entry of ``best --json``: ``rank`` None for a trial that did not complete."""
    assert exp.objective is not None
    return {
        "rank": rank,
        "task": f"{wid}.{exp.name}.{t.index}",
        "experiment": exp.name,
        "metric": exp.objective.metric,
        "goal": exp.objective.goal,
        "value": t.value,
        "params": t.params,
        "state": t.state,
        "curve": [[step, value] for step, value in sorted(t.intermediate.items())],
    }
