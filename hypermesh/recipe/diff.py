"""What changed in an experiment between recipes: the "modified hyperparameters" that
``hypermesh compare`` shows next to the results of several workflows.

``search_settings`` reads what decides an experiment's trials and how they rank: each
parameter's space (``parameters.NAME``), how many trials and how they are drawn
(``samples``, ``sampling``, ``seed``, ``workers``), how they are judged (``objective``,
``pruning``) and what runs (``command``, ``env``, ``image``). ``differences`` keeps the
settings whose values are not the same in every recipe. Values are plain JSON values;
a parameter one recipe lacks is None there. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hypermesh.recipe.recipe import Experiment, Parameter

COMPARED_FIELDS = ("samples", "sampling", "seed", "workers", "objective", "pruning",
                   "command", "env", "image")
"""The experiment fields besides its parameters that ``differences`` compares, in order."""


def parameter_space(p: Parameter) -> dict[str, Any]:
    """``{"range": [low, high], "sampling": S}`` or ``{"values": [...]}``."""
    if p.kind == "values":
        return {"values": list(p.values)}
    return {"range": [p.low, p.high], "sampling": p.sampling}


def search_settings(exp: Experiment, seed: int) -> dict[str, Any]:
    """The settings of ``exp`` that ``differences`` compares, by field; ``seed`` is the
    workflow's (what its sampling uses unless the experiment sets its own)."""
    settings: dict[str, Any] = {f"parameters.{p.name}": parameter_space(p)
                                for p in exp.parameters}
    objective = exp.objective
    settings.update(
        samples=exp.samples,
        sampling=exp.sampling or "random",
        seed=exp.seed if exp.seed is not None else seed,
        workers=exp.workers,
        objective=None if objective is None else {"metric": objective.metric,
                                                  "goal": objective.goal},
        pruning=exp.pruning,
        command=list(exp.command),
        env=dict(exp.env),
        image=exp.image,
    )
    return settings


def differences(settings: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fields whose value is not the same in every one of ``settings`` (each a
    ``search_settings``, by a label such as the workflow id): field -> label -> value.
    Parameters come first, in the order the recipes name them, then ``COMPARED_FIELDS``."""
    params: list[str] = []
    for one in settings.values():
        params += [k for k in one if k.startswith("parameters.") and k not in params]
    changed: dict[str, dict[str, Any]] = {}
    for name in (*params, *COMPARED_FIELDS):
        values = {label: one.get(name) for label, one in settings.items()}
        if any(v != next(iter(values.values())) for v in values.values()):
            changed[name] = values
    return changed


def describe(field: str, value: Any) -> str:
    """The value of one field as a person reads it: ``range [-10, 10]``, ``range [0.001,
    0.1] loguniform``, ``values [1, 2]``, ``loss (minimize)``, ``-`` for none."""
    if value is None:
        return "-"
    if field.startswith("parameters.") and "range" in value:
        low, high = value["range"]
        how = "" if value.get("sampling") == "uniform" else f" {value['sampling']}"
        return f"range [{low:g}, {high:g}]{how}"
    if field.startswith("parameters."):
        return "values [" + ", ".join(str(v) for v in value["values"]) + "]"
    if field == "objective":
        return f"{value['metric']} ({value['goal']})"
    if field == "command":
        return " && ".join(value)
    if field == "env":
        return " ".join(f"{k}={v}" for k, v in value.items()) or "{}"
    return str(value)
