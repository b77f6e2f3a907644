"""``{{name}}`` substitution into shell command lines, with every value shell-quoted.

A placeholder is ``{{`` + optional spaces + an identifier + optional spaces + ``}}``. ``render``
replaces each with ``shlex.quote(format_value(value))``, so a parameter value always reaches
the program as exactly one argument and is never read as shell syntax (the invariant "a
parameter value is data"). That only holds where the placeholder stands outside shell quotes:
``'{{x}}'`` or ``"{{x}}"`` would put hypermesh's quotes inside the user's, so recipe
validation rejects quoted placeholders (``quoted_placeholders``) and malformed ones
(``malformed_placeholders``) before anything runs.

Parameters also reach tasks as environment variables: ``param_env`` names them
``HM_PARAM_<NAME>`` with the name upper-cased, holding the same text ``render`` would quote.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Callable, Collection, Mapping
from typing import Any

from hypermesh.errors import FatalError

__all__ = [
    "BUILTINS",
    "PARAM_ENV_PREFIX",
    "TemplateError",
    "format_value",
    "malformed_placeholders",
    "param_env",
    "placeholder_problems",
    "quoted_placeholders",
    "render",
    "render_plain",
    "template_names",
]

# Names every command may use besides the experiment's parameters; the agent supplies them.
BUILTINS: frozenset[str] = frozenset(
    {"workflow_id", "experiment", "task_id", "task_index", "attempt"}
)
PARAM_ENV_PREFIX = "HM_PARAM_"
_LISTED = 20  # parameters a problem lists at most

# Anything between double braces; the content decides whether it is a valid placeholder.
_BRACES = re.compile(r"\{\{([^{}]*)\}\}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TemplateError(FatalError, LookupError):
    """A template named a value that was not given, or held a malformed placeholder."""


def _placeholders(template: str) -> list[tuple[re.Match[str], str | None]]:
    """Every ``{{...}}`` in ``template`` with its name, or None when the content is no name."""
    found: list[tuple[re.Match[str], str | None]] = []
    for match in _BRACES.finditer(template):
        inner = match.group(1).strip()
        found.append((match, inner if _IDENTIFIER.fullmatch(inner) else None))
    return found


def template_names(template: str) -> list[str]:
    """The names ``template`` uses, each once, in order of first use."""
    names: dict[str, None] = {}  # an ordered set: a long command has many placeholders
    for _, name in _placeholders(template):
        if name is not None:
            names[name] = None
    return list(names)


def malformed_placeholders(template: str) -> list[str]:
    """The ``{{...}}`` texts in ``template`` whose content is not an identifier."""
    return [match.group(0) for match, name in _placeholders(template) if name is None]


def quoted_placeholders(template: str) -> list[str]:
    """The placeholders of ``template`` inside shell quotes or right after a backslash.

    There, the quotes ``render`` adds would not make the value one inert word. The scan follows
    POSIX sh quoting only as far as quotes and backslashes go (it does not parse ``$(...)`` or
    here-documents), so inside those a placeholder counts as quoted if the quote characters
    around it say so.
    """
    spans = {match.start(): match for match, _ in _placeholders(template)}
    quoted: list[str] = []
    state = ""  # "", "'" or '"'
    index = 0
    while index < len(template):
        char = template[index]
        if index in spans and state:
            quoted.append(spans[index].group(0))
            index = spans[index].end()
            continue
        if index in spans:
            index = spans[index].end()
            continue
        if char == "\\" and state != "'":
            if index + 1 in spans:  # a backslash would escape the opening quote of the value
                quoted.append(spans[index + 1].group(0))
                index = spans[index + 1].end()
            else:
                index += 2
            continue
        if state == "" and char in "'\"":
            state = char
        elif char == state:
            state = ""
        index += 1
    return quoted


def placeholder_problems(template: str, parameters: Collection[str]) -> list[str]:
    """Why ``template`` cannot be rendered safely for an experiment with ``parameters``: one
    message per unknown name (not a parameter nor a built-in), malformed placeholder, and
    placeholder inside quotes. Empty when the template is fine."""
    known = set(parameters) | BUILTINS
    candidates = sorted(known)
    names = list(parameters)
    listed = ", ".join(names[:_LISTED]) + (", ..." if len(names) > _LISTED else "") or "none"
    messages: list[str] = []
    for name in template_names(template):
        if name not in known:
            # Hints for the first few only: each compares the name with every parameter.
            close = difflib.get_close_matches(name, candidates, n=1) if len(messages) < 10 else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            messages.append(f"unknown template variable {name!r}{hint} (parameters: {listed})")
    for text in malformed_placeholders(template):
        messages.append(f"malformed placeholder {text}: use {{{{name}}}} with an identifier")
    for text in quoted_placeholders(template):
        messages.append(
            f"placeholder {text} stands inside shell quotes or after a backslash; hypermesh "
            "quotes values itself, so write it bare"
        )
    return messages


def format_value(value: Any) -> str:
    """The text form of a parameter value, used both in commands and in the environment.

    ``True``/``False`` become ``"true"``/``"false"``, ints their decimal form, floats the
    shortest text that reads back as the same float (``repr``), strings themselves, and
    ``None`` the empty string; anything else is ``str(value)``.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return str(value)


def render(template: str, values: Mapping[str, Any]) -> str:
    """``template`` with every placeholder replaced by its shell-quoted value.

    Raises ``TemplateError`` for a name missing from ``values`` or a malformed placeholder.
    """
    return _substitute(template, values, shlex.quote)


def render_plain(template: str, values: Mapping[str, Any]) -> str:
    """``template`` with every placeholder replaced by its value's text, unquoted: for
    templates that never reach a shell (a task's input paths). Errors as ``render``."""
    return _substitute(template, values, lambda text: text)


def _substitute(template: str, values: Mapping[str, Any], quote: Callable[[str], str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        name = match.group(1).strip()
        if not _IDENTIFIER.fullmatch(name):
            raise TemplateError(f"malformed placeholder {match.group(0)!r} in {template!r}")
        if name not in values:
            known = ", ".join(sorted(values)) or "none"
            raise TemplateError(
                f"unknown template variable {name!r} in {template!r} (known: {known})"
            )
        return quote(format_value(values[name]))

    return _BRACES.sub(substitute, template)


def param_env(params: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables for a task's parameters: ``{"HM_PARAM_LR": "0.25", ...}``."""
    return {f"{PARAM_ENV_PREFIX}{name.upper()}": format_value(v) for name, v in params.items()}
