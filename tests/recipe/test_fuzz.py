"""Fuzzing the recipe loader: whatever the text, ``parse_recipe`` returns a ``Recipe`` or
raises ``RecipeError``, and quickly.

Two sources of input: a seeded mutator that rewrites the example recipes thousands of
times (values swapped for nasty ones, fields dropped, added and wrapped, text cut, spliced
and sprinkled with YAML syntax), and a table of targeted inputs, each one a crash or a
hang the loader once had (deep nesting, huge numbers and sizes, long ``after`` chains,
alias bombs, lone surrogates). Time is CPU time of this process (``time.process_time``),
so a loaded machine slows the test without failing it. Accepted recipes must also plan
their tasks quickly (``plan_tasks``) and survive their stored (JSON) form.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from hypermesh.errors import RecipeError
from hypermesh.recipe.limits import MAX_EXPERIMENTS
from hypermesh.recipe.plan import plan_tasks
from hypermesh.recipe.recipe import Recipe, parse_recipe
from hypermesh.recipe.sampling import expand

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(ROOT.glob("examples/**/*.yaml"))
SEED = 20261125
MUTATIONS = 3000
CAP = 1_000_000  # the mesh's default max-workflow-tasks
LIMIT_S = 1.0  # the most one recipe may take to accept or reject (CPU seconds)


@contextlib.contextmanager
def cpu_clock() -> Iterator[list[float]]:
    """CPU seconds spent inside the block, into the yielded list. The objects the test
    process already holds are frozen out of the collector meanwhile: a full collection
    late in the suite walks every one of them, which is the suite's cost, not this
    recipe's (the objects the recipe makes are still collected and counted)."""
    spent: list[float] = []
    gc.freeze()
    start = time.process_time()
    try:
        yield spent
    finally:
        spent.append(time.process_time() - start)
        gc.unfreeze()
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

FIELDS = (
    "experiments", "name", "seed", "env", "workdir", "command", "parameters", "samples",
    "workers", "hardware", "after", "retries", "timeout", "framework", "image", "data",
    "pools", "objective", "sampling", "pruning", "nodes", "inputs", "prefer_pools", "batch",
    "range", "values", "gpu", "gpus", "cpus", "memory", "gpu_memory", "metric", "goal", "<<",
)


def _deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


NASTY: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 3, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**99,
    10**4299, 0.5, -0.0, 1e308, -1e308, float("inf"), float("-inf"), float("nan"),
    "", " ", "x" * 1000, "x" * 70_000, "λ", "\U0001d518nicode 🙂", "\u202eevil", "a\u0000b", "\x7f",
    "{{lr}}", "'{{lr}}'", "\"{{ lr }}\"", "{{", "}}", "{{1x}}", "\\{{lr}}", "{{attempt}}",
    "16GiB", "1e999999GiB", "1e99999999GiB", "1e999999", "-5GiB", "0.5B", "1025PiB",
    "1h30m", "30m1h", "1e308s", "9" * 400 + "s", "-1s", "0s", "250ms",
    "9" * 4301, "0.1-0.3", "0.3-0.1", "1-1e400", "-1--2", "0-0", "1e-400-1",
    "k80", "tpe", "random", "median", "minimize", "maximize", "uniform", "loguniform", "int",
    "mnist", "prep", "sweep", "infer", "a@b", "data@v1", "../x", "/abs", "raw/x/{{shard}}",
    "line\nbreak", "key: value", "- item", "&anchor", "*alias", "!!int", "@", "`",
    [], {}, [1, 2], [0.1, 0.3], ["a", "a"], [[1]], [None], [{}], {"a": None},
    {"metric": "x", "goal": "up"}, {"metric": "loss"}, {"values": [1, 2]},
    {"range": "0.1-0.3", "sampling": "loguniform"}, {"range": [1, 5], "sampling": "int"},
    {"gpu": "k80", "gpus": 0.5, "gpu_memory": "8GiB"},
    list(range(2000)), [f"s{i}" for i in range(500)], _deep(40), _deep(12, "x"),
)


