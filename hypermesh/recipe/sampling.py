"""Expansion of an experiment into tasks: one parameter dict per task index (paper, §2.3).

Pure and seeded: ``expand(exp, seed)`` reads no clock and no global random state, so every
agent that expands the same experiment with the same seed gets the same tasks in the same
order, and a new leader can re-expand after a failover and agree with the old one.

Rules:

* With ``samples`` = n: the Cartesian product P of the discrete parameters (declaration order)
  is drawn n times with minimal repetition -- every combination appears floor(n/|P|) or
  ceil(n/|P|) times (whole rounds of P, then a random subset of P without replacement for the
  remainder), shuffled. Each continuous parameter gets n independent draws (``uniform``,
  ``loguniform``, or ``int`` inclusive of both bounds), matched to the combinations by the
  shuffle.
* Without ``samples`` and with only discrete parameters: the full grid in product order (the
  last parameter varies fastest), no randomness -- the grid iterators used for sharded
  inference.
* No parameters: ``samples`` (default 1) empty dicts.

Values keep their types (an int from YAML stays an int), and each dict's keys follow the
declaration order of the parameters.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from dataclasses import replace
from typing import Any

from hypermesh.recipe.recipe import Experiment, Parameter

__all__ = ["expand", "expand_more", "experiment_seed", "grid_size", "planned_count"]


def _discrete(exp: Experiment) -> list[Parameter]:
    return [p for p in exp.parameters if p.kind == "values"]


def _continuous(exp: Experiment) -> list[Parameter]:
    return [p for p in exp.parameters if p.kind == "range"]


def grid_size(exp: Experiment) -> int:
    """|P|: the number of combinations of the discrete parameters (1 when there are none)."""
    return math.prod(len(p.values) for p in _discrete(exp))


def planned_count(exp: Experiment) -> int:
    """How many tasks ``expand(exp, seed)`` returns, for any seed, without expanding."""
    if exp.samples is not None:
        return exp.samples
    if _continuous(exp):
        raise ValueError(f"experiment {exp.name!r} has range parameters but no 'samples'")
    return grid_size(exp)


def expand(exp: Experiment, seed: int) -> list[dict[str, Any]]:
    """One parameter dict per task index; the same (exp, seed) always gives the same list."""
    discrete = _discrete(exp)
    if exp.samples is None:
        if _continuous(exp):
            raise ValueError(f"experiment {exp.name!r} has range parameters but no 'samples'")
        names = [p.name for p in discrete]
        return [dict(zip(names, combo, strict=True)) for combo in _product(discrete)]

    rng = random.Random(seed)
    n = exp.samples
    size = grid_size(exp)
    rounds, remainder = divmod(n, size)
    indices = [i for _ in range(rounds) for i in range(size)]
    indices.extend(rng.sample(range(size), remainder))
    rng.shuffle(indices)
    columns = {p.name: [_draw(p, rng) for _ in range(n)] for p in _continuous(exp)}

    tasks: list[dict[str, Any]] = []
    for task_index, combination in enumerate(indices):
        chosen = _combination(discrete, combination)
        tasks.append(
            {
                p.name: chosen[p.name] if p.kind == "values" else columns[p.name][task_index]
                for p in exp.parameters
            }
        )
    return tasks


def expand_more(exp: Experiment, seed: int, start: int, count: int) -> list[dict[str, Any]]:
    """Parameters of ``count`` tasks added to an experiment that has ``start`` tasks
    (``hypermesh extend``): drawn as ``samples: count`` (so discrete combinations repeat
    minimally within the added tasks) with a seed derived from ``seed`` and ``start``,
    so whoever writes them gets the same values."""
    digest = hashlib.sha256(f"hypermesh:{seed}:extend:{start}".encode()).digest()
    return expand(replace(exp, samples=count), int.from_bytes(digest[:8], "big") >> 1)


def _product(discrete: list[Parameter]) -> itertools.product[tuple[Any, ...]]:
    return itertools.product(*(p.values for p in discrete))


def _combination(discrete: list[Parameter], index: int) -> dict[str, Any]:
    """The ``index``-th element of the product of ``discrete``, in ``itertools.product`` order."""
    chosen: dict[str, Any] = {}
    for p in reversed(discrete):
        index, position = divmod(index, len(p.values))
        chosen[p.name] = p.values[position]
    return chosen


def _draw(p: Parameter, rng: random.Random) -> float | int:
    """One value of the range parameter ``p``, within [low, high]."""
    assert p.low is not None and p.high is not None
    if p.sampling == "int":
        return rng.randint(math.ceil(p.low), math.floor(p.high))
    if p.sampling == "loguniform":
        value = math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
        return min(max(value, p.low), p.high)  # exp(log(x)) may land one ulp outside
    return rng.uniform(p.low, p.high)


def experiment_seed(workflow_seed: int, exp: Experiment) -> int:
    """The seed to expand ``exp`` with: ``exp.seed`` if set, else one derived from the
    workflow seed and the experiment name.

    The derivation hashes with SHA-256 (not ``hash()``, which changes between processes), so
    every agent computes the same seed; it is a non-negative 63-bit int.
    """
    if exp.seed is not None:
        return exp.seed
    digest = hashlib.sha256(f"hypermesh:{workflow_seed}:{exp.name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
