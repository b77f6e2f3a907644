"""Adaptive search and pruning through Optuna, rebuilt from the mesh's records.

No study lives anywhere but in etcd's task, attempt and metrics records: to choose the
parameters of a new trial, ``suggest`` builds an in-memory Optuna study from the trials
so far (finished ones with their objective values, running ones as running) and asks
Optuna's TPE sampler, seeded from the experiment's seed and the trial's index. A new
leader therefore continues a search exactly where the old one stopped, and the same
history and seed always give the same parameters. The leader asks through ``Studies``,
which keeps the study between questions, brought up to the records before each: the
same answers, without rebuilding the study each time. ``should_prune`` asks Optuna's
``MedianPruner`` the same way about one running trial; ``prune_by_medians`` gives its
answer from the per-step medians of the completed trials (``median_curve``) alone,
which is what agents ask.

Pure: reads a ``MeshView`` or plain values; no etcd, no gRPC, no clock (``Studies``
holds studies, nothing else). Optuna is
imported on first use (it costs about a second), so commands that only rank trials do
not pay for it.
"""

from __future__ import annotations

import bisect
import collections
import functools
import hashlib
import json
import math
import threading
from collections.abc import Hashable, Sequence
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


@functools.cache
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
    return [f for f in (_frozen_one(t, dists) for t in trials) if f is not None]


def _frozen_one(t: Trial, dists: dict[str, Any]) -> optuna.trial.FrozenTrial | None:
    """The trial as Optuna's, or None where it is not comparable with ``dists``: a
    parameter outside the space, or an objective Optuna does not take (NaN)."""
    optuna = _optuna()
    params = {k: v for k, v in t.params.items() if k in dists}
    if len(params) != len(dists):
        return None  # a trial of another parameter space: not comparable
    try:
        return optuna.trial.create_trial(  # type: ignore[no-any-return]
            params=params,
            distributions=dists,
            value=t.value if t.state == "complete" else None,
            intermediate_values=dict(t.intermediate),
            state=_state(t.state),
        )
    except ValueError:
        return None  # a value outside the space (set by hand): not comparable


def _state(state: TrialState) -> Any:
    return _states()[state]


@functools.cache
def _states() -> dict[str, Any]:
    states = _optuna().trial.TrialState
    return {"complete": states.COMPLETE, "pruned": states.PRUNED,
            "running": states.RUNNING, "failed": states.FAIL}


def _sampler(exp: Experiment, seed: int, index: int) -> Any:
    assert exp.samples is not None
    return _optuna().samplers.TPESampler(
        seed=trial_seed(seed, index),
        n_startup_trials=startup_trials(exp.samples),
        constant_liar=True,  # running trials count as bad: parallel asks spread out
    )


def suggest(exp: Experiment, seed: int, index: int, trials: list[Trial]) -> dict[str, Any]:
    """The parameters of trial ``index`` given the trials so far (TPE, seeded per index),
    from a study built for this one question. :class:`Studies` answers the same, from a
    study it keeps between questions."""
    study, dists = _study(exp, trials, _sampler(exp, seed, index))
    return _ask(exp, study, dists)


def _ask(exp: Experiment, study: optuna.Study, dists: dict[str, Any]) -> dict[str, Any]:
    asked = study.ask(dists)
    return {p.name: _plain(asked.params[p.name]) for p in exp.parameters}


@dataclass
class _Kept:
    """A study kept for one experiment, and what it holds: ``held[i]`` is the trial its
    i-th Optuna trial was last made from (comparable ones only, by index, as
    :func:`_study` adds them); ``skipped``, the trials found not comparable (a
    parameter outside the space, a NaN objective), by index, as last seen."""

    study: optuna.Study
    dists: dict[str, Any]
    goal: str
    held: list[Trial] = field(default_factory=list)
    skipped: dict[int, Trial] = field(default_factory=dict)