# ------------------------------------------------------------------ the mutator

def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a node of ``tree`` (a dict/list structure), root first."""
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, (*prefix, i))


def _get(tree: Any, path: Sequence[Any]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _set(tree: Any, path: Sequence[Any], value: Any) -> Any:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def _mutate_tree(rng: random.Random, tree: Any) -> Any:
    """``tree`` with one to four structural changes at random places."""
    for _ in range(rng.randint(1, 4)):
        paths = list(_paths(tree))
        path = rng.choice(paths)
        target = _get(tree, path)
        op = rng.randrange(8)
        if op == 0 and path:  # drop it
            del _get(tree, path[:-1])[path[-1]]
        elif op == 1 and isinstance(target, dict):  # add a field, known or not
            key = rng.choice((*FIELDS, "wokers", "", "ünï", "a" * 300, "1", "e0"))
            target[key] = copy.deepcopy(rng.choice(NASTY))
        elif op == 2:  # wrap it
            tree = _set(tree, path, rng.choice(([target], {"k": target}, [target, target])))
        elif op == 3 and isinstance(target, dict) and target:  # rename a key
            key = rng.choice(list(target))
            target[rng.choice((*FIELDS, key.upper(), key + "x", "x" * 70))] = target.pop(key)
        elif op == 4 and isinstance(tree, dict) and isinstance(tree.get("experiments"), dict):
            names = list(tree["experiments"]) or ["e"]
            exp = tree["experiments"].get(rng.choice(names))
            if isinstance(exp, dict):  # after: some names, known and not, maybe itself
                exp["after"] = [rng.choice((*names, "nope", "")) for _ in range(rng.randint(0, 4))]
        elif op == 5 and isinstance(tree, dict) and isinstance(tree.get("experiments"), dict):
            experiments = tree["experiments"]  # more experiments, chained
            for i in range(rng.choice((2, 30))):
                experiments[f"x{i}"] = {"command": "true", "after": [f"x{i - 1}" if i else "x0"]}
        else:  # a nasty value in its place
            tree = _set(tree, path, copy.deepcopy(rng.choice(NASTY)))
    return tree


SYNTAX = (":", ": ", "-", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "<<: *a", "!!int ",
          "!!binary ", "!!python/object:os.system ", "?", "|", ">", "#", "'", '"', "\t",
          "\n", "\n  ", "%YAML 1.1\n", "---\n", "...\n", "\\", "\u00a0", "\ufeff", "\ud800",
          "9" * 4400, "{{", "}}", "🙂")


def _mutate_text(rng: random.Random, text: str) -> str:
    """``text`` with one to three edits: a snippet of YAML syntax, a cut, a spliced line."""
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(text) + 1)
        op = rng.randrange(4)
        if op == 0:
            text = text[:at] + rng.choice(SYNTAX) + text[at:]
        elif op == 1:
            text = text[:at] + text[at + rng.randint(1, 40):]
        elif op == 2:
            lines = text.splitlines(keepends=True) or [""]
            i = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
            text = "".join(lines)
        else:
            text = text[:at]
    return text


def _dump(rng: random.Random, tree: Any) -> str:
    try:
        return yaml.dump(tree, Dumper=DUMPER, allow_unicode=rng.random() < 0.5,
                         sort_keys=False, default_flow_style=rng.choice((False, None, True)),
                         width=10**9)
    except (yaml.YAMLError, ValueError, RecursionError):
        return "{}"


def _mutations(n: int, seed: int) -> Iterator[tuple[str, tuple[str, ...]]]:
    """``n`` (text, overrides) pairs mutated from the examples, seeded."""
    rng = random.Random(seed)
    sources = [path.read_text() for path in EXAMPLES]
    trees = [yaml.safe_load(text) for text in sources]
    for _ in range(n):
        i = rng.randrange(len(sources))
        kind = rng.random()
        if kind < 0.55:
            text = _dump(rng, _mutate_tree(rng, copy.deepcopy(trees[i])))
        elif kind < 0.85:
            text = _mutate_text(rng, sources[i])
        else:
            text = _mutate_text(rng, _dump(rng, _mutate_tree(rng, copy.deepcopy(trees[i]))))
        overrides: tuple[str, ...] = ()
        if rng.random() < 0.15:
            names = list(trees[i]["experiments"])
            field = rng.choice((*FIELDS, "hardware.gpu", "a.b.c"))
            value = rng.choice(("1", "-1", "[1, 2]", "{a: 1}", "9" * 5000, "[" * 3000, "x",
                                "\udcff", "&a [*a]", "'{{x}}'", ""))
            overrides = (f"{rng.choice((*names, 'nope'))}.{field}={value}",)
        yield text, overrides


# ------------------------------------------------------------------ the property

class Outcome:
    """What one input did: accepted or rejected, and the CPU time it took."""

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected = 0
        self.slowest = 0.0
        self.slowest_input = ""
        self.total = 0.0


def check_one(text: str, overrides: Sequence[str], outcome: Outcome) -> Recipe | None:
    """Parse ``text``: a ``Recipe`` or a ``RecipeError`` with problems, within ``LIMIT_S``;
    an accepted recipe must also plan, store and load back within it."""
    recipe: Recipe | None = None
    with cpu_clock() as spent:
        try:
            recipe = parse_recipe(text, "fuzz.yaml", overrides)
        except RecipeError as exc:
            assert exc.problems, "a RecipeError without problems"
            assert all(p.source == "fuzz.yaml" for p in exc.problems)
            outcome.rejected += 1
        else:
            outcome.accepted += 1
            plan = plan_tasks(recipe, CAP)
            assert plan.total >= len(recipe.experiments)
            assert Recipe.from_json(recipe.to_json()) == recipe
            for exp in recipe.experiments:
                if plan.counts[exp.name] <= 100:  # what the leader does with it first
                    assert len(expand(exp, 1)) == plan.counts[exp.name]
    (elapsed,) = spent
    outcome.total += elapsed
    if elapsed > outcome.slowest:
        outcome.slowest, outcome.slowest_input = elapsed, text[:200]
    assert elapsed < LIMIT_S, f"{elapsed:.2f} s for {text[:200]!r} (overrides {overrides})"
    return recipe


def test_thousands_of_mutated_examples_raise_only_recipe_errors() -> None:
    outcome = Outcome()
    for text, overrides in _mutations(MUTATIONS, SEED):
        check_one(text, overrides, outcome)
    print(f"\n{MUTATIONS} mutations: {outcome.accepted} accepted, {outcome.rejected} rejected, "
          f"{outcome.total:.1f} CPU s, slowest {outcome.slowest * 1000:.0f} ms")
    # The mutator must exercise both sides: most mutations break a recipe, some do not.
    assert outcome.rejected > MUTATIONS // 2
    assert outcome.accepted > MUTATIONS // 50


# ------------------------------------------------------------------ targeted inputs

BASE = "experiments:\n  a:\n    command: x\n"


def _exp(body: str, command: str = "x") -> str:
    return f"experiments:\n  a:\n    command: {command}\n{body}"


def _bomb(levels: int, width: int) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n" + BASE


def _chain(n: int, cycle: bool) -> str:
    lines = ["experiments:"]
    for i in range(n):
        after = f"e{i - 1}" if i else (f"e{n - 1}" if cycle else None)
        lines.append(f"  e{i}:\n    command: x" + (f"\n    after: {after}" if after else ""))
    return "\n".join(lines) + "\n"


def _grid(params: int, values: int, samples: int | None = None) -> str:
    body = f"    samples: {samples}\n" if samples else ""
    body += "    parameters:\n" + "".join(
        f"      p{i}: {{values: [{', '.join(str(v) for v in range(values))}]}}\n"
        for i in range(params)
    )
    return _exp(body)


def _many_values(n: int) -> str:
    return _exp("    parameters:\n      s: {values: [" + ", ".join(map(str, range(n))) + "]}\n",
                "x {{s}}")


# (name, text, overrides, a fragment of the expected problem, or None when accepted)
TARGETED: list[tuple[str, str, tuple[str, ...], str | None]] = [
    # Recursion: nesting, aliases, `after` chains.
    ("deep flow list", _exp("    env: " + "[" * 5000 + "]" * 5000 + "\n"), (), "YAML"),
    ("deep flow map", _exp("    env: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n"), (), ""),
    ("deep block list", _exp("    env:\n      " + "- " * 900 + "x\n"), (), "levels deep"),
    ("deep by aliases", "".join(f"a{i}: &a{i} [[[[[[[[*a{i - 1}]]]]]]]]\n" if i else
                                "a0: &a0 x\n" for i in range(8)) + BASE, (), "levels deep"),
    ("deep override value", BASE, ("a.env=" + "[" * 40 + "]" * 40,), "levels deep"),
    ("deep override key", BASE, ("a." + ".".join(["k"] * 10_000) + "=1",), "unknown field"),
    ("1,000 after chain", _chain(1000, cycle=False), (), None),
    ("1,000 after cycle", _chain(1000, cycle=True), (), "dependency cycle: e0 -> e999"),
    ("too many experiments", _chain(MAX_EXPERIMENTS + 1, cycle=False), (), "at most 1000"),
    ("recursive alias", _exp("    after: &a [*a]\n"), (), "refers to the node"),
    # Alias bombs.
    ("billion laughs", _bomb(9, 10), (), "keys and values (aliases expanded)"),
    ("wide bomb", _bomb(3, 400), (), "keys and values (aliases expanded)"),
    ("long-string bomb", "s: &s " + "x" * 60_000 + "\n" + _exp("    env: [" + ", ".join(
        ["*s"] * 20) + "]\n"), (), "beyond 1,048,576 characters"),
    ("override bomb", BASE, ("a.env=" + _bomb(6, 10).split("experiments")[0]
                             .replace("\n", ", ").join("{}"),), "keys and values"),
    # Numbers: Python's 4,300-digit int limit, float overflow, decimal overflow.
    ("4,301-digit samples", _exp("    samples: " + "9" * 4301 + "\n"), (), "a number of 4,301"),
    ("4,301-digit seed", "seed: " + "9" * 4301 + "\n" + BASE, (), "a number of 4,301"),
    ("4,301-digit value", _exp("    parameters: {p: {values: [" + "9" * 4301 + "]}}\n"), (),
     "a number of"),
    ("4,301-digit override", BASE, ("a.samples=" + "9" * 4301,), "a number of 4,301"),
    ("100-digit gpus", _exp("    hardware: {gpus: " + "9" * 100 + "}\n"), (), "at most 1024"),
    ("float gpus overflow", _exp("    hardware: {gpus: '1e400'}\n"), (), "expected a number"),
    ("2**64 samples", _exp(f"    samples: {2**64}\n"), (), "at most 1000000000"),
    ("2**64 seed", f"seed: {2**64}\n" + BASE, (), "at most 9223372036854775807"),
    ("huge workers", _exp("    workers: 1000000000\n"), (), "at most 10000"),
    ("!!int abc", _exp("    samples: !!int abc\n"), (), "cannot read value"),
    ("!!float x", _exp("    samples: !!float x\n"), (), "cannot read value"),
    ("!!timestamp x", _exp("    samples: !!timestamp x\n"), (), "cannot read value"),
    # Sizes and durations.
    ("memory 1e99999999GiB", _exp("    hardware: {memory: 1e99999999GiB}\n"), (), "1 EiB"),
    ("memory 1e999999", _exp("    hardware: {memory: 1e999999}\n"), (), "1 EiB"),
    ("memory 10**30", _exp(f"    hardware: {{memory: {10**30}}}\n"), (), "1 EiB"),
    ("memory 1025PiB", _exp("    hardware: {memory: 1025PiB}\n"), (), "1 EiB"),
    ("memory 1024PiB", _exp("    hardware: {memory: 1024PiB}\n"), (), None),
    ("timeout 1e308", _exp("    timeout: 1.0e+308\n"), (), "at most 365d"),
    ("timeout 400 digits", _exp("    timeout: " + "9" * 400 + "s\n"), (), "must be finite"),
    # Task counts: accepted by the loader, over the cap when planned.
    ("grid of 10**40", _grid(40, 10), (), None),
    ("samples over a 10**40 grid", _grid(40, 10, samples=5), (), None),
    ("tpe budget", _exp("    sampling: tpe\n    samples: 1000000000\n    objective: {metric: l}\n"
                        "    parameters: {lr: {range: 0.1-0.3}}\n", "x {{lr}}"), (), None),
    # Size: text, values, keys, strings, environments.
    ("2 MiB of text", _exp("", "x" * 2 * 1024 * 1024), (), "the text is"),
    ("64 KiB + 1 value", _exp("", "x" * (64 * 1024 + 1)), (), "at most 65,536"),
    ("29,000 values", _many_values(29_000), (), None),
    ("30,001 values", _many_values(30_001), (), "more than 30,000 keys and values"),
    ("12,000 unknown fields", BASE + "".join(f"    zz{i}: 1\n" for i in range(12_000)), (),
     "unknown field"),
    ("6,000 unknown placeholders", _exp("", "'" + "".join(f"{{{{p{i}}}}}" for i in range(6000))
                                        + "'"), (), "unknown template variable"),
    ("10,000 unknown after", _exp("    after: [" + ", ".join(f"z{i}" for i in range(10_000))
                                  + "]\n"), (), "unknown experiment"),
    ("10,000 pools", _exp("    pools: [" + ", ".join(f"p{i}" for i in range(10_000)) + "]\n"
                          "    prefer_pools: [" + ", ".join(f"q{i}" for i in range(5_000))
                          + "]\n"), (), "is not one of 'pools'"),
    ("env copied 1,000 times", "env: {BIG: " + "x" * 2000 + "}\n" + _chain(1000, cycle=False),
     (), "environments"),
    # Text that is not YAML, or not Unicode.
    ("lone surrogate", _exp("", "x\ud800"), (), "not Unicode"),
    ("surrogate override", BASE, ("a.command=\udcff",), "not Unicode"),
    ("NUL", _exp("", "x\x00"), (), "control characters"),
    ("tabs", "experiments:\n\ta:\n\t\tcommand: x\n", (), "YAML syntax error"),
    ("two documents", BASE + "---\n" + BASE, (), "single document"),
    ("unicode names", "experiments:\n  ëxp🙂:\n    command: x\n    env: {ÄB: 1}\n", (),
     "experiment names"),
]


@pytest.mark.parametrize(("text", "overrides", "expected"),
                         [pytest.param(t, o, e, id=name) for name, t, o, e in TARGETED])
def test_targeted_inputs_are_handled_within_a_second(
    text: str, overrides: tuple[str, ...], expected: str | None
) -> None:
    outcome = Outcome()
    if expected is None:
        assert check_one(text, overrides, outcome) is not None
        return
    with cpu_clock() as spent, pytest.raises(RecipeError) as info:
        parse_recipe(text, "fuzz.yaml", overrides)
    assert spent[0] < LIMIT_S
    assert expected in str(info.value), str(info.value)[:2000]


def test_a_grid_past_the_cap_is_counted_without_multiplying_it_out() -> None:
    recipe = parse_recipe(_grid(1000, 2))  # 2**1000 combinations
    start = time.process_time()
    plan = plan_tasks(recipe, CAP)
    assert time.process_time() - start < 0.1
    assert plan.over and not plan.exact
    assert "more than 1,000,000 tasks" in plan.refusal()


def test_adaptive_experiments_count_their_budget() -> None:
    recipe = parse_recipe(_exp("    sampling: tpe\n    samples: 40\n    objective: {metric: l}\n"
                               "    parameters: {lr: {range: 0.1-0.3}}\n", "x {{lr}}"))
    plan = plan_tasks(recipe, 30)
    assert plan.counts == {"a": 40} and plan.exact and plan.over
    assert "max-workflow-tasks=40" in plan.refusal()

