"""What a pruning check costs, with the trials and with the leader's medians (issue 23).

A search of ``--trials`` trials, each with a curve of ``--steps`` intermediate values
(three in four completed, the rest running), and one running trial to judge. Timed
with ``time.perf_counter`` (medians of ``--rounds``), in this one process:

- ``should_prune``: Optuna's ``MedianPruner`` on a study of all the trials, what every
  pruning check cost before the medians (and still the reference they answer like);
- ``median_curve``: the completed trials' per-step medians, which a node that sees every
  trial works out again when one of the experiment's tasks finished, and the leader at
  most every 2 s for the nodes that see no metrics (``agent/leader/prune_medians.py``);
- ``prune_by_medians``: what a check asks now, at each report of a running trial;
- the bytes of the ``prunemed/`` value that node reads, against the metrics records of
  the trials (about what reading the experiment's trials from etcd would move);
- in a ``MeshView`` fed the trials as a watch would, after one more trial completed: a
  look at the medians from every trial (``trials_of``, then ``median_curve``: what a
  node that sees every trial did before) against the medians kept (``MedianCurve``),
  and reading the trials alone, as a suggestion does (``trials_of`` against
  ``KeptTrials``).

    .venv/bin/python scripts/bench_prune_medians.py [--trials 100 1000 4096]
        [--steps 100] [--rounds 5] [--json]

Pure Python on one core, no etcd. It asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypermesh.recipe.recipe import Experiment, parse_recipe
from hypermesh.state import search
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.records import WorkflowRecord, dumps
from hypermesh.state.task_metrics import AttemptMetrics
from hypermesh.state.view import MeshView

RECIPE = """
experiments:
  e:
    parameters: {lr: {range: [0, 1]}}
    samples: %d
    objective: {metric: loss}
    pruning: median
    command: ["true {{lr}}"]
