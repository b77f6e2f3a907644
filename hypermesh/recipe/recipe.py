"""Recipes: the YAML a user submits, parsed and validated into frozen dataclasses.

``parse_recipe`` either returns a fully validated ``Recipe`` or raises one ``RecipeError``
that lists every problem in the file, each with its 1-based line and dotted field path
(``experiments.mnist.parameters.lr.range``); nothing partial is ever returned.

The pipeline: ``hypermesh.recipe.located`` reads the text into a tree of located nodes (plain
values plus lines), reporting duplicate keys on the way, and writes ``--set`` overrides into
that tree, so an overridden value is checked like any other; ``_Checker`` (here) validates
the tree into dataclasses, collecting every problem. ``Recipe.to_json``/``from_json`` store
a validated recipe losslessly (in etcd).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Literal

from hypermesh.errors import NotFound, Problem, RecipeError
from hypermesh.recipe.dag import DagChecker, topological_order
from hypermesh.recipe.inputs import input_problems
from hypermesh.recipe.limits import (
    MAX_CPUS,
    MAX_EXPERIMENTS,
    MAX_GANG,
    MAX_GPUS,
    MAX_RETRIES,
    MAX_SAMPLES,
    MAX_STORED,
    MAX_WORKERS,
)
from hypermesh.recipe.located import (
    _NUMBER,
    _apply_override,
    _as_float,
    _describe,
    _Entry,
    _Node,
    _read_document,
)
from hypermesh.recipe.ml import (
    EXPERIMENT_SAMPLINGS,
    PRUNERS,
    MLChecker,
    Objective,
    objective_from_json,
)
from hypermesh.recipe.pass_env import check_pass_env, name_list
from hypermesh.recipe.templating import (
    BUILTINS,
    PARAM_ENV_PREFIX,
    format_value,
    placeholder_problems,
)
from hypermesh.recipe.units import UnitError, parse_size

__all__ = [
    "MAX_BLOCK",
    "Experiment",
    "FrozenMap",
    "Hardware",
    "Parameter",
    "Recipe",
    "load_recipe",
    "parse_recipe",
    "why_not_batched",
]

JSON_VERSION = 1
SAMPLINGS = ("uniform", "loguniform", "int")


class FrozenMap(Mapping[str, str]):
    """An immutable, hashable str -> str mapping that keeps insertion order.

    Equality ignores order (like ``dict``), and so does the hash.
    """

    __slots__ = ("_data",)

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        self._data: dict[str, str] = dict(items)

    def __getitem__(self, key: str) -> str:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items())))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True)
class Parameter:
    """One searched parameter: a continuous ``range`` [low, high] drawn by ``sampling``, or a
    discrete list of ``values`` (scalars: str, int, float or bool, kept with their types).

    ``parse_recipe`` guarantees low < high (low <= high with integral bounds for ``int``,
    low > 0 for ``loguniform``) and a non-empty ``values`` without duplicates.
    """

    name: str
    kind: Literal["range", "values"]
    low: float | None = None
    high: float | None = None
    sampling: Literal["uniform", "loguniform", "int"] = "uniform"
    values: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))


@dataclass(frozen=True)
class Hardware:
    """What one task of an experiment needs on the node that runs it.

    ``gpu`` is a GPU type (``k80``); ``gpus`` a count that may be fractional (sharing a GPU).
    When a recipe names a ``gpu`` type without ``gpus``, ``gpus`` is 1. ``memory`` is in
    bytes, 0 meaning not stated. ``gpu_memory`` (bytes, 0 = not stated) is GPU memory the
    task needs on one GPU; with it (or a fractional ``gpus``) tasks may share a GPU.
    """

    gpu: str | None = None
    gpus: float = 0.0
    cpus: float = 1.0
    memory: int = 0
    gpu_memory: int = 0


@dataclass(frozen=True)
class Experiment:
    """One experiment of a recipe, validated.

    ``command`` is run in order, in one task, after ``{{name}}`` substitution; every name it
    uses is a parameter or a built-in. ``after`` names experiments of the same recipe, without
    cycles. ``env`` is the full environment the recipe asks for: the recipe's top-level ``env``
    overlaid with the experiment's own. ``samples`` is set whenever a range parameter exists.
    ``data`` maps an alias (an identifier) to a data set, ``NAME`` (its newest version when
    the task starts) or ``NAME@VERSION``; the agent mounts each and tells the task where.
    ``pools``, when not empty, are the only pools whose nodes run the tasks, in order of
    preference (the leader scales the first provisioned pool with room first).
    ``prefer_pools`` are pools whose nodes take the tasks first (a soft preference): a
    node of another allowed pool leaves a task for a bounded delay while a live node of
    a preferred pool has room (``agent/claims/pool_preference.py``), and the leader scales
    them first. Each is one of ``pools`` when ``pools`` is given.
    """

    name: str
    command: tuple[str, ...]
    parameters: tuple[Parameter, ...] = ()
    samples: int | None = None
    workers: int | None = None
    hardware: Hardware = Hardware()
    after: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=FrozenMap)
    retries: int = 0
    timeout: float | None = None
    framework: str | None = None
    image: str | None = None
    seed: int | None = None
    data: Mapping[str, str] = field(default_factory=FrozenMap)
    pools: tuple[str, ...] = ()
    objective: Objective | None = None
    sampling: str | None = None  # None or "random": drawn up front; "tpe": adaptive
    pruning: str | None = None  # "median": stop trials worse than the median
    nodes: int = 1  # > 1: each task is a gang of this many members (agent/gang/policy.py)
    inputs: tuple[str, ...] = ()  # ALIAS/PATH templates: what each task reads (placement)
    prefer_pools: tuple[str, ...] = ()
    batch: int | None = None  # tasks per block (hypermesh/state/blocks.py); None: chosen by size
    pass_env: tuple[str, ...] = ()  # agent variables its tasks get by name (recipe/pass_env.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "prefer_pools", tuple(self.prefer_pools))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "pass_env", tuple(self.pass_env))
        object.__setattr__(self, "pools", tuple(self.pools))
        object.__setattr__(self, "parameters", tuple(self.parameters))
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "env", FrozenMap(self.env))
        object.__setattr__(self, "data", FrozenMap(self.data))

    def parameter(self, name: str) -> Parameter:
        """The parameter called ``name``; raises ``NotFound`` if there is none."""
        for p in self.parameters:
            if p.name == name:
                return p
        raise NotFound(f"experiment {self.name!r} has no parameter {name!r}")


# Batching (hypermesh/state/blocks.py writes a batched experiment's tasks in blocks) is a
# rule of the language: a recipe's ``batch`` is checked against it.
MAX_BLOCK = 256
"""Most tasks in one block (its value holds every task's parameters)."""


def why_not_batched(exp: Experiment) -> str | None:
    """Why ``exp`` must keep per-task keys, or None when its tasks may run in blocks.

    Blocks carry no per-task claims, so what needs one stays per task: gangs, a
    ``workers`` cap (slot keys), GPUs (device bookings), data-locality placement,
    pool preferences, and adaptive searches or pruning (trial by trial)."""
    if exp.nodes > 1:
        return "a gang ('nodes' above 1)"
    if exp.workers is not None:
        return "a 'workers' cap"
    if exp.hardware.gpus or exp.hardware.gpu:
        return "GPUs"
    if exp.inputs:
        return "'inputs' (placement by data locality)"
    if exp.prefer_pools:
        return "'prefer_pools'"
    if exp.sampling == "tpe" or exp.pruning is not None:
        return "an adaptive search or pruning"
    return None


@dataclass(frozen=True)
class Recipe:
    """A whole validated recipe; ``experiments`` keeps file order and unique names.

    Immutable: ``with_seed`` and ``dataclasses.replace`` make changed copies.
    """

    experiments: tuple[Experiment, ...]
    name: str | None = None
    seed: int | None = None
    env: Mapping[str, str] = field(default_factory=FrozenMap)
    workdir: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "experiments", tuple(self.experiments))
        object.__setattr__(self, "env", FrozenMap(self.env))

    def experiment(self, name: str) -> Experiment:
        """The experiment called ``name``; raises ``NotFound`` if there is none."""
        for exp in self.experiments:
            if exp.name == name:
                return exp
        raise NotFound(f"recipe has no experiment {name!r}")

    def topological_order(self) -> list[str]:
        """Experiment names with every dependency before its dependents, ties in file order."""
        return list(self._topological)

    @cached_property
    def _topological(self) -> tuple[str, ...]:
        # Computed once per recipe: the scheduler asks on every claim.
        return tuple(topological_order([(e.name, e.after) for e in self.experiments]))

    def with_seed(self, seed: int) -> Recipe:
        """A copy of this recipe with the top-level ``seed`` set to ``seed``."""
        return replace(self, seed=seed)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that ``from_json`` turns back into an equal recipe."""
        return {"version": JSON_VERSION, **_jsonable(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Recipe:
        """The recipe ``to_json`` wrote; raises ``RecipeError`` if ``data`` is not one."""
        try:
            body = dict(data)
            if body.pop("version", None) != JSON_VERSION:
                raise ValueError(f"unsupported version {data.get('version')!r}")
            experiments = []
            for item in body.pop("experiments"):
                exp = dict(item)
                exp["parameters"] = [Parameter(**p) for p in exp.get("parameters", ())]
                exp["hardware"] = Hardware(**exp.get("hardware", {}))
                exp["objective"] = objective_from_json(exp.get("objective"))
                experiments.append(Experiment(**exp))
            return cls(experiments=tuple(experiments), **body)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            problem = Problem("<json>", None, "", f"not a recipe in JSON form: {exc!r}")
            raise RecipeError([problem]) from exc


def _jsonable(value: Any) -> Any:
    """Dataclasses as dicts of their fields, tuples as lists, mappings as dicts."""
    if value is None or isinstance(value, (str, int, float)):  # most values: first
        return value
    if isinstance(value, FrozenMap):  # str -> str
        return dict(value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _jsonable(item) for key, item in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value)}
    return value


# --------------------------------------------------------------------------- the format

_EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DATASET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # as chunkfs.format names them
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RANGE = re.compile(rf"\s*({_NUMBER})\s*-\s*({_NUMBER})\s*")
# A container image reference (registry[:port]/path:tag@digest): never an option of
# `docker run`, a space or a shell word.
IMAGE_RE = re.compile(
    r"(?:[A-Za-z0-9][A-Za-z0-9.-]*(?::[0-9]{1,5})?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)

_TOP_FIELDS = ("experiments", "name", "seed", "env", "workdir", "image")
_EXPERIMENT_FIELDS = (
    "command", "parameters", "samples", "workers", "hardware", "after", "env", "retries",
    "timeout", "framework", "image", "seed", "data", "pools", "objective", "sampling",
    "pruning", "nodes", "inputs", "prefer_pools", "batch", "pass_env",
)
_PARAMETER_FIELDS = ("range", "sampling", "values")
_HARDWARE_FIELDS = ("gpu", "gpus", "cpus", "memory", "gpu_memory")


class _Checker(MLChecker, DagChecker):
    """Validates a ``_Node`` tree into a ``Recipe`` while collecting every problem it finds.

    Methods return None for a value they rejected (after recording why) and never raise;
    ``recipe`` returns a ``Recipe`` only when no problem at all was recorded.
    """

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self._env_chars = 0  # of the experiments' merged environments so far (merged_env)
        self._shared_env_chars = 0  # of the top-level env

    # ------------------------------------------------------------------ environment
    def image(self, node: _Node, path: str) -> str | None:
        value = self.string(node, path)
        if value is not None and not IMAGE_RE.fullmatch(value):
            self.at(node, path, f"{value[:80]!r} is not an image reference "
                    "(such as pytorch/pytorch:2.4.0 or registry.local:5000/team/img@sha256:...)")
            return None
        return value

    def env(self, entry: _Entry | None, path: str) -> dict[str, str]:
        if entry is None or entry.node.value is None:
            return {}
        entries = self.mapping(entry.node, path)
        result: dict[str, str] = {}
        for name, item in (entries or {}).items():
            if not _IDENTIFIER.fullmatch(name):
                self.report(item.key_line, f"{path}.{name}", "not a valid environment name")
            elif isinstance(item.node.value, (str, int, float, bool)):
                result[name] = format_value(item.node.value)
            else:
                self.at(item.node, f"{path}.{name}", f"expected a scalar, got "
                        f"{_describe(item.node.value)}")
        return result

    def merged_env(
        self, shared: dict[str, str], entry: _Entry | None, path: str
    ) -> dict[str, str]:
        """The top-level ``env`` overlaid with an experiment's own. Each experiment stores
        the whole of it, so the characters of all experiments' environments together are
        bounded (``MAX_STORED``), before a large top-level env is copied a thousand times."""
        own = self.env(entry, path)
        before = self._env_chars
        self._env_chars += self._shared_env_chars + _env_size(own)
        if self._env_chars <= MAX_STORED:
            return {**shared, **own}
        if before <= MAX_STORED:  # reported once, where the bound is passed
            self.report(entry.key_line if entry else None, path, "the experiments' "
                        f"environments (each with the top-level env) come to more than "
                        f"{MAX_STORED:,} characters")
        return {}

    # ------------------------------------------------------------------ recipe
    def recipe(self, root: _Node) -> Recipe | None:
        top = self.mapping(root, "", "a mapping with an 'experiments' field")
        if top is None:
            return None
        self.known_fields(top, _TOP_FIELDS, "")
        optional = {k: e.node for k, e in top.items() if e.node.value is not None}
        name = self.string(optional["name"], "name") if "name" in optional else None
        seed = self.integer(optional["seed"], "seed") if "seed" in optional else None
        workdir = self.string(optional["workdir"], "workdir") if "workdir" in optional else None
        env = self.env(top.get("env"), "env")
        image = self.image(optional["image"], "image") if "image" in optional else None
        self._shared_env_chars = _env_size(env)
        experiments: list[Experiment | None] = []
        if "experiments" not in optional:
            self.report(root.line, "experiments", "missing required field 'experiments'")
        elif (entries := self.mapping(optional["experiments"], "experiments")) is not None:
            if not entries:
                self.at(optional["experiments"], "experiments", "needs at least one experiment")
            elif len(entries) > MAX_EXPERIMENTS:
                self.at(optional["experiments"], "experiments", f"{len(entries)} experiments; "
                        f"at most {MAX_EXPERIMENTS}")
                return None
            for exp_name, entry in entries.items():
                experiments.append(self.experiment(exp_name, entry, env, image))
            self.dependencies(list(entries))
        if self.problems:
            return None
        recipe = Recipe(
            experiments=tuple(e for e in experiments if e is not None),
            name=name, seed=seed, env=env, workdir=workdir,
        )
        stored = len(json.dumps(recipe.to_json(), separators=(",", ":")))  # as records store it
        if stored > MAX_STORED:
            self.report(None, "", f"the recipe is {stored:,} bytes stored (as JSON, each "
                        f"experiment with the top-level env); at most {MAX_STORED:,}")
            return None
        return recipe

    def experiment(
        self, name: str, entry: _Entry, shared_env: dict[str, str], shared_image: str | None
    ) -> Experiment | None:
        """One experiment; ``shared_image`` (the top-level ``image``) is its image unless it
        names its own ``image`` or a ``framework``."""
        path = f"experiments.{name}"
        before = len(self.problems)
        if not _EXPERIMENT_NAME.fullmatch(name):
            self.report(entry.key_line, path, "experiment names are 1-63 letters, digits, '_' "
                        "or '-', starting with a letter or digit")
        spec = self.mapping(entry.node, path)
        if spec is None:
            return None
        self.known_fields(spec, _EXPERIMENT_FIELDS, path)
        given = {k: e.node for k, e in spec.items() if e.node.value is not None}
        parameters, declared = self.parameters(given.get("parameters"), f"{path}.parameters")
        command = self.command(spec.get("command"), entry.key_line, path, declared)

        def optional(key: str, check: Any, *args: Any) -> Any:
            return check(given[key], f"{path}.{key}", *args) if key in given else None

        samples = optional("samples", self.integer, 1, MAX_SAMPLES)
        if samples is None and "samples" not in given and any(
            p.kind == "range" for p in parameters
        ):
            self.report(entry.key_line, f"{path}.samples", "range parameters need 'samples' "
                        "(how many tasks to draw)")
        workers = optional("workers", self.integer, 1, MAX_WORKERS)
        nodes = optional("nodes", self.integer, 1, MAX_GANG) or 1
        hardware = optional("hardware", self.hardware) or Hardware()
        self.after(name, given.get("after"), spec.get("after"), path)
        env = self.merged_env(shared_env, spec.get("env"), f"{path}.env")
        retries = optional("retries", self.integer, 0, MAX_RETRIES) or 0
        timeout = optional("timeout", self.duration)
        framework = optional("framework", self.string)
        image = optional("image", self.image)
        if "image" not in given and "framework" not in given:
            image = shared_image
        seed = optional("seed", self.integer)
        data = optional("data", self.data) or {}
        pools = optional("pools", self.pools) or ()
        prefer_pools = optional("prefer_pools", self.pools) or ()
        if pools and prefer_pools:
            self.preferred_allowed(given["prefer_pools"], f"{path}.prefer_pools",
                                   prefer_pools, pools)
        inputs = optional("inputs", self.inputs, data, declared) or ()
        objective = optional("objective", self.objective)
        sampling = self.choice(spec.get("sampling"), f"{path}.sampling", EXPERIMENT_SAMPLINGS)
        pruning = self.choice(spec.get("pruning"), f"{path}.pruning", PRUNERS)
        self.search_rules(entry.key_line, path, sampling, pruning, objective, samples,
                          bool(parameters))
        if nodes > 1 and pruning is not None:
            self.report(entry.key_line, f"{path}.pruning", "'pruning' is not supported for "
                        "gangs ('nodes' above 1)")
        batch = optional("batch", self.integer, 1)
        pass_env = optional("pass_env", partial(check_pass_env, self)) or ()
        if len(self.problems) > before or command is None:
            return None
        experiment = Experiment(
            name=name, command=command, parameters=tuple(parameters), samples=samples,
            workers=workers, hardware=hardware, after=tuple(ref[0] for ref in self._after[name][1]),
            env=env, retries=retries, timeout=timeout, framework=framework, image=image,
            seed=seed, data=data, pools=pools, objective=objective, sampling=sampling,
            pruning=pruning, nodes=nodes, inputs=inputs, prefer_pools=prefer_pools,
            batch=batch, pass_env=pass_env,
        )
        if batch is not None:
            self.batch_rules(given["batch"], f"{path}.batch", experiment)
            if len(self.problems) > before:
                return None
        return experiment

    def batch_rules(self, node: _Node, path: str, exp: Experiment) -> None:
        assert exp.batch is not None
        if exp.batch > MAX_BLOCK:
            self.at(node, path, f"must be at most {MAX_BLOCK}, got {exp.batch}")
        elif exp.batch > 1 and (why := why_not_batched(exp)) is not None:
            self.at(node, path, f"an experiment with {why} runs task by task; "
                    "use batch: 1 or leave it out")

    # ------------------------------------------------------------------ data sets
    def data(self, node: _Node, path: str) -> dict[str, str] | None:
        entries = self.mapping(node, path, "a mapping of alias: DATASET[@VERSION]")
        if entries is None:
            return None
        result: dict[str, str] = {}
        upper: set[str] = set()
        for alias, item in entries.items():
            if not _IDENTIFIER.fullmatch(alias):
                self.report(item.key_line, f"{path}.{alias}", "an alias is a letter or '_' "
                            "followed by letters, digits or '_' (it names HM_DATA_<ALIAS>)")
                continue
            spec = self.string(item.node, f"{path}.{alias}")
            if spec is None:
                continue
            name, _, version = spec.partition("@")
            if not _DATASET.fullmatch(name) or ("@" in spec and not _VERSION.fullmatch(version)):
                self.at(item.node, f"{path}.{alias}", f"{spec!r} is not DATASET or "
                        "DATASET@VERSION (names: letters, digits, '.', '_', '-')")
                continue
            if alias.upper() in upper:
                self.report(item.key_line, f"{path}.{alias}", "two aliases differ only in case; "
                            "both would be HM_DATA_" + alias.upper())
                continue
            upper.add(alias.upper())
            result[alias] = spec
        return result

    # ------------------------------------------------------------------ inputs
    def inputs(
        self, node: _Node, path: str, data: dict[str, str], declared: list[str]
    ) -> tuple[str, ...] | None:
        """``inputs``: one ``ALIAS/PATH`` template or a list of them (hypermesh.recipe.inputs)."""
        items = node.value if isinstance(node.value, list) else [node]
        if not items:
            self.at(node, path, "expected an ALIAS/PATH or a list of them, got an empty list")
            return None
        found: list[str] = []
        for i, item in enumerate(items):
            where = f"{path}[{i}]" if isinstance(node.value, list) else path
            text = self.string(item, where)
            problems = [] if text is None else input_problems(text, data, declared)
            for message in problems:
                self.at(item, where, message)
            if text is not None and not problems:
                found.append(text)
        return tuple(found) if len(found) == len(items) else None

    # ------------------------------------------------------------------ pools
    def pools(self, node: _Node, path: str) -> tuple[str, ...] | None:
        return name_list(self, node, path, _EXPERIMENT_NAME, "pool", "1-63 letters, "
                         "digits, '_' or '-', starting with a letter or digit")

    def preferred_allowed(self, node: _Node, path: str, preferred: tuple[str, ...],
                          allowed: tuple[str, ...]) -> None:
        """Each of ``prefer_pools`` must be one of ``pools``: a preferred pool the recipe
        forbids could never run the tasks."""
        items = node.value if isinstance(node.value, list) else [node]
        allowed_set = set(allowed)
        listed = ", ".join(allowed[:20]) + (", ..." if len(allowed) > 20 else "")
        for i, name in enumerate(preferred):
            if name not in allowed_set:
                where = f"{path}[{i}]" if isinstance(node.value, list) else path
                self.at(items[i], where, f"pool {name!r} is not one of 'pools' "
                        f"({listed}): a preferred pool must be allowed")

    # ------------------------------------------------------------------ command
    def command(
        self, entry: _Entry | None, exp_line: int | None, path: str, declared: list[str]
    ) -> tuple[str, ...] | None:
        path = f"{path}.command"
        if entry is None or entry.node.value is None:
            line = exp_line if entry is None else entry.key_line
            self.report(line, path, "missing required field 'command'")
            return None
        node = entry.node
        if isinstance(node.value, str):
            items = [(node, path)]
        elif isinstance(node.value, list) and node.value:
            items = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        else:
            self.at(node, path, f"expected a command or a list of commands, got "
                    f"{_describe(node.value) if node.value != [] else 'an empty list'}")
            return None
        commands: list[str] = []
        for item, item_path in items:
            text = self.string(item, item_path)
            if text is not None:
                commands.append(text)
                for message in placeholder_problems(text, declared):
                    self.at(item, item_path, message)
        return tuple(commands) if len(commands) == len(items) else None

    # ------------------------------------------------------------------ parameters
    def parameters(self, node: _Node | None, path: str) -> tuple[list[Parameter], list[str]]:
        """The valid parameters, and the names of all declared ones (valid or not)."""
        if node is None:
            return [], []
        entries = self.mapping(node, path) or {}
        parameters: list[Parameter] = []
        env_names: dict[str, str] = {}
        for name, entry in entries.items():
            where = f"{path}.{name}"
            if not _IDENTIFIER.fullmatch(name):
                self.report(entry.key_line, where, "parameter names must be identifiers "
                            "(letters, digits, '_'; not starting with a digit)")
            elif name in BUILTINS:
                self.report(entry.key_line, where, f"{name!r} is a built-in template variable")
            elif name.upper() in env_names:
                self.report(entry.key_line, where, f"{name!r} and {env_names[name.upper()]!r} "
                            f"would both be {PARAM_ENV_PREFIX}{name.upper()}")
            env_names.setdefault(name.upper(), name)
            parameter = self.parameter(name, entry, where)
            if parameter is not None:
                parameters.append(parameter)
        return parameters, list(entries)

    def parameter(self, name: str, entry: _Entry, path: str) -> Parameter | None:
        spec = self.mapping(entry.node, path, "a mapping with 'range' or 'values'")
        if spec is None:
            return None
        self.known_fields(spec, _PARAMETER_FIELDS, path)
        if "range" in spec and "values" in spec:
            self.report(spec["values"].key_line, path, "give 'range' or 'values', not both")
            return None
        if "values" in spec:
            if "sampling" in spec:
                self.report(spec["sampling"].key_line, f"{path}.sampling",
                            "'sampling' applies only to 'range' parameters")
            values = self.values(spec["values"].node, f"{path}.values")
            return None if values is None else Parameter(name, "values", values=values)
        if "range" not in spec:
            self.report(entry.key_line, path, "needs 'range' (with 'sampling') or 'values'")
            return None
        sampling: Literal["uniform", "loguniform", "int"] = "uniform"
        if "sampling" in spec:
            node = spec["sampling"].node
            if node.value not in SAMPLINGS:
                hint = self.suggest(str(node.value), SAMPLINGS)
                self.at(node, f"{path}.sampling", f"must be one of {', '.join(SAMPLINGS)}, "
                        f"got {node.value!r}{hint}")
                return None
            sampling = node.value
        bounds = self.bounds(spec["range"].node, f"{path}.range", sampling)
        if bounds is None:
            return None
        return Parameter(name, "range", low=bounds[0], high=bounds[1], sampling=sampling)

    def bounds(self, node: _Node, path: str, sampling: str) -> tuple[float, float] | None:
        value = node.value
        parts: list[Any] | None = None
        if isinstance(value, str) and (match := _RANGE.fullmatch(value)):
            parts = [match.group(1), match.group(2)]
        elif isinstance(value, list) and len(value) == 2:
            parts = [item.value for item in value]
        numbers = [_as_float(p) for p in parts] if parts is not None else [None]
        if None in numbers:
            shown = [i.value for i in value] if isinstance(value, list) else _describe(value)
            self.at(node, path, f"expected 'min-max' (e.g. '0.1-0.3') or [min, max], got {shown}")
            return None
        low, high = numbers
        assert low is not None and high is not None
        if sampling == "int" and not (low.is_integer() and high.is_integer()):
            self.at(node, path, f"'int' sampling needs whole-number bounds, got {low:g}-{high:g}")
        elif sampling == "int" and low > high:
            self.at(node, path, f"min {low:g} must not be greater than max {high:g}")
        elif sampling != "int" and low >= high:
            self.at(node, path, f"min {low:g} must be less than max {high:g}")
        elif sampling == "loguniform" and low <= 0:
            self.at(node, path, f"'loguniform' needs min > 0, got {low:g}")
        else:
            return low, high
        return None

    def values(self, node: _Node, path: str) -> tuple[Any, ...] | None:
        if not isinstance(node.value, list) or not node.value:
            self.at(node, path, f"expected a non-empty list of values, got {_describe(node.value)}")
            return None
        values: list[Any] = []
        seen: set[tuple[type, Any]] = set()
        for i, item in enumerate(node.value):
            value = item.value
            if not isinstance(value, (str, int, float, bool)) or (
                isinstance(value, float) and not math.isfinite(value)
            ):
                self.at(item, f"{path}[{i}]", f"values must be strings, numbers or booleans, "
                        f"got {_describe(value)}")
            elif (type(value), value) in seen:
                self.at(item, f"{path}[{i}]", f"duplicate value {value!r}")
            else:
                seen.add((type(value), value))
                values.append(value)
        return tuple(values) if len(values) == len(node.value) else None

    # ------------------------------------------------------------------ hardware
    def hardware(self, node: _Node, path: str) -> Hardware | None:
        spec = self.mapping(node, path)
        if spec is None:
            return None
        self.known_fields(spec, _HARDWARE_FIELDS, path)
        given = {k: e.node for k, e in spec.items() if e.node.value is not None}
        gpu = None
        if "gpu" in given:
            gpu_node = given["gpu"]
            if isinstance(gpu_node.value, (int, float)) and not isinstance(gpu_node.value, bool):
                self.at(gpu_node, f"{path}.gpu", "'gpu' is the GPU type (e.g. k80); "
                        "use 'gpus' for how many")
            else:
                gpu = self.string(gpu_node, f"{path}.gpu")
        gpus = (self.number(given["gpus"], f"{path}.gpus", 0, True, MAX_GPUS)
                if "gpus" in given else None)
        if gpu is not None and gpus == 0:
            self.at(given["gpus"], f"{path}.gpus", f"asks for a {gpu!r} GPU but 0 gpus")
        cpus = (self.number(given["cpus"], f"{path}.cpus", 0, False, MAX_CPUS)
                if "cpus" in given else 1.0)
        memory = self.size(given.get("memory"), f"{path}.memory")
        gpu_memory = self.size(given.get("gpu_memory"), f"{path}.gpu_memory")
        if gpus is None:
            gpus = 1.0 if gpu is not None or gpu_memory else 0.0
        if gpus > 1 and not float(gpus).is_integer():
            self.at(given["gpus"], f"{path}.gpus", f"a share of one GPU is less than 1; more "
                    f"than one GPU is a whole number, got {gpus:g}")
        if gpu_memory and gpus != 1:
            self.at(given["gpu_memory"], f"{path}.gpu_memory", "packs tasks on one GPU by "
                    f"memory; it cannot be combined with gpus: {gpus:g}")
        return Hardware(gpu=gpu, gpus=gpus, cpus=cpus or 1.0, memory=memory,
                        gpu_memory=gpu_memory)

    def size(self, node: _Node | None, path: str) -> int:
        """A size in bytes such as ``16GiB``; 0 when absent or rejected."""
        if node is None:
            return 0
        try:
            value = parse_size(node.value)
        except UnitError as exc:
            self.at(node, path, str(exc))
            return 0
        if value == 0:
            self.at(node, path, "must be more than 0 bytes")
        return value


def _env_size(env: dict[str, str]) -> int:
    """Characters of ``env``'s names and values."""
    return sum(len(k) + len(v) for k, v in env.items())


# --------------------------------------------------------------------------- entry points

def parse_recipe(text: str, source: str = "<recipe>", overrides: Sequence[str] = ()) -> Recipe:
    """The validated recipe in ``text``, with ``overrides`` applied; raises ``RecipeError``
    listing every problem otherwise. ``source`` names the text in problems (a path)."""
    checker = _Checker(source)
    root = _read_document(text, source, checker.report)
    if root.value is None:
        checker.report(1, "", "the recipe is empty; it needs an 'experiments' mapping")
    for override in overrides:
        _apply_override(root, override, checker.report)
    recipe = checker.recipe(root) if root.value is not None else None
    if recipe is None or checker.problems:
        raise RecipeError(checker.problems or [Problem(source, None, "", "invalid recipe")])
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """``parse_recipe`` on the file at ``path`` (named as given in problems)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RecipeError([Problem(source, None, "", f"cannot read recipe: {reason}")]) from None
    return parse_recipe(text, source, overrides)
