"""A task's inputs: the data set paths an experiment's ``inputs`` field names.

``inputs: ["coco/train/shard-{{shard}}"]`` says which part of which data set each task
reads: the first path segment is an alias of the experiment's ``data``, the rest a path
inside that data set (a file, or a directory: every file below it), templated with the
task's parameters like the command, but never shell-quoted (a path does not reach a
shell). The agents use it only to place tasks near their data (``agent/claims/placement.py``);
a task still reads whatever its command reads, and an input path that does not exist is
no error (it covers nothing).

Pure: no I/O. ``input_problems`` checks a template at submit; ``render_input`` turns it
into ``(alias, path)`` for one task and re-checks the rendered path, because a parameter
value may put a ``..`` into it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from hypermesh.errors import UsageError
from hypermesh.recipe.templating import (
    BUILTINS,
    malformed_placeholders,
    render_plain,
    template_names,
)

__all__ = ["input_problems", "path_problem", "render_input"]


def path_problem(path: str) -> str | None:
    """Why ``path`` (inside a data set, ``/``-separated) is not a plain relative path,
    or None when it is one. A single trailing ``/`` is allowed."""
    if path.startswith("/"):
        return "must be relative to the data set (no leading '/')"
    parts = path.removesuffix("/").split("/") if path else []
    for part in parts:
        if part in ("", ".", ".."):
            return f"has an empty, '.' or '..' segment: {path!r}"
    return None


def input_problems(
    template: str, aliases: Collection[str], parameters: Collection[str]
) -> list[str]:
    """Why ``template`` cannot name a task's input, one message each; empty when fine.

    ``aliases`` are the experiment's ``data`` aliases, ``parameters`` its parameter names.
    """
    problems: list[str] = []
    alias, _, rest = template.partition("/")
    if not aliases:
        return ["an experiment with 'inputs' needs 'data' (the data sets they are in)"]
    if "{{" in alias:
        problems.append(f"the first segment of {template!r} must be a data alias, "
                        "not a placeholder")
    elif alias not in aliases:
        known = ", ".join(sorted(aliases))
        problems.append(f"{alias!r} is not one of the experiment's data aliases ({known})")
    known_names = set(parameters) | (BUILTINS - {"attempt"})  # an attempt has no place yet
    for name in template_names(template):
        if name not in known_names:
            listed = ", ".join(parameters) or "none"
            problems.append(f"unknown template variable {name!r} (parameters: {listed})")
    for text in malformed_placeholders(template):
        problems.append(f"malformed placeholder {text}: use {{{{name}}}} with an identifier")
    static = render_plain(template, dict.fromkeys(template_names(template), "x")) if not (
        malformed_placeholders(template)
    ) else template
    why = path_problem(static.partition("/")[2])
    if why is not None and rest:
        problems.append(f"path {why}")
    return problems


def render_input(template: str, values: Mapping[str, Any]) -> tuple[str, str]:
    """``(alias, path)`` of ``template`` for one task (``path`` is ``""`` for the whole
    data set). ``UsageError`` when the rendered path is not a plain relative path;
    ``TemplateError`` when a value is missing."""
    text = render_plain(template, values)
    alias, _, path = text.partition("/")
    why = path_problem(path)
    if why is not None:
        raise UsageError(f"input {template!r} renders to {text!r}, whose path {why}")
    return alias, path.removesuffix("/")
