"""Located YAML for recipes: a node tree that remembers lines, ``--set`` overrides written
into it, and typed reads back out of it that record located problems.

``_read_document`` composes a YAML text and reduces it to ``_Node``s (plain values plus their
1-based lines). Duplicate keys, non-string keys, recursive aliases, bad ``<<`` merges and
unreadable, too long or too large scalars are reported through a ``_Report`` callback and
reading goes on; only a YAML syntax error, or a document beyond the bounds below, stops it,
as a ``RecipeError``. The bounds are checked on YAML's event stream before anything is
composed (``_check_bounds``), so no input (a billion-laughs alias bomb, ten thousand nested
brackets, a gigabyte of text) costs more than reading a recipe at the bounds:

- ``MAX_TEXT`` characters of text, and of scalar text once aliases are expanded;
- ``MAX_NODES`` keys and values once aliases are expanded;
- ``MAX_DEPTH`` levels of nested mappings and lists, aliases expanded;
- ``MAX_SCALAR`` characters in one value, ``MAX_NUMBER`` in one number

(all in ``hypermesh.recipe.limits``).

``_apply_override`` writes one ``EXP.FIELD[.SUB...]=VALUE`` into such a tree; the nodes it
adds have no line but carry the override as their ``origin``. ``_NodeChecker`` reads values
of a given shape (mapping, string, integer, number, duration) out of the tree and records a
``Problem`` for each value it rejects, never raising.

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
from hypermesh.recipe.limits import (
    HINTS,
    MAX_DEPTH,
    MAX_DURATION,
    MAX_INT,
    MAX_NODES,
    MAX_NUMBER,
    MAX_SCALAR,
    MAX_TEXT,
)
from hypermesh.recipe.units import UnitError, format_duration, parse_duration

_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
# libyaml's parser when PyYAML was built with it (several times faster); both parse the
# same YAML 1.1 and resolve the same tags.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
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
    """The document is beyond one of the bounds; the message says which."""


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
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            return None
        return number if math.isfinite(number) else None
    return None


# --------------------------------------------------------------------------- bounds

_Extent = tuple[int, int, int]
"""What one node stands for, aliases expanded: keys and values, scalar characters, and
levels of nesting (0 for a scalar)."""


def _check_bounds(text: str) -> None:
    """Raise ``_TooLarge`` if ``text`` is beyond ``MAX_TEXT``, ``MAX_NODES`` or
    ``MAX_DEPTH``, counting every alias as the node it repeats.

    Walks YAML's event stream (the parser is a state machine: no recursion, nothing built)
    and stops at the first bound passed, before the composer builds a node for each event:
    composing is what costs time. An anchor's extent is kept, so an alias costs one lookup
    however much it stands for. Syntax errors propagate as ``yaml.MarkedYAMLError``."""
    if len(text) > MAX_TEXT:
        raise _TooLarge(f"the text is {len(text):,} characters; at most {MAX_TEXT:,}")
    anchors: dict[str, _Extent] = {}
    # The collections being read, outermost first: [anchor, nodes, chars, depth below].
    open_: list[list[Any]] = []
    nodes = chars = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.ScalarEvent):
            anchor, extent = event.anchor, (1, len(event.value), 0)
        elif isinstance(event, yaml.AliasEvent):
            # An anchor still open is a recursive alias (the reader reports it); an unknown
            # one is the composer's error.
            anchor, extent = None, anchors.get(event.anchor or "", (1, 0, 0))
        elif isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, 1, 0, 0])
            nodes += 1
            _within(len(open_), nodes, chars)
            continue
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, *counts = open_.pop()
            extent = (counts[0], counts[1], counts[2] + 1)
            if anchor is not None:
                anchors[anchor] = extent
            if open_:
                _add(open_[-1], extent)
            continue  # already in the totals, counted as it was read
        else:
            continue
        nodes += extent[0]
        chars += extent[1]
        _within(len(open_) + extent[2], nodes, chars)
        if anchor is not None:
            anchors[anchor] = extent
        if open_:
            _add(open_[-1], extent)


def _within(depth: int, nodes: int, chars: int) -> None:
    if depth > MAX_DEPTH:
        raise _TooLarge(f"mappings and lists nest more than {MAX_DEPTH} levels deep")
    if nodes > MAX_NODES:
        raise _TooLarge(f"more than {MAX_NODES:,} keys and values (aliases expanded)")
    if chars > MAX_TEXT:
        raise _TooLarge(f"aliases expand the text beyond {MAX_TEXT:,} characters")


def _add(parent: list[Any], extent: _Extent) -> None:
    """A node is complete: add its extent to its parent's."""
    parent[1] += extent[0]
    parent[2] += extent[1]
    if extent[2] > parent[3]:
        parent[3] = extent[2]