"""


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``rounds`` calls of ``fn``."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(trials: int, steps: int, rounds: int) -> dict[str, Any]:
    rng = random.Random(trials)
    exp = parse_recipe(RECIPE % trials).experiments[0]
    made = []
    for i in range(trials):
        state = "complete" if i % 4 else "running"
        base = rng.uniform(0.5, 2.0)
        made.append(search.Trial(i, {"lr": rng.random()}, state,
                                 base / steps if state == "complete" else None,
                                 {s: base / (s + 1) for s in range(steps)}))
    current = search.Trial(trials, {"lr": 0.5}, "running", None,
                           {s: 1.0 / (s + 1) for s in range(steps // 2)})
    search.should_prune(exp, made[:10], current)  # Optuna imported before timing
    completed, medians = search.median_curve(exp, made)
    record = AttemptMetrics()
    for s in range(steps):
        record.add_text(json.dumps({"loss": 1.0 / (s + 1), "step": s}))
    looks = looks_in_a_view(exp, made, rounds)
    return {
        "trials": trials,
        "steps": steps,
        "look_from_trials_ms": 1000 * looks[0],
        "look_kept_ms": 1000 * looks[1],
        "read_trials_ms": 1000 * looks[2],
        "read_kept_trials_ms": 1000 * looks[3],
        "should_prune_ms": 1000 * timed(lambda: search.should_prune(exp, made, current),
                                        rounds),
        "median_curve_ms": 1000 * timed(lambda: search.median_curve(exp, made), rounds),
        "prune_by_medians_ms": 1000 * timed(
            lambda: search.prune_by_medians(exp, completed, medians, current), rounds),
        "medians_bytes": len(search.medians_value(completed, medians)),
        "trials_metrics_bytes": trials * len(dumps(record.to_json())),
    }


class _View:
    """A mesh view fed keys as a watch would (``MeshView.apply``)."""

    def __init__(self, exp_recipe: str) -> None:
        self.ks = Keyspace("bench")
        self.view = MeshView(self.ks)
        self.rev = 0
        wf = WorkflowRecord(id="w", name="w", recipe=parse_recipe(exp_recipe), seed=1,
                            submitted_at=1.0, workdir="/tmp")
        self.put(self.ks.workflow("w"), wf.to_json())
        self.put(self.ks.workflow_state("w"), {"state": "running"})

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.rev += 1
        self.view.apply(key, dumps(value), self.rev, self.rev)

    def end(self, ref: TaskRef, value: float) -> None:
        self.put(self.ks.attempt(ref, 1), {"attempt": 1, "node": "n1", "state": "succeeded",
                                           "exit_code": 0, "reason": "exit"})
        self.put(self.ks.result(ref), {"state": "succeeded", "attempt": 1, "exit_code": 0,
                                       "ended_at": 5.0})


def looks_in_a_view(exp: Experiment, made: list[search.Trial],
                    rounds: int) -> tuple[float, ...]:
    """Median seconds of one look at the medians after one more trial completed, in a
    view holding ``made``: from every trial (``trials_of``, then ``median_curve``: what
    a look cost before), and from the medians kept since the last look
    (``MedianCurve``); then of reading the trials alone, as a suggestion does: every
    trial (``trials_of``) and those kept (``KeptTrials``). Each pair must agree."""
    fed = _View(RECIPE % len(made))
    exp = fed.view.workflows["w"].recipe.experiment(exp.name)
    for t in made:
        ref = TaskRef("w", exp.name, t.index)
        fed.put(fed.ks.task(ref), {"params": t.params})
        record = AttemptMetrics()
        for step, value in t.intermediate.items():
            record.add({"loss": value}, step)
        fed.put(fed.ks.metrics(ref, 1), record.to_json())
        if t.state == "complete":
            fed.end(ref, t.value or 0.0)
    curve = search.MedianCurve(exp)
    curve.update(fed.view, "w")
    trials = search.KeptTrials(exp)
    trials.update(fed.view, "w")
    running = [t for t in made if t.state == "running"]
    times: dict[str, list[float]] = {"whole": [], "kept": [], "read": [], "read kept": []}

    def timed_once(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        got = fn()
        times[name].append(time.perf_counter() - started)
        return got

    for t in running[:rounds]:
        fed.end(TaskRef("w", exp.name, t.index), 1.0)
        read = timed_once("read", lambda: search.trials_of(fed.view, "w", exp))
        expected = timed_once("whole", functools.partial(search.median_curve, exp, read))
        times["whole"][-1] += times["read"][-1]
        assert timed_once("kept", lambda: curve.update(fed.view, "w")) == expected
        assert timed_once("read kept", lambda: trials.update(fed.view, "w"))[0] == read
    return tuple(statistics.median(times[k]) for k in ("whole", "kept", "read", "read kept"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trials", type=int, nargs="+", default=[100, 1000, 4096])
    p.add_argument("--steps", type=int, default=100, help="reported steps per trial [100]")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per figure [5]")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    args = p.parse_args(argv)
    if min(args.trials) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--trials, --steps and --rounds must be at least 1")
    print(f"{'trials':>7} {'should_prune':>13} {'median_curve':>13} {'by_medians':>11} "
          f"{'medians B':>10} {'metrics B':>11} {'look, all':>10} {'look, kept':>11} "
          f"{'read, all':>10} {'read, kept':>11}", file=sys.stderr)
    for n in args.trials:
        r = measure(n, args.steps, args.rounds)
        print(f"{n:>7} {r['should_prune_ms']:>10.1f} ms {r['median_curve_ms']:>10.1f} ms "
              f"{r['prune_by_medians_ms']:>8.1f} ms {r['medians_bytes']:>10,} "
              f"{r['trials_metrics_bytes']:>11,} {r['look_from_trials_ms']:>7.1f} ms "
              f"{r['look_kept_ms']:>8.1f} ms {r['read_trials_ms']:>7.1f} ms "
              f"{r['read_kept_trials_ms']:>8.1f} ms", file=sys.stderr)
        if args.json:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
