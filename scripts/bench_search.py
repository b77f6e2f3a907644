"""Adaptive search (`sampling: tpe`) against random search, and what a suggestion costs.

Runs the mesh's own search code (``hypermesh.state.search``, the code the leader runs) with
trials simulated in process: the trial function is f(x, y) = (x-2)^2 + (y+1)^2 on
[-10, 10]^2, ``workers`` trials are unfinished at a time, and they finish in a random
order (a seeded shuffle per round: on a mesh the order depends on timing). Random search
is the recipe's default expansion with the same seed. Prints, per seed, random's best and
TPE's best over several completion orders; then the time of one suggestion as the number
of finished trials grows: rebuilding the study from the records, then TPE's ask
(``suggest``), against the leader's kept study brought up to the records (``Studies``).

    python scripts/bench_search.py [--samples 16] [--workers 2] [--seeds 10] [--orders 5]
        [--finished 10 100 1000 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from hypermesh.recipe.recipe import Experiment, parse_recipe
from hypermesh.recipe.sampling import expand
from hypermesh.state.search import Studies, Trial, next_indices, suggest

RECIPE = """
experiments:
  s:
    parameters: {{x: {{range: [-10, 10]}}, y: {{range: [-10, 10]}}}}
    samples: {samples}
    workers: {workers}
    sampling: tpe
    objective: {{metric: loss, goal: minimize}}
    command: ["true"]
"""


def loss(p: dict[str, Any]) -> float:
    return float((p["x"] - 2) ** 2 + (p["y"] + 1) ** 2)


def tpe_run(exp: Experiment, seed: int, order: int) -> float:
    assert exp.samples is not None
    rng = random.Random(order)
    trials: list[Trial] = []
    finished = 0
    while finished < exp.samples:
        for i in next_indices(exp.samples, exp.workers or 4, len(trials), finished):
            trials.append(Trial(i, suggest(exp, seed, i, trials), "running"))
        running = [k for k, t in enumerate(trials) if t.state == "running"]
        k = rng.choice(running)
        t = trials[k]
        trials[k] = Trial(t.index, t.params, "complete", loss(t.params))
        finished += 1
    return min(t.value for t in trials if t.value is not None)


def suggest_cost(exp: Experiment, finished: int, rounds: int = 5,
                 running: int = 64) -> tuple[float, float]:
    """Median seconds of one suggestion after ``finished`` trials (``running`` more
    unfinished), as the leader asks: one running trial has just completed, and the next
    trial is asked for; from a study built for the question (``suggest``, what every
    suggestion cost before the studies were kept) and from a kept one (``Studies``),
    alternating. They must give the same parameters."""
    rng = random.Random(finished)
    trials = []
    for i in range(finished + running):
        p = {"x": rng.uniform(-10, 10), "y": rng.uniform(-10, 10)}
        trials.append(Trial(i, p, "complete", loss(p)) if i < finished else Trial(i, p, "running"))
    studies = Studies()
    first = studies.suggest("s", exp, 1, len(trials), trials)  # it builds the study
    trials.append(Trial(len(trials), first, "running"))
    built: list[float] = []
    kept: list[float] = []
    for r in range(rounds):
        k = finished + r
        trials[k] = Trial(k, trials[k].params, "complete", loss(trials[k].params))
        index = len(trials)
        started = time.perf_counter()
        fresh = suggest(exp, 1, index, trials)
        built.append(time.perf_counter() - started)
        started = time.perf_counter()
        answer = studies.suggest("s", exp, 1, index, trials)
        kept.append(time.perf_counter() - started)
        assert answer == fresh, (answer, fresh)
        trials.append(Trial(index, answer, "running"))
    assert studies.rebuilt == 1, studies.rebuilt
    return statistics.median(built), statistics.median(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--orders", type=int, default=5)
    ap.add_argument("--finished", type=int, nargs="+", default=[10, 100, 1000, 4096],
                    help="finished trials to time a suggestion after")
    args = ap.parse_args()
    exp = parse_recipe(RECIPE.format(samples=args.samples, workers=args.workers)).experiments[0]
    print(f"budget {args.samples} trials, {args.workers} at a time; best loss (lower is better)")
    print(f"{'seed':>4} {'random':>9} {'tpe median':>11}  tpe per completion order")
    wins = 0
    for seed in range(1, args.seeds + 1):
        rnd = min(loss(p) for p in expand(exp, seed))
        tpe = [tpe_run(exp, seed, order) for order in range(args.orders)]
        wins += statistics.median(tpe) < rnd
        shown = " ".join(f"{v:.3g}" for v in tpe)
        print(f"{seed:>4} {rnd:>9.3f} {statistics.median(tpe):>11.3f}  [{shown}]")
    print(f"TPE's median beats random on {wins} of {args.seeds} seeds")
    print("\none suggestion by finished trials (64 more running; median of 5): "
          "a study built for it, a kept one")
    for n in args.finished:
        built, kept = suggest_cost(exp, n)
        print(f"  {n:>5} trials: {built * 1000:8.1f} ms {kept * 1000:8.1f} ms "
              f"({kept / built:.2f}x)")


if __name__ == "__main__":
    main()
