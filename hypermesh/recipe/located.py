"""Located YAML for recipes: a node tree that remembers lines, ``--set`` overrides written
into it, and typed reads back out of it that record located problems.

``_read_document`` composes a YAML text and reduces it to ``_Node``s (plain values plus their
1-based lines). Duplicate keys, non-string keys, recursive aliases, bad ``<<`` merges and
unreadable scalars are reported through a ``_Report`` callback and reading goes on; only a
YAML syntax error, or aliases that expand the document beyond ``_MAX_NODES`` nodes, stop it,
as a ``RecipeError``. ``_apply_override`` writes one ``EXP.FIELD[.SUB...]=VALUE`` into such a
tree; the nodes it adds have no line but carry the override as their ``origin``.
``_NodeChecker`` reads values of a given shape (mapping, string, integer, number, duration)
out of the tree and records a ``Problem`` for each value it rejects, never raising.

This module knows YAML, lines and shapes only; which fields a recipe has and what they mean
is ``hypermesh.recipe.recipe``'s business. Everything here is private to that module and
its siblings (hence the underscores, kept from when it lived there): import recipes through
``hypermesh.recipe.recipe``. The names also keep node reprs unchanged, and a repr can reach a
problem message.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from hypermesh.errors import Problem, RecipeError
from hypermesh.recipe.units import UnitError, parse_duration

_MERGE_TAG = "tag:yaml.org,2002:merge"
_MAX_NODES = 1_000_000
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
"""A decimal number as a regular expression: sign, digits, point, exponent."""

_Report = Callable[[int | None, str, str], None]
"""Where problems go: ``report(line, dotted_path, message)``."""


@dataclass(frozen=True)
class _Node:
    """A YAML node reduced to plain data and where it came from.

    ``value`` is a ``dict[str, _Entry]``, a ``list[_Node]`` or a scalar; ``origin`` is the
    ``--set`` override a node came from (its ``line`` is then None).
    """

    value: Any
    line: int | None
    origin: str | None = None


@dataclass(frozen=True)
class _Entry:
    """A mapping entry: the line of its key and its value."""

    key_line: int | None
    node: _Node


class _TooLarge(Exception):
    """Aliases expand the document beyond ``_MAX_NODES`` nodes."""


def _suggest(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``word``, or "" if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _describe(value: Any) -> str:
    """A node value as problems show it: its kind for containers and null, else its repr."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return f"{value!r}"


