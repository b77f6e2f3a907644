"""Adaptive search (`sampling: tpe`) against random search, and what a suggestion costs.

Runs the mesh's own search code (``hypermesh.state.search``, the code the leader runs) with
trials simulated in process: the trial function is f(x, y) = (x-2)^2 + (y+1)^2 on
[-10, 10]^2, ``workers`` trials are unfinished at a time, and they finish in a random
order (a seeded shuffle per round: on a mesh the order depends on timing). Random search
is the recipe's default expansion with the same seed. Prints, per seed, random's best and
TPE's best over several completion orders; then the time of one ``suggest`` (rebuilding
the study from the records, then TPE's ask) as the number of finished trials grows.

    python scripts/bench_search.py [--samples 16] [--workers 2] [--seeds 10] [--orders 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from hypermesh.recipe.recipe import Experiment, parse_recipe
from hypermesh.recipe.sampling import expand
from hypermesh.state.search import Trial, next_indices, suggest

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


def suggest_cost(exp: Experiment, finished: int, rounds: int = 3) -> float:
    rng = random.Random(finished)
    trials = []
    for i in range(finished):
        p = {"x": rng.uniform(-10, 10), "y": rng.uniform(-10, 10)}
        trials.append(Trial(i, p, "complete", loss(p)))
    times = []
    for r in range(rounds):
        started = time.perf_counter()
        suggest(exp, 1, finished + r, trials)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--orders", type=int, default=5)
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
    print("\nsuggest() cost by finished trials (median of 3):")
    for n in (10, 100, 1000, 3000):
        print(f"  {n:>5} trials: {suggest_cost(exp, n) * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