# --------------------------------------------------------------------------- reading

class _Reader:
    """Turns a composed YAML node graph into ``_Node``s, reporting duplicate keys, bad keys,
    recursive aliases and unknown tags through ``report``; it never raises for those.

    The document has passed ``_check_bounds``; deeper than ``MAX_DEPTH`` levels it still
    raises ``_TooLarge`` rather than recurse. With an ``origin`` (a ``--set`` key), nodes
    get that origin and no line.
    """

    def __init__(self, report: _Report, origin: str | None = None) -> None:
        self._constructor = yaml.SafeLoader("")
        self._report = report
        self._origin = origin
        self._active: set[int] = set()

    def _line(self, node: yaml.Node) -> int | None:
        return None if self._origin else node.start_mark.line + 1

    def read(self, node: yaml.Node, path: str, depth: int = 0) -> _Node:
        line = self._line(node)
        if id(node) in self._active:
            self._report(line, path, "an alias refers to the node that contains it")
            return _Node(None, line, self._origin)
        if isinstance(node, yaml.ScalarNode):
            return _Node(self._scalar(node, path, line), line, self._origin)
        if depth >= MAX_DEPTH:
            raise _TooLarge(f"mappings and lists nest more than {MAX_DEPTH} levels deep")
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                items = [
                    self.read(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value)
                ]
                return _Node(items, line, self._origin)
            assert isinstance(node, yaml.MappingNode)
            return _Node(self._mapping(node, path, depth), line, self._origin)
        finally:
            self._active.discard(id(node))

    def _scalar(self, node: yaml.ScalarNode, path: str, line: int | None) -> Any:
        if len(node.value) > MAX_SCALAR:
            self._report(line, path, f"a value of {len(node.value):,} characters; at most "
                         f"{MAX_SCALAR:,}")
            return None
        if node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER:
            self._report(line, path, f"a number of {len(node.value):,} characters; at most "
                         f"{MAX_NUMBER}")
            return None
        if node.tag == _STR_TAG:  # most values: their text is the value
            return node.value
        try:
            value = self._constructor.construct_object(node)
        except Exception as exc:  # !!int abc, !!timestamp x: PyYAML's constructors fail
            # on explicitly tagged text in several ways, all of them this
            self._report(line, path, f"cannot read value: {getattr(exc, 'problem', exc)}")
            return None
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        return node.value  # timestamps and the like: keep the text as written

    def _mapping(self, node: yaml.MappingNode, path: str, depth: int) -> dict[str, _Entry]:
        merged: dict[str, _Entry] = {}
        explicit: dict[str, _Entry] = {}
        for key_node, value_node in node.value:
            key_line = self._line(key_node)
            if key_node.tag == _MERGE_TAG:
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [
                    value_node
                ]
                for source in sources:
                    sub = self.read(source, path, depth)  # merged in: this mapping's level
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
            explicit[key] = _Entry(key_line, self.read(value_node, sub_path, depth + 1))
        return {**merged, **explicit}


def _placeholder_hint(text: str, line: int | None) -> str:
    """A hint for the YAML error most placeholders cause: ``{{name}}`` unquoted inside a
    flow list or mapping (``[echo {{x}}]``), or starting a value, reads as a mapping."""
    lines = text.splitlines()
    if line is None or not 0 <= line < len(lines) or "{{" not in lines[line]:
        return ""
    return ("; a value with a {{placeholder}} inside [...] or {...}, or at the start of a "
            'value, must be quoted: command: ["echo {{x}}"]')


def _compose(text: str) -> yaml.Node | None:
    """YAML's node graph of ``text`` (aliases not expanded), once it is within bounds."""
    try:
        _check_bounds(text)
        return yaml.compose(text, Loader=_LOADER)
    except UnicodeEncodeError as exc:  # libyaml reads UTF-8: a lone surrogate (from argv)
        raise yaml.YAMLError(f"not Unicode text: {exc.reason} at character {exc.start}") from None


