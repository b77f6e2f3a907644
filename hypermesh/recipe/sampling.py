"""Expansion of an experiment into tasks: one parameter dict per task index (paper, §2.3).

Pure and seeded: ``expand(exp, seed)`` reads no clock and no global random state, so every
agent that expands the same experiment with the same seed gets the same tasks in the same
order, and a new leader can re-expand after a failover and agree with the old one.

Every task's parameters are a function of the experiment, the seed and the task's index
alone, so any range of indices can be drawn without drawing those before it:
``expand_more(exp, seed, start, count)`` is exactly ``expand(exp, seed)[start:start +
count]`` (and goes on past the planned count for samples added live), which is what
lets the leader write a large experiment page by page as slots free up.

Rules:

* With ``samples`` = n: task i takes combination ``perm_r(i mod |P|)`` of the Cartesian
  product P of the discrete parameters (declaration order), where r = i div |P| and
  ``perm_r`` is a permutation of P drawn for round r. Every whole round holds every
  combination once, and the last, partial round a random subset without replacement, so
  every combination appears floor(n/|P|) or ceil(n/|P|) times -- in every prefix too --
  in an order shuffled within each round. Each continuous parameter gets an independent
  draw per task (``uniform``, ``loguniform``, or ``int`` inclusive of both bounds).
* Without ``samples`` and with only discrete parameters: the full grid in product order (the
  last parameter varies fastest), no randomness -- the grid iterators used for sharded
  inference. Samples added live to such an experiment continue with shuffled rounds.
* No parameters: ``samples`` (default 1) empty dicts.

Values keep their types (an int from YAML stays an int), and each dict's keys follow the
declaration order of the parameters.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

from hypermesh.recipe.recipe import Experiment, Parameter

__all__ = ["expand", "expand_more", "experiment_seed", "grid_size", "planned_count"]


def _discrete(exp: Experiment) -> list[Parameter]:
    return [p for p in exp.parameters if p.kind == "values"]


def _continuous(exp: Experiment) -> list[Parameter]:
    return [p for p in exp.parameters if p.kind == "range"]


def grid_size(exp: Experiment, limit: int | None = None) -> int:
    """|P|: the number of combinations of the discrete parameters (1 when there are none).

    With ``limit``, multiplying stops once the product passes it: the result is then a
    number above ``limit`` (at most the product), never a product of thousands of digits.
    """
    size = 1
    for p in _discrete(exp):
        size *= len(p.values)
        if limit is not None and size > limit:
            break
    return size


def planned_count(exp: Experiment, limit: int | None = None) -> int:
    """How many tasks ``expand(exp, seed)`` returns, for any seed, without expanding
    (with ``limit``, any number above it once the count is: see ``grid_size``)."""
    if exp.samples is not None:
        return exp.samples
    if _continuous(exp):
        raise ValueError(f"experiment {exp.name!r} has range parameters but no 'samples'")
    return grid_size(exp, limit)


SHUFFLE_LIMIT = 1 << 16
"""Largest |P| whose rounds are drawn as shuffled lists; a larger product's rounds are
keyed permutations computed per index (``_KeyedPermutation``)."""

ROUNDS_PER_STREAM = 4096
"""About how many combinations one seeded stream shuffles (several rounds of a small
product share one), so that drawing a page seeds few generators."""

DRAWS_PER_STREAM = 1024
"""Tasks whose values of one continuous parameter come from one seeded stream."""


def expand(exp: Experiment, seed: int) -> list[dict[str, Any]]:
    """One parameter dict per task index; the same (exp, seed) always gives the same list."""
    return expand_more(exp, seed, 0, planned_count(exp))


def expand_more(exp: Experiment, seed: int, start: int, count: int) -> list[dict[str, Any]]:
    """The parameters of tasks ``start .. start+count-1``: exactly those ``expand`` gives
    them, whatever the page; past the planned count, those of samples added live
    (``hypermesh extend``). Costs about ``count`` draws, not ``start + count``."""
    if start < 0 or count < 0:
        raise ValueError(f"bad range of tasks: start {start}, count {count}")
    if exp.samples is None and _continuous(exp):
        raise ValueError(f"experiment {exp.name!r} has range parameters but no 'samples'")
    if not exp.parameters:
        return [{} for _ in range(count)]
    discrete = _discrete(exp)
    for p in discrete:
        if not p.values:
            raise ValueError(f"experiment {exp.name!r}: parameter {p.name!r} has no values")
    stop = start + count
    combos = _combinations(exp, seed, start, stop)
    columns = [_column(p, seed, start, stop) for p in _continuous(exp)]
    names = [p.name for p in exp.parameters]
    drawn = [i for i, p in enumerate(exp.parameters) if p.kind == "range"]
    rows = _Rows(exp.parameters, discrete)
    if not drawn:
        return [dict(zip(names, rows[c], strict=True)) for c in combos]
    tasks: list[dict[str, Any]] = []
    for offset, combination in enumerate(combos):
        row = list(rows[combination])
        for position, column in zip(drawn, columns, strict=True):
            row[position] = column[offset]
        tasks.append(dict(zip(names, row, strict=True)))
    return tasks


class _Rows:
    """The values of the discrete parameters of each combination, in declaration order
    (None where a range parameter goes), cached for the combinations seen."""

    def __init__(self, parameters: tuple[Parameter, ...], discrete: list[Parameter]) -> None:
        self.parameters = parameters
        self.discrete = discrete
        self.cache: dict[int, tuple[Any, ...]] = {}

    def __getitem__(self, combination: int) -> tuple[Any, ...]:
        row = self.cache.get(combination)
        if row is None:
            chosen = _combination(self.discrete, combination)
            row = tuple(chosen.get(p.name) for p in self.parameters)
            if len(self.cache) < 65536:
                self.cache[combination] = row
        return row


def _combinations(exp: Experiment, seed: int, start: int, stop: int) -> list[int]:
    """The combination of P (an index in product order) of each task in ``start..stop-1``."""
    size = grid_size(exp)
    grid = exp.samples is None  # the planned tasks are the grid in product order
    out: list[int] = []
    index = start
    while index < stop:
        if grid and index < size:
            end = min(stop, size)
            out.extend(range(index, end))
        elif size == 1:
            end = stop
            out.extend(0 for _ in range(index, end))
        elif size <= SHUFFLE_LIMIT:
            rounds = max(1, ROUNDS_PER_STREAM // size)  # rounds per stream
            stream, first = divmod(index // size, rounds)
            rng = random.Random(_derive(seed, "order", stream))
            end = min(stop, (stream + 1) * rounds * size)
            for r in range(rounds):
                round_start = (stream * rounds + r) * size
                if round_start >= end:
                    break
                order = list(range(size))
                rng.shuffle(order)
                if r < first:
                    continue
                lo, hi = max(index, round_start), min(end, round_start + size)
                out.extend(order[lo - round_start : hi - round_start])
        else:
            end = min(stop, (index // size + 1) * size)
            perm = _KeyedPermutation(size, _derive(seed, "order", index // size))
            out.extend(perm(i % size) for i in range(index, end))
        index = end
    return out


def _column(p: Parameter, seed: int, start: int, stop: int) -> list[float | int]:
    """The values of the range parameter ``p`` for tasks ``start..stop-1``."""
    if p.sampling == "int":
        assert p.low is not None and p.high is not None
        if math.ceil(p.low) > math.floor(p.high):
            raise ValueError(f"parameter {p.name!r}: no integer within [{p.low}, {p.high}]")
    out: list[float | int] = []
    for stream in range(start // DRAWS_PER_STREAM, (stop - 1) // DRAWS_PER_STREAM + 1):
        rng = random.Random(_derive(seed, f"param:{p.name}", stream))
        first = stream * DRAWS_PER_STREAM
        for i in range(first, min(stop, first + DRAWS_PER_STREAM)):
            value = _draw(p, rng)
            if i >= start:
                out.append(value)
    return out


def _derive(seed: int, what: str, n: int) -> int:
    """A 63-bit seed for stream ``n`` of ``what``, the same in every process."""
    digest = hashlib.sha256(f"hypermesh:{seed}:{what}:{n}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class _KeyedPermutation:
    """A pseudo-random permutation of ``range(size)`` computed per element (a keyed
    Feistel network over the next even power of two, cycle-walking back into range), for
    products too large to shuffle as a list."""

    ROUNDS = 4
    _M64 = (1 << 64) - 1

    def __init__(self, size: int, key: int) -> None:
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        self.key = key.to_bytes(8, "big")
        self.width = (self.half + 7) // 8
        self.keys = [_derive(key, "round", r) for r in range(self.ROUNDS)]

    def _round(self, r: int, value: int) -> int:
        if self.half <= 32:  # a splitmix64-style mix: no hashing for the usual sizes
            x = (value * 0x9E3779B97F4A7C15 + self.keys[r]) & self._M64
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & self._M64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & self._M64
            return (x ^ (x >> 31)) & self.mask
        data = self.key + bytes([r]) + value.to_bytes(self.width, "big")
        return int.from_bytes(hashlib.shake_256(data).digest(self.width + 1), "big") & self.mask

    def __call__(self, x: int) -> int:
        while True:
            left, right = x >> self.half, x & self.mask
            for r in range(self.ROUNDS):
                left, right = right, left ^ self._round(r, right)
            x = (left << self.half) | right
            if x < self.size:
                return x


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
