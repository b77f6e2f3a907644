"""Why no live node may run an experiment (``unmet_needs``), as a table, and the
``waiting`` that ``status`` and ``tasks`` carry from it (``MeshView``)."""

from __future__ import annotations

from typing import Any

import pytest

from hypermesh.recipe.recipe import Experiment, parse_recipe
from hypermesh.state.fit import allowed_on, unmet_needs
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import NodeRecord
from tests.state.test_model import Feed

GIB = 1024**3
CPU = {"cpus": 8.0, "memory": 32 * GIB}
K80 = {"cpus": 8.0, "memory": 32 * GIB, "gpus": 2, "gpu_type": "Tesla K80"}


def experiment(fields: str) -> Experiment:
    recipe = parse_recipe(f"experiments:\n  e: {{command: ['true'], {fields}}}\n")
    return recipe.experiment("e")


def nodes(*machines: dict[str, Any], state: str = "alive") -> list[NodeRecord]:
    return [NodeRecord(f"n{i}", "a", state=state, **m) for i, m in enumerate(machines)]


@pytest.mark.parametrize(
    ("fields", "machines", "why"),
    [
        ("hardware: {gpu: k80}", [CPU, CPU, CPU],
         "no live node has gpu k80 (0 of 3 nodes match)"),
        ("hardware: {gpu: v100}", [K80], "no live node has gpu v100 (0 of 1 nodes match)"),
        ("hardware: {gpu: k80, gpus: 4}", [K80],
         "no live node has 4 k80 gpus (0 of 1 nodes match)"),
        ("hardware: {gpus: 0.5}", [CPU], "no live node has 0.5 gpu (0 of 1 nodes match)"),
        ("hardware: {gpus: 3}", [K80], "no live node has 3 gpus (0 of 1 nodes match)"),
        ("hardware: {cpus: 16}", [CPU, K80], "no live node has 16 cpus (0 of 2 nodes match)"),
        ("hardware: {memory: 64GiB}", [CPU], "no live node has 64GiB memory (0 of 1 nodes match)"),
        ("hardware: {gpu: k80, memory: 64GiB}", [CPU],
         "no live node has gpu k80 and 64GiB memory (0 of 1 nodes match)"),
        ("pools: [onprem]", [CPU], "no live node has pool onprem (0 of 1 nodes match)"),
        ("pools: [a, b]", [CPU], "no live node has pool a or b (0 of 1 nodes match)"),
        # Each need is met by some node, but no node meets them all.
        ("hardware: {gpu: k80, cpus: 16}", [K80, {"cpus": 32.0}],
         "no live node has gpu k80 and 16 cpus at once (0 of 2 nodes match)"),
        ("hardware: {gpu: k80}", [], "no live node in the mesh"),
        # A fitting node is enough; memory unstated by a node fits.
        ("hardware: {gpu: k80}", [CPU, K80], None),
        ("hardware: {memory: 64GiB}", [{"cpus": 4.0}], None),
        ("retries: 0", [CPU], None),
    ],
)
def test_unmet_needs_names_what_no_live_node_has(
    fields: str, machines: list[dict[str, Any]], why: str | None
) -> None:
    exp = experiment(fields)
    found = nodes(*machines)
    assert unmet_needs(exp, found) == why
    assert (why is None) == any(allowed_on(exp, n) for n in found)  # the claimers' own test


def test_only_alive_nodes_count() -> None:
    exp = experiment("hardware: {gpu: k80}")
    draining = nodes(K80, state="draining")
    assert unmet_needs(exp, draining) == "no live node in the mesh"
    assert unmet_needs(exp, [*draining, *nodes(CPU)]) == (
        "no live node has gpu k80 (0 of 1 nodes match)"
    )


# ------------------------------------------------------------------ what status and tasks carry

RECIPE = """
name: fig
experiments:
  prep: {parameters: {i: {values: [0, 1]}}, command: ['true']}
  train:
    after: [prep]
    hardware: {gpu: k80}
    command: ['true']
"""


def test_status_and_tasks_say_why_pending_tasks_wait_and_stop_once_a_node_fits() -> None:
    feed = Feed()
    feed.workflow("w", RECIPE)
    for i in range(3):
        feed.node(f"cpu{i}", cpus=8.0)
    feed.expand("w", "prep", 2)
    train = feed.expand("w", "train", 1)[0]
    why = "no live node has gpu k80 (0 of 3 nodes match)"
    experiments = feed.view.workflow_summary("w")["experiments"]
    assert "waiting" not in experiments["prep"] and experiments["train"]["waiting"] == why
    assert feed.view.task_json(train)["waiting"] == why
    assert "waiting" not in feed.view.task_json(TaskRef("w", "prep", 0))
    feed.node("gpu1", cpus=8.0, gpus=1, gpu_type="Tesla K80")
    assert "waiting" not in feed.view.workflow_summary("w")["experiments"]["train"]
    assert "waiting" not in feed.view.task_json(train)
    feed.delete(feed.ks.node("gpu1"))  # it left: the tasks wait again
    assert feed.view.task_json(train)["waiting"] == why
    feed.finish(train, "succeeded")  # a decided task waits for nothing
    assert "waiting" not in feed.view.task_json(train)
    assert "waiting" not in feed.view.workflow_summary("w")["experiments"]["train"]