def _read_document(text: str, source: str, report: _Report) -> _Node:
    """The ``_Node`` tree of the YAML in ``text`` (``_Node(None, 1)`` for an empty document).

    Problems that leave the tree readable go to ``report``; a syntax error or a document too
    large to read raises ``RecipeError`` with that one problem, ``source`` naming the text.
    """
    try:
        document = _compose(text)
        return _Reader(report).read(document, "") if document is not None else _Node(None, 1)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = "; ".join(m for m in (exc.context, exc.problem) if m)
        line = mark.line + 1 if mark is not None else None
        message += _placeholder_hint(text, mark.line if mark is not None else None)
        raise RecipeError([Problem(source, line, "", f"YAML syntax error: {message}")]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([Problem(source, None, "", f"cannot read YAML: {exc}")]) from None
    except _TooLarge as exc:
        raise RecipeError([Problem(source, None, "", str(exc))]) from None


# --------------------------------------------------------------------------- --set overrides

TOP_OVERRIDES = ("name", "seed", "workdir", "image")
"""The recipe's own fields that ``--set FIELD=VALUE`` may set (``--set image=REF`` runs every
experiment without an image or framework of its own in REF)."""


def _apply_override(root: _Node, text: str, report: _Report) -> None:
    """Apply one ``EXP.FIELD[.SUB...]=VALUE`` (or a top-level ``FIELD=VALUE`` of
    ``TOP_OVERRIDES``) to ``root``, or report why it cannot be.

    ``VALUE`` is read as YAML; ``EXP`` must be an experiment under ``experiments``, and
    missing or null mappings on the way to ``FIELD`` are created. Problems are reported
    without a line, at the path ``--set EXP.FIELD``.
    """
    key, equals, raw = text.partition("=")
    key = key.strip()
    where = f"--set {key}"
    parts = key.split(".")
    top_level = len(parts) == 1 and key in TOP_OVERRIDES
    if not equals or not all(parts) or (len(parts) < 2 and not top_level):
        report(None, where, f"expected EXP.FIELD=VALUE or one of {', '.join(TOP_OVERRIDES)}"
               f"=VALUE, got {text!r}")
        return
    reader = _Reader(lambda _line, _path, message: report(None, where, message), key)
    try:
        document = _compose(raw)
        value = reader.read(document, where) if document is not None else _Node(None, None, key)
    except yaml.YAMLError as exc:
        report(None, where, f"cannot parse value {raw!r}: {getattr(exc, 'problem', exc)}")
        return
    except _TooLarge as exc:
        report(None, where, str(exc))
        return
    top = root.value if isinstance(root.value, dict) else {}
    if top_level:
        if isinstance(root.value, dict):
            previous = top.get(key)
            top[key] = _Entry(previous.key_line if previous else None, value)
        return
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
        self._hints = 0

    def suggest(self, word: str, choices: Iterable[str]) -> str:
        """``_suggest``, for the first ``HINTS`` calls of this checker."""
        self._hints += 1
        return _suggest(word, choices) if self._hints <= HINTS else ""

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
                hint = self.suggest(key, allowed)
                self.report(entry.key_line, where, f"unknown field {key!r}{hint}")

    def string(self, node: _Node, path: str) -> str | None:
        if isinstance(node.value, str) and node.value.strip():
            return node.value
        self.at(node, path, f"expected a non-empty string, got {_describe(node.value)}")
        return None

    def integer(
        self, node: _Node, path: str, minimum: int = -MAX_INT - 1, maximum: int = MAX_INT
    ) -> int | None:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int):
            self.at(node, path, f"expected an integer, got {_describe(value)}")
            return None
        if value < minimum:
            self.at(node, path, f"must be at least {minimum}, got {value}")
            return None
        if value > maximum:
            self.at(node, path, f"must be at most {maximum}, got {value}")
            return None
        return value

    def number(
        self, node: _Node, path: str, minimum: float, inclusive: bool, maximum: float = math.inf
    ) -> float | None:
        value = _as_float(node.value)
        if value is None:
            self.at(node, path, f"expected a number, got {_describe(node.value)}")
            return None
        if value < minimum or (value == minimum and not inclusive):
            bound = f"at least {minimum:g}" if inclusive else f"greater than {minimum:g}"
            self.at(node, path, f"must be {bound}, got {node.value!r}")
            return None
        if value > maximum:
            self.at(node, path, f"must be at most {maximum:g}, got {node.value!r}")
            return None
        return value

    def duration(self, node: _Node, path: str, maximum: float = MAX_DURATION) -> float | None:
        try:
            if isinstance(node.value, (str, int, float)):
                seconds = parse_duration(node.value)
                if seconds > maximum:
                    self.at(node, path, f"must be at most {format_duration(maximum)}, "
                            f"got {node.value!r}")
                    return None
                if seconds > 0:
                    return seconds
                self.at(node, path, f"must be longer than 0 seconds, got {node.value!r}")
                return None
            self.at(node, path, f"expected a duration such as '30m', got {_describe(node.value)}")
        except UnitError as exc:
            self.at(node, path, str(exc))
        return None
