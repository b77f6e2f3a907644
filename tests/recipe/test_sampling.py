"""Task expansion (paper §2.3): minimal repetition, ranges, grids, seeds."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from hypermesh.recipe.recipe import Experiment, Parameter, load_recipe
from hypermesh.recipe.sampling import (
    expand,
    expand_more,
    experiment_seed,
    grid_size,
    planned_count,
)

ROOT = Path(__file__).resolve().parents[2]


def exp(*parameters: Parameter, samples: int | None = None, seed: int | None = None) -> Experiment:
    return Experiment(
        name="e", command=("true",), parameters=parameters, samples=samples, seed=seed
    )


LETTERS = Parameter("letter", "values", values=("a", "b", "c"))
NUMBERS = Parameter("number", "values", values=(1, 2))
LR = Parameter("lr", "range", low=0.1, high=0.3)


def test_figure1_expands_to_1000_tasks_in_range() -> None:
    (mnist,) = load_recipe(ROOT / "examples" / "figure1.yaml").experiments
    tasks = expand(mnist, seed=42)
    assert len(tasks) == 1000 == planned_count(mnist)
    assert all(list(t) == ["lr"] for t in tasks)
    assert all(isinstance(t["lr"], float) and 0.1 <= t["lr"] <= 0.3 for t in tasks)
    assert len({t["lr"] for t in tasks}) == 1000
    # uniform over [0.1, 0.3]: the draws spread across the whole interval
    assert min(t["lr"] for t in tasks) < 0.11 and max(t["lr"] for t in tasks) > 0.29


@pytest.mark.parametrize("samples", [1, 5, 6, 7, 20, 100])
def test_minimal_repetition(samples: int) -> None:
    e = exp(LETTERS, NUMBERS, samples=samples)
    tasks = expand(e, seed=3)
    assert len(tasks) == samples == planned_count(e)
    counts = Counter((t["letter"], t["number"]) for t in tasks)
    size = 6
    low, high = samples // size, -(-samples // size)
    every = [counts.get(c, 0) for c in itertools.product("abc", (1, 2))]
    assert all(low <= n <= high for n in every), counts
    assert sum(every) == samples


def test_samples_20_over_6_combinations_gives_3_or_4_each() -> None:
    counts = Counter(
        (t["letter"], t["number"]) for t in expand(exp(LETTERS, NUMBERS, samples=20), seed=9)
    )
    assert len(counts) == 6
    assert sorted(counts.values()) == [3, 3, 3, 3, 4, 4]


def test_samples_equal_to_grid_gives_each_once_shuffled() -> None:
    e = exp(LETTERS, NUMBERS, samples=6)
    full = [dict(letter=a, number=n) for a, n in itertools.product("abc", (1, 2))]
    orders = set()
    for seed in range(10):
        tasks = expand(e, seed)
        assert sorted(tasks, key=lambda t: (t["letter"], t["number"])) == full
        orders.add(tuple((t["letter"], t["number"]) for t in tasks))
    assert len(orders) > 1  # shuffled, not product order every time


def test_grid_without_samples_is_full_product_in_order() -> None:
    e = exp(LETTERS, NUMBERS)
    expected = [{"letter": a, "number": n} for a, n in itertools.product("abc", (1, 2))]
    assert expand(e, seed=1) == expected
    assert expand(e, seed=2) == expected
    assert planned_count(e) == grid_size(e) == 6


def test_no_parameters() -> None:
    assert expand(exp(), seed=1) == [{}]
    assert planned_count(exp()) == 1
    assert expand(exp(samples=4), seed=1) == [{}, {}, {}, {}]
    assert planned_count(exp(samples=4)) == 4


def test_range_without_samples_is_refused() -> None:
    with pytest.raises(ValueError):
        expand(exp(LR), seed=1)
    with pytest.raises(ValueError):
        planned_count(exp(LR))


def test_mixed_parameters_keep_declaration_order_and_types() -> None:
    flags = Parameter("flag", "values", values=(True, False))
    steps = Parameter("steps", "range", low=1, high=3, sampling="int")
    tasks = expand(exp(flags, LR, NUMBERS, steps, samples=50), seed=5)
    for t in tasks:
        assert list(t) == ["flag", "lr", "number", "steps"]
        assert type(t["flag"]) is bool and type(t["number"]) is int
        assert type(t["lr"]) is float and type(t["steps"]) is int
    # 50 draws over the 4 discrete combinations: each appears 12 or 13 times
    combos = Counter((t["flag"], t["number"]) for t in tasks)
    assert len(combos) == 4 and set(combos.values()) <= {12, 13}


def test_int_sampling_is_inclusive_and_hits_both_ends() -> None:
    tasks = expand(exp(Parameter("k", "range", low=2, high=5, sampling="int"), samples=400), 7)
    values = {t["k"] for t in tasks}
    assert values == {2, 3, 4, 5}
    assert all(type(t["k"]) is int for t in tasks)


def test_int_sampling_with_equal_bounds() -> None:
    tasks = expand(exp(Parameter("k", "range", low=3, high=3, sampling="int"), samples=5), 1)
    assert [t["k"] for t in tasks] == [3] * 5


def test_loguniform_stays_in_bounds_and_spreads_over_decades() -> None:
    p = Parameter("lr", "range", low=1e-4, high=1e-1, sampling="loguniform")
    values = [t["lr"] for t in expand(exp(p, samples=3000), seed=11)]
    assert all(1e-4 <= v <= 1e-1 for v in values)
    decades = Counter(math.floor(math.log10(v)) for v in values)
    # log-uniform: each of the three decades gets about a third (uniform would put ~90% in one)
    for decade in (-4, -3, -2):
        assert 800 < decades[decade] < 1200, decades


def test_same_seed_same_tasks_different_seed_different_tasks() -> None:
    e = exp(LETTERS, LR, samples=30)
    assert expand(e, seed=123) == expand(e, seed=123)
    assert expand(e, seed=123) != expand(e, seed=124)


def test_expansion_uses_no_global_random_state() -> None:
    import random

    e = exp(LETTERS, LR, samples=10)
    random.seed(1)
    first = expand(e, seed=5)
    random.seed(2)
    assert expand(e, seed=5) == first


def test_experiment_seed() -> None:
    a = Experiment(name="a", command=("true",))
    b = Experiment(name="b", command=("true",))
    assert experiment_seed(1, a) == experiment_seed(1, a)
    assert experiment_seed(1, a) != experiment_seed(1, b)
    assert experiment_seed(1, a) != experiment_seed(2, a)
    assert experiment_seed(1, a) >= 0
    assert experiment_seed(1, exp(seed=99)) == 99


def test_experiment_seed_is_stable_across_processes() -> None:
    code = (
        "from hypermesh.recipe.recipe import Experiment;"
        "from hypermesh.recipe.sampling import experiment_seed;"
        "print(experiment_seed(7, Experiment(name='mnist', command=('x',))))"
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    assert outputs == {str(experiment_seed(7, Experiment(name="mnist", command=("x",))))}


# ---------------------------------------------------------------- pages (issue 22)
PAGED = [
    exp(LETTERS, NUMBERS, samples=1000),  # rounds of 6, a partial last one
    exp(LETTERS, LR, NUMBERS, samples=3001),  # several streams of rounds and of draws
    exp(Parameter("k", "range", low=2, high=9, sampling="int"), samples=2500),
    exp(LETTERS, NUMBERS),  # the grid in product order, then shuffled rounds past it
    exp(Parameter("x", "values", values=tuple(range(70_000))), samples=3_000),  # keyed
    exp(samples=50),
]


@pytest.mark.parametrize("e", PAGED, ids=lambda e: str(planned_count(e)))
def test_any_page_is_the_same_as_the_full_expansion(e: Experiment) -> None:
    """``expand_more`` draws a range of tasks without those before it, and gets exactly
    what full expansion gives them, wherever the page starts and ends."""
    n = planned_count(e)
    full = expand(e, seed=17)
    assert len(full) == n
    cuts = sorted({0, n, 1, n // 3, n // 2 + 5, n - 1, 1023, 1024, 4095, 4097} & set(range(n + 1)))
    for lo, hi in itertools.pairwise(cuts):
        assert expand_more(e, 17, lo, hi - lo) == full[lo:hi], (lo, hi)
    # Pages of every size from 0 cover it too, and past the end come added samples.
    for size in (1, 7, 1000) if n <= 1000 else (997,):
        paged = [t for lo in range(0, n, size) for t in expand_more(e, 17, lo, min(size, n - lo))]
        assert paged == full, size
    more = expand_more(e, 17, n, 40)
    assert len(more) == 40 and expand_more(e, 17, n + 10, 5) == more[10:15]


def test_added_samples_continue_minimal_repetition() -> None:
    """Samples added live (past the planned count) continue the rounds: over the whole
    experiment every combination still appears floor or ceil(n/|P|) times."""
    e = exp(LETTERS, NUMBERS, samples=7)
    tasks = expand(e, seed=2) + expand_more(e, 2, 7, 4) + expand_more(e, 2, 11, 6)
    counts = Counter((t["letter"], t["number"]) for t in tasks)
    assert sorted(counts.values()) == [2, 3, 3, 3, 3, 3]  # 17 over 6 combinations


def test_a_product_too_large_to_list_is_drawn_per_index() -> None:
    """64 two-valued parameters (2**64 combinations): three samples are three distinct
    combinations, drawn without listing the product."""
    params = tuple(Parameter(f"p{i}", "values", values=(0, 1)) for i in range(64))
    tasks = expand(exp(*params, samples=3), seed=4)
    assert len({tuple(t.values()) for t in tasks}) == 3
    assert expand_more(exp(*params, samples=3), 4, 1, 2) == tasks[1:]


def test_a_parameter_without_values_or_integers_is_refused_at_expansion() -> None:
    with pytest.raises(ValueError, match="has no values"):
        expand(exp(Parameter("x", "values", values=()), samples=3), seed=1)
    with pytest.raises(ValueError, match="no integer"):
        expand(exp(Parameter("k", "range", low=2.2, high=2.8, sampling="int"), samples=2), 1)
