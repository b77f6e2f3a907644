"""What the CLI and the dashboard may show of a recipe's environment: names, never values.

A recipe's ``env`` is where a workflow carries what its tasks need, secrets included
(``API_TOKEN: ...``), so every value is shown as ``REDACTED``, not only those whose names
look secret: a pattern on names (KEY, TOKEN, PASSWORD...) misses ``DATABASE_URL`` with a
password in it, ``SENTRY_DSN`` or a site's own names, and following a workflow needs the
names alone (the submitter has the recipe). The workflow record in etcd keeps the values,
since the agents that run the tasks read them there: etcd access must be restricted
(``docs/recipes.md``, "The task's environment and secrets").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hypermesh.recipe.recipe import Experiment

REDACTED = "***"


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as it may be shown: every name, each value ``REDACTED``."""
    return dict.fromkeys(env, REDACTED)


def shown_task_env(exp: Experiment) -> dict[str, Any]:
    """What an experiment's tasks get besides hypermesh's own variables: its ``env``
    (values redacted) and the agent variables it passes by name (``pass_env``)."""
    return {"env": shown_env(exp.env), "pass_env": list(exp.pass_env)}
