"""``hypermesh validate``: check recipes without submitting them.

Each RECIPE is loaded as ``submit`` loads it, ``--set`` overrides included. Every problem
goes to stderr as ``path:line: field: message`` (the form of ``RecipeError``'s problems);
a recipe that loads has its plan, tasks per experiment and in all, printed on stdout and
checked against the mesh's ``max-workflow-tasks`` (``hypermesh/recipe/plan.py``), as
``submit`` would check it. The cap is read from etcd when etcd answers; offline,
validate checks against the default and says so on stderr. Exit 0 when every recipe is
valid and within the cap, 2 otherwise; never a traceback.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click

from hypermesh.cli.common import Mesh, err, mesh_options, override_option, print_json
from hypermesh.errors import Problem, RecipeError
from hypermesh.recipe.plan import TaskPlan, plan_tasks
from hypermesh.recipe.recipe import Recipe, load_recipe
from hypermesh.state.settings import DEFAULT_MAX_WORKFLOW_TASKS, load_settings

ETCD_WAIT_S = 3.0
"""How long validate waits for etcd's answer before checking against the default cap."""


@click.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(path_type=Path),
                metavar="RECIPE...")
@override_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One {"file", "valid", "problems", "plan"} object per recipe, in a list.',
)
@mesh_options
def validate(mesh: Mesh, recipes: tuple[Path, ...], overrides: tuple[str, ...],
             as_json: bool) -> None:
    """Check recipes without submitting them: every problem with its line, and the tasks
    each would plan against the mesh's max-workflow-tasks. Exit 0 if all are valid."""
    loaded = [(path, _load(path, overrides)) for path in recipes]
    limit, cap_from = DEFAULT_MAX_WORKFLOW_TASKS, "default"
    if any(isinstance(result, Recipe) for _, result in loaded):
        limit, cap_from = asyncio.run(_mesh_cap(mesh))
    reports = []
    for path, result in loaded:
        problems = result if isinstance(result, list) else []
        plan = plan_tasks(result, limit) if isinstance(result, Recipe) else None
        if plan is not None and plan.over:
            problems = [Problem(str(path), None, "", plan.refusal())]
        for problem in problems:
            click.echo(str(problem), err=True)
        if not as_json and plan is not None:
            _print_plan(path, plan)
        reports.append(_report(path, problems, plan, cap_from))
    if as_json:
        print_json(reports)
    failed = sum(1 for r in reports if not r["valid"])
    if failed:
        err(f"{failed} of {len(reports)} recipe(s) rejected")
    sys.exit(2 if failed else 0)


def _load(path: Path, overrides: tuple[str, ...]) -> Recipe | list[Problem]:
    """The recipe at ``path``, or the problems that reject it."""
    try:
        return load_recipe(path, overrides)
    except RecipeError as exc:
        return exc.problems
    except Exception as exc:  # a bug in the loader: said in one line, never a traceback
        return [Problem(str(path), None, "", f"internal error while checking: {exc!r} "
                        "(a bug in hypermesh: please report it with this recipe)")]


async def _mesh_cap(mesh: Mesh) -> tuple[int, str]:
    """The mesh's ``max-workflow-tasks`` and ``"mesh"``; the default and ``"default"``,
    said on stderr, when etcd does not answer within ``ETCD_WAIT_S`` (or its settings
    cannot be read)."""
    try:
        async with asyncio.timeout(ETCD_WAIT_S):
            async with mesh.connect(timeout=ETCD_WAIT_S) as etcd:
                settings, _ = await load_settings(etcd, mesh.ks)
        return settings.max_workflow_tasks, "mesh"
    except Exception as exc:  # offline is a normal way to run validate: any failure
        reason = str(exc).strip() or type(exc).__name__
        err(f"note: could not read the mesh's settings ({reason}); checked against the "
            f"default max-workflow-tasks ({DEFAULT_MAX_WORKFLOW_TASKS:,})")
        return DEFAULT_MAX_WORKFLOW_TASKS, "default"


def _print_plan(path: Path, plan: TaskPlan) -> None:
    verdict = "over the cap" if plan.over else "valid"
    click.echo(f"{path}: {verdict}: {plan.describe_total()} "
               f"(max-workflow-tasks {plan.limit:,})")
    shown = {name: f"{count:,}" if count <= plan.limit or plan.exact else f"> {plan.limit:,}"
             for name, count in plan.counts.items()}
    names, counts = max(map(len, shown)), max(map(len, shown.values()))
    for name, count in shown.items():
        click.echo(f"  {name:<{names}}  {count:>{counts}} tasks")


def _report(
    path: Path, problems: list[Problem], plan: TaskPlan | None, cap_from: str
) -> dict[str, Any]:
    """One recipe's ``--json`` object; ``plan.cap_from`` says whose cap it was checked
    against (``mesh``, or ``default`` when etcd did not answer)."""
    return {
        "file": str(path),
        "valid": not problems,
        "problems": [{"line": p.line, "field": p.path, "message": p.message}
                     for p in problems],
        "plan": plan.to_json() | {"cap_from": cap_from} if plan is not None else None,
    }