def _as_float(value: Any) -> float | None:
    """``value`` as a finite float if it is a number or a numeric string ("1e-4"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and re.fullmatch(rf"\s*{_NUMBER}\s*", value):
        value = float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


# --------------------------------------------------------------------------- reading

class _Reader:
    """Turns a composed YAML node graph into ``_Node``s, reporting duplicate keys, bad keys,
    recursive aliases and unknown tags through ``report``; it never raises for those.

    Raises ``_TooLarge`` once it has read more than ``_MAX_NODES`` nodes (aliases included).
    With an ``origin`` (a ``--set`` key), nodes get that origin and no line.
    """

    def __init__(self, report: _Report, origin: str | None = None) -> None:
        self._constructor = yaml.SafeLoader("")
        self._report = report
        self._origin = origin
        self._active: set[int] = set()
        self._count = 0

    def _line(self, node: yaml.Node) -> int | None:
        return None if self._origin else node.start_mark.line + 1

    def read(self, node: yaml.Node, path: str) -> _Node:
        line = self._line(node)
        self._count += 1
        if self._count > _MAX_NODES:
            raise _TooLarge
        if id(node) in self._active:
            self._report(line, path, "an alias refers to the node that contains it")
            return _Node(None, line, self._origin)
        if isinstance(node, yaml.ScalarNode):
            return _Node(self._scalar(node, path, line), line, self._origin)
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                items = [self.read(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
                return _Node(items, line, self._origin)
            assert isinstance(node, yaml.MappingNode)
            return _Node(self._mapping(node, path), line, self._origin)
        finally:
            self._active.discard(id(node))

    def _scalar(self, node: yaml.ScalarNode, path: str, line: int | None) -> Any:
        try:
            value = self._constructor.construct_object(node)
        except yaml.YAMLError as exc:
            self._report(line, path, f"cannot read value: {getattr(exc, 'problem', exc)}")
            return None
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        return node.value  # timestamps and the like: keep the text as written

    def _mapping(self, node: yaml.MappingNode, path: str) -> dict[str, _Entry]:
        merged: dict[str, _Entry] = {}
        explicit: dict[str, _Entry] = {}
        for key_node, value_node in node.value:
            key_line = self._line(key_node)
            if key_node.tag == _MERGE_TAG:
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [
                    value_node
                ]
                for source in sources:
                    sub = self.read(source, path)
                    if not isinstance(sub.value, dict):
                        self._report(key_line, path, "'<<' can only merge mappings")
                        continue
                    for key, entry in sub.value.items():
                        merged.setdefault(key, entry)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self._report(key_line, path, "mapping keys must be plain strings")
                continue
            key = key_node.value
            sub_path = f"{path}.{key}" if path else key
            if key in explicit:
                first = explicit[key].key_line
                self._report(key_line, sub_path, f"duplicate key {key!r} (first at line {first})")
                continue
            explicit[key] = _Entry(key_line, self.read(value_node, sub_path))
        return {**merged, **explicit}


def _read_document(text: str, source: str, report: _Report) -> _Node:
    """The ``_Node`` tree of the YAML in ``text`` (``_Node(None, 1)`` for an empty document).

    Problems that leave the tree readable go to ``report``; a syntax error or a document too
    large to read raises ``RecipeError`` with that one problem, ``source`` naming the text.
    """
    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
        return _Reader(report).read(document, "") if document is not None else _Node(None, 1)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = "; ".join(m for m in (exc.context, exc.problem) if m)
        line = mark.line + 1 if mark is not None else None
        raise RecipeError([Problem(source, line, "", f"YAML syntax error: {message}")]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([Problem(source, None, "", f"cannot read YAML: {exc}")]) from None
    except _TooLarge:
        message = f"aliases expand the recipe beyond {_MAX_NODES} nodes"
        raise RecipeError([Problem(source, None, "", message)]) from None


# --------------------------------------------------------------------------- --set overrides

def _apply_override(root: _Node, text: str, report: _Report) -> None:
    """Apply one ``EXP.FIELD[.SUB...]=VALUE`` to ``root``, or report why it cannot be.

    ``VALUE`` is read as YAML; ``EXP`` must be an experiment under ``experiments``, and
    missing or null mappings on the way to ``FIELD`` are created. Problems are reported
    without a line, at the path ``--set EXP.FIELD``.
    """
    key, equals, raw = text.partition("=")
    key = key.strip()
    where = f"--set {key}"
    parts = key.split(".")
    if not equals or len(parts) < 2 or not all(parts):
        report(None, where, f"expected EXP.FIELD=VALUE, got {text!r}")
        return
    reader = _Reader(lambda _line, _path, message: report(None, where, message), key)
    try:
        document = yaml.compose(raw, Loader=yaml.SafeLoader)
        value = reader.read(document, where) if document is not None else _Node(None, None, key)
    except yaml.YAMLError as exc:
        report(None, where, f"cannot parse value {raw!r}: {getattr(exc, 'problem', exc)}")
        return
    except _TooLarge:
        report(None, where, f"the value expands beyond {_MAX_NODES} nodes")
        return
    top = root.value if isinstance(root.value, dict) else {}
    experiments = top.get("experiments")
    table = experiments.node.value if experiments is not None else None
    if not isinstance(table, dict) or parts[0] not in table:
        names = list(table) if isinstance(table, dict) else []
        report(None, where, f"unknown experiment {parts[0]!r}{_suggest(parts[0], names)}")
        return
    node = table[parts[0]].node
    for depth, part in enumerate(parts[1:-1], start=1):
        if not isinstance(node.value, dict):
            break
        child = node.value.get(part)
        if child is None or child.node.value is None:
            child = _Entry(None, _Node({}, None, key))
            node.value[part] = child
        node = child.node
        if not isinstance(node.value, dict):
            report(None, where, f"{'.'.join(parts[: depth + 1])!r} is not a mapping")
            return
    if not isinstance(node.value, dict):
        report(None, where, f"experiment {parts[0]!r} is not a mapping")
        return
    old = node.value.get(parts[-1])
    node.value[parts[-1]] = _Entry(old.key_line if old else None, value)


# --------------------------------------------------------------------------- typed reads

class _NodeChecker:
    """Reads values of a given shape out of a ``_Node`` tree, collecting located problems.

    Each read returns None for a value it rejected (after recording why) and never raises.
    ``problems`` only grows; a problem about a node set by ``--set`` names the override.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[Problem] = []

    def report(self, line: int | None, path: str, message: str) -> None:
        self.problems.append(Problem(self.source, line, path, message))

    def at(self, node: _Node, path: str, message: str) -> None:
        if node.origin:
            message += f" (set by --set {node.origin})"
        self.report(node.line, path, message)

    def mapping(self, node: _Node, path: str, what: str = "a mapping") -> dict[str, _Entry] | None:
        if isinstance(node.value, dict):
            return node.value
        self.at(node, path, f"expected {what}, got {_describe(node.value)}")
        return None

    def known_fields(self, entries: dict[str, _Entry], allowed: Sequence[str], path: str) -> None:
        for key, entry in entries.items():
            if key not in allowed:
                where = f"{path}.{key}" if path else key
                hint = _suggest(key, allowed)
                self.report(entry.key_line, where, f"unknown field {key!r}{hint}")

    def string(self, node: _Node, path: str) -> str | None:
        if isinstance(node.value, str) and node.value.strip():
            return node.value
        self.at(node, path, f"expected a non-empty string, got {_describe(node.value)}")
        return None

    def integer(self, node: _Node, path: str, minimum: int | None = None) -> int | None:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int):
            self.at(node, path, f"expected an integer, got {_describe(value)}")
            return None
        if minimum is not None and value < minimum:
            self.at(node, path, f"must be at least {minimum}, got {value}")
            return None
        return value

    def number(self, node: _Node, path: str, minimum: float, inclusive: bool) -> float | None:
        value = _as_float(node.value)
        if value is None:
            self.at(node, path, f"expected a number, got {_describe(node.value)}")
            return None
        if value < minimum or (value == minimum and not inclusive):
            bound = f"at least {minimum:g}" if inclusive else f"greater than {minimum:g}"
            self.at(node, path, f"must be {bound}, got {node.value!r}")
            return None
        return value

    def duration(self, node: _Node, path: str) -> float | None:
        try:
            if isinstance(node.value, (str, int, float)):
                seconds = parse_duration(node.value)
                if seconds > 0:
                    return seconds
                self.at(node, path, f"must be longer than 0 seconds, got {node.value!r}")
                return None
            self.at(node, path, f"expected a duration such as '30m', got {_describe(node.value)}")
        except UnitError as exc:
            self.at(node, path, str(exc))
        return None
