"""Fields that are one name or a list of names (``pools``, ``prefer_pools``, ``pass_env``),
and ``pass_env`` itself: the agent's environment variables an experiment's tasks get.

A task's environment is its recipe's ``env`` and what hypermesh sets, plus an allow-list of
the agent's (PATH, HOME, the locale: ``agent/tasks/task_env.py``); the agent's credentials
reach a task only when its experiment names them, as in
``pass_env: [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY]``. Each is a variable name; one the
agent running the task lacks is absent from the task's environment, not an error.
"""

from __future__ import annotations

import re

from hypermesh.recipe.located import _Node, _NodeChecker

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def name_list(
    checker: _NodeChecker, node: _Node, path: str, pattern: re.Pattern[str], kind: str,
    rule: str,
) -> tuple[str, ...] | None:
    """One ``kind`` name or a list of them, each matching ``pattern`` (``rule`` says how)
    and given once, in the order given; None (after recording why) when any is not."""
    items = node.value if isinstance(node.value, list) else [node]
    if not items:
        checker.at(node, path, f"expected one {kind} name or a list of them, got an empty list")
        return None
    names: dict[str, None] = {}  # an ordered set
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(node.value, list) else path
        name = checker.string(item, where)
        if name is None:
            continue
        if not pattern.fullmatch(name):
            checker.at(item, where, f"{name[:80]!r} is not a {kind} name ({rule})")
        elif name in names:
            checker.at(item, where, f"{kind} {name!r} is listed twice")
        else:
            names[name] = None
    return tuple(names) if len(names) == len(items) else None


def check_pass_env(checker: _NodeChecker, node: _Node, path: str) -> tuple[str, ...] | None:
    """``pass_env``: one variable name or a list of them."""
    return name_list(checker, node, path, ENV_NAME_RE, "variable",
                     "letters, digits and '_', not starting with a digit")