class Studies:
    """The Optuna studies of the adaptive searches the leader suggests trials for, kept
    between suggestions: :meth:`suggest` answers exactly as :func:`suggest` (a property
    test holds them equal), without building a study of every trial for each new one.

    Building it cost most of a suggestion: 4,096 trials took about 220 ms to validate
    and copy, TPE's own question about 30 (``scripts/bench_search.py``). A kept study is
    brought up to the records first, trial by trial: a running trial's new reports and
    its end are written into it, new trials appended. Anything else (a trial missing
    or in another place, one that ended differently or was reopened by ``retry``, one
    Optuna no longer takes or takes again, a trial asked for whose task was never
    written) rebuilds it from the records, so the answer never depends on what the
    study saw before. Thread-safe: the leader asks from
    a worker thread. Holds at most ``keep`` studies, the least recently asked dropped."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._kept: collections.OrderedDict[Hashable, _Kept] = collections.OrderedDict()
        self._trials: collections.OrderedDict[tuple[str, str], KeptTrials] = (
            collections.OrderedDict())
        self._lock = threading.Lock()
        self.rebuilt = 0  # studies built from the records (a first question included)

    def trials_of(self, view: MeshView, wid: str, exp: Experiment) -> list[Trial]:
        """``trials_of``'s trials, from those of the last look at the experiment (an
        unchanged trial is the same object, which :meth:`suggest` then need not compare).
        Reads the view: call it on the loop that changes it, not in the asking thread."""
        key = (wid, exp.name)
        kept = self._trials.pop(key, None)
        if kept is None or kept.exp is not exp:  # new, or its workflow record put again
            kept = KeptTrials(exp)
        self._trials[key] = kept
        while len(self._trials) > self.keep:
            self._trials.popitem(last=False)
        return kept.update(view, wid)[0]

    def suggest(self, key: Hashable, exp: Experiment, seed: int, index: int,
                trials: list[Trial]) -> dict[str, Any]:
        """The parameters of trial ``index`` of the experiment ``key`` names."""
        assert exp.objective is not None
        with self._lock:
            kept = self._kept.pop(key, None)
            dists = distributions(exp)
            if (kept is None or kept.dists != dists or kept.goal != exp.objective.goal
                    or not _bring_up(kept, trials)):
                kept = self._build(exp, trials)
            self._kept[key] = kept
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
            kept.study.sampler = _sampler(exp, seed, index)
            params = _ask(exp, kept.study, kept.dists)
            kept.held.append(Trial(index, params, "running"))  # the trial just asked
            return params

    def _build(self, exp: Experiment, trials: list[Trial]) -> _Kept:
        assert exp.objective is not None
        self.rebuilt += 1
        study, dists = _study(exp, [])
        kept = _Kept(study, dists, exp.objective.goal)
        if not _bring_up(kept, trials):
            raise AssertionError("a new study could not take the trials")  # pragma: no cover
        return kept


def _bring_up(kept: _Kept, trials: list[Trial]) -> bool:
    """Make ``kept``'s study hold ``trials`` as :func:`_study` would; False where only a
    rebuild can (see :class:`Studies`)."""
    held, storage = kept.held, kept.study._storage
    ids: list[int] | None = None
    pos = 0
    for t in trials:
        left_out = kept.skipped.get(t.index)
        if left_out is not None:  # not comparable when last seen
            if left_out is t or left_out == t:
                continue
            if _frozen_one(t, kept.dists) is not None:
                return False  # comparable now: its place is inside the study
            kept.skipped[t.index] = t
            continue
        if pos == len(held):
            frozen = _frozen_one(t, kept.dists)
            if frozen is None:
                kept.skipped[t.index] = t
                continue
            kept.study.add_trial(frozen)
            held.append(t)
            ids = None
        else:
            was = held[pos]
            if was is t:  # the same trial object (KeptTrials): nothing changed
                pos += 1
                continue
            if was.index != t.index or was.params != t.params:
                return False
            if was != t:
                if _frozen_one(t, kept.dists) is None:
                    return False  # no longer comparable (a NaN objective): left out
                if ids is None:
                    ids = [f._trial_id for f in storage.get_all_trials(
                        kept.study._study_id, deepcopy=False)]
                if not _advance(storage, ids[pos], was, t):
                    return False
                held[pos] = t
        pos += 1
    return pos == len(held)


def _advance(storage: Any, trial_id: int, was: Trial, now: Trial) -> bool:
    """Write into a study the reports and the end of a trial it holds as running;
    False for any other change (a finished trial is final in Optuna's storage)."""
    if was.state != "running" or not was.intermediate.keys() <= now.intermediate.keys():
        return False
    for step, value in now.intermediate.items():
        if was.intermediate.get(step) != value:
            storage.set_trial_intermediate_value(trial_id, step, value)
    if now.state != "running":
        values = [now.value] if now.state == "complete" else None
        storage.set_trial_state_values(trial_id, _state(now.state), values)
    return True


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


class KeptTrials:
    """An experiment's trials as ``trials_of`` gives them, kept between looks: a look
    reads, per trial, its task record, result, and decisive attempt's metrics and
    record (which says whether it was pruned), and makes again only the trials where one
    of those changed (the mirror
    replaces a record's object whenever it changes). An unchanged trial is the same
    object as at the last look. Reads the view: call it on the loop that changes it."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self._metric = exp.objective.metric if exp.objective else None
        self._marks: dict[int, tuple[object, ...]] = {}
        self._trials: dict[int, Trial] = {}

    def update(self, view: MeshView,
               wid: str) -> tuple[list[Trial], list[tuple[int, Trial | None]]]:
        """Every created trial by index (a new list), and the trials made again since
        the last look (index, the trial now; None for a task gone)."""
        settle_experiment(view, wid, self.exp.name)
        refs = view.task_refs(wid, self.exp.name)
        changed: list[tuple[int, Trial | None]] = []
        tasks, results, metrics_of, attempts = view.tasks, view.results, view.metrics, view.attempts
        for ref in refs:
            task = tasks[ref]
            result = results.get(ref)
            reported = metrics_of.get(ref)
            if result is not None:  # its decisive attempt: its metrics, its pruned mark
                metrics = reported.get(result.attempt) if reported else None
                attempt = attempts.get(ref, {}).get(result.attempt)
            else:
                metrics, attempt = reported[max(reported)] if reported else None, None
            old = self._marks.get(ref.index)
            if (old is not None and old[0] is task and old[1] is result and old[2] is metrics
                    and old[3] is attempt):
                continue
            self._marks[ref.index] = (task, result, metrics, attempt)
            trial = self._trials[ref.index] = _trial(view, ref, task.get("params", {}),
                                                     self._metric)
            changed.append((ref.index, trial))
        if len(self._marks) > len(refs):  # tasks gone (a workflow being purged)
            for index in self._marks.keys() - {ref.index for ref in refs}:
                del self._marks[index], self._trials[index]
                changed.append((index, None))
        return [self._trials[ref.index] for ref in refs], changed


class MedianCurve:
    """``median_curve``'s figures for one experiment of a view, kept between looks and
    brought up to the view trial by trial (a random test holds them equal to
    ``median_curve`` of ``trials_of``): only the trials made again (:class:`KeptTrials`)
    are counted again, and the medians of only the steps whose values changed are worked
    out again (per step, the counted trials' values are kept sorted). So a look after
    one more trial completed costs a pass over the trials' records, not over every
    trial's every report as ``median_curve`` does. Reads the view: call it on the loop
    that changes it."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self._kept = KeptTrials(exp)
        self._dists = distributions(exp) if exp.objective else {}
        self._counted: dict[int, dict[int, float]] = {}  # completed, comparable: values
        self._values: dict[int, list[float]] = {}  # step -> the values but NaN, sorted
        self._medians: dict[int, float] = {}
        self._dirty: set[int] = set()

    def update(self, view: MeshView, wid: str) -> tuple[int, dict[int, float]]:
        """``(completed trials, {step: median})`` of the experiment in ``view`` now."""
        if self.exp.objective is None:
            return 0, {}
        for index, trial in self._kept.update(view, wid)[1]:
            counted = (trial is not None and trial.state == "complete"
                       and _frozen_one(trial, self._dists) is not None)
            self._count(index, trial.intermediate if trial is not None and counted else None)
        for step in self._dirty:
            median = _median(self._values.get(step, []))
            if median is None:
                self._medians.pop(step, None)
            else:
                self._medians[step] = median
        self._dirty.clear()
        return len(self._counted), {s: self._medians[s] for s in sorted(self._medians)}

    def _count(self, index: int, values: dict[int, float] | None) -> None:
        """Count trial ``index`` with ``values`` (its reports), or not at all (None)."""
        old = self._counted.pop(index, None)
        for step, value in (old or {}).items():
            self._dirty.add(step)
            if value == value:  # not NaN
                held = self._values[step]
                del held[bisect.bisect_left(held, value)]
        if values is None:
            return
        self._counted[index] = values  # the trial's own: a Trial's reports never change
        for step, value in values.items():
            self._dirty.add(step)
            if value == value:
                bisect.insort(self._values.setdefault(step, []), value)


def _median(values: list[float]) -> float | None:
    """The median of sorted ``values`` exactly as ``median_curve`` works it out (NumPy's
    50th percentile, ``linear``: its two neighbours, interpolated at 0 for an odd count
    and 1/2 for an even one, by NumPy's formula), None where it is not finite or there
    is none. In plain floats: one step's median costs no NumPy call."""
    n = len(values)
    if n == 0:
        return None
    mid = (n - 1) // 2
    a, b = values[mid], values[min(mid + 1, n - 1)]
    t = 0.0 if n % 2 else 0.5
    diff = b - a  # NumPy's _lerp: from the nearer end, so that t = 1/2 is symmetric
    median = float(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    return median if math.isfinite(median) else None


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
