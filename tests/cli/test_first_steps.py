"""What a new user stumbles on first (issue 22), each against the real thing: real etcd and
agents for the mesh commands, the real CLI in a subprocess for its errors and help."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from hypermesh.cli.common import aligned
from hypermesh.cli.main import main
from hypermesh.local.processes import wait_for
from hypermesh.recipe.recipe import load_recipe
from tests.conftest import Mesh

ROOT = Path(__file__).resolve().parents[2]
K80_RECIPE = """
name: fig
experiments:
  train:
    parameters: {lr: {range: 0.1-0.3}}
    samples: 2
    hardware: {gpu: k80}
    command: ["echo trained {{lr}}"]
"""


def _get(address: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
        return json.load(reply)


def test_tasks_no_live_node_can_run_say_why_until_a_node_that_can_joins(mesh: Mesh) -> None:
    node = mesh.agent("node1", slots=1)
    mesh.agent("node2", slots=1)
    submitted = mesh.hm("submit", str(mesh.write_recipe(K80_RECIPE)), check=True)
    why = "no live node has gpu k80 (0 of 2 nodes match)"
    assert f"warning: experiment 'train': {why}; its tasks wait until such a node joins" in (
        submitted.stderr
    )
    wid = submitted.stdout.split()[-1]
    tasks = wait_for(lambda: len(t := mesh.hm_json("tasks", wid)) == 2 and t, 30,
                     "the leader to write the tasks", interval=0.2)
    assert [(t["state"], t["waiting"]) for t in tasks] == [("pending", why)] * 2
    assert mesh.hm_json("status", wid)["experiments"]["train"]["waiting"] == why
    assert f"\n    {why}\n" in mesh.hm("status", wid, check=True).stdout
    table = mesh.hm("tasks", wid, check=True).stdout.splitlines()
    assert table[1] == table[3] == f"  {why}" and table[0].startswith(f"{wid}.train.0 ")
    # The dashboard shows what status and tasks show.
    listed = _get(node.http_address, "/api/workflows")["workflows"]
    assert listed[0]["experiments"]["train"]["waiting"] == why
    shown = _get(node.http_address, f"/api/workflows/{wid}")
    assert [t["waiting"] for t in shown["tasks"]] == [why, why]
    # A node with a K80 joins: the reason goes, the tasks run on it.
    mesh.agent("gpu1", slots=1, extra=("--gpus", "1", "--gpu-type", "Tesla K80"))
    status = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert status["state"] == "succeeded" and "waiting" not in status["experiments"]["train"]
    assert {t["node"] for t in mesh.hm_json("tasks", wid)} == {"gpu1"}


def test_status_columns_fit_their_content() -> None:
    lines = aligned(
        [["EXPERIMENT", "STATE", "TOTAL", "PEND"],
         ["a-long-experiment-name", "running", "1000000010000000", "10000000"],
         ["b", "pending", "3", "3"]],
        right=range(2, 4),
    )
    assert lines == [
        "EXPERIMENT              STATE               TOTAL      PEND",
        "a-long-experiment-name  running  1000000010000000  10000000",
        "b                       pending                 3         3",
    ]


def test_logs_of_no_such_task_and_tasks_listing_the_cancelled_dependents(mesh: Mesh) -> None:
    mesh.agent(slots=1)
    recipe = mesh.write_recipe(
        "experiments:\n  a: {command: ['until [ -f gate ]; do sleep 0.05; done; false']}\n"
        "  b: {after: [a], samples: 2, command: ['true']}\n"
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: mesh.hm_json("status", wid)["experiments"]["a"]["running"] == 1, 30,
             "a.0 to run", interval=0.2)
    # logs tells a task that does not exist from one that has not started.
    for task, says in [
        (f"{wid}.nope.0", f"no task {wid}.nope.0 in workflow {wid}: its experiments are a, b"),
        (f"{wid}.b.2", f"no task {wid}.b.2 in workflow {wid}: experiment b has tasks 0 to 1"),
        (f"{wid}.a.1", f"no task {wid}.a.1 in workflow {wid}: experiment a has tasks 0 to 0"),
        ("nope-123456.a.0", "no task nope-123456.a.0: there is no workflow 'nope-123456'"),
        (f"{wid}.b.1", f"task {wid}.b.1 has not run yet (no attempts)"),
    ]:
        result = mesh.hm("logs", task)
        assert (result.returncode, result.stderr) == (1, f"hypermesh: error: {says}\n")
    # a fails: tasks lists b's tasks, never created, as cancelled, as status counts them.
    (mesh.root / "gate").touch()
    status = mesh.wait_state(wid, {"failed"})
    assert status["experiments"]["b"]["cancelled"] == 2
    tasks = mesh.hm_json("tasks", wid)
    assert [(t["id"], t["state"]) for t in tasks] == [
        (f"{wid}.a.0", "failed"), *((f"{wid}.b.{i}", "cancelled") for i in range(2))]
    only = mesh.hm_json("tasks", wid, "--experiment", "b", "--state", "cancelled")
    assert len(only) == 2 and only[0]["attempts"] == [] and only[0]["params"] == {}
    plain = mesh.hm("tasks", wid, "--state", "cancelled", check=True).stdout.splitlines()
    assert [line.split()[:2] for line in plain] == [[f"{wid}.b.{i}", "cancelled"] for i in range(2)]
    # The columns of status are as wide as their widest cell, header included.
    table = mesh.hm("status", wid, check=True).stdout.splitlines()[1:4]
    assert table[0].split() == ["EXPERIMENT", "STATE", "TOTAL", "PEND", "RUN", "OK", "FAIL", "CANC"]
    assert len({len(line) for line in table}) == 1 and table[2].endswith("  2")


def test_best_without_an_objective_says_how_and_ranks_by_a_named_metric(mesh: Mesh) -> None:
    mesh.agent(slots=3)
    recipe = mesh.write_recipe(
        """
experiments:
  sweep:
    parameters: {acc: {values: [0.5, 0.9, 0.7]}}
    command: ['echo HM_METRIC {\\"val_acc\\": {{acc}}}']
"""
    )
    wid = mesh.submit(recipe, "--wait")
    refused = mesh.hm("best", wid)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and (
        f"workflow {wid} has no experiment with an objective: rank by a metric with "
        "--metric NAME [--goal maximize] (its tasks reported: val_acc), or declare one in "
        "the recipe: objective: {metric: NAME, goal: minimize|maximize}"
    ) in refused.stderr
    rows = mesh.hm_json("best", wid, "--metric", "val_acc", "--goal", "maximize")
    assert [(r["rank"], r["value"], r["goal"]) for r in rows] == [
        (1, 0.9, "maximize"), (2, 0.7, "maximize"), (3, 0.5, "maximize")]
    lowest = mesh.hm_json("best", wid, "--metric", "val_acc", "-n", "1")
    assert [(r["value"], r["params"]) for r in lowest] == [(0.5, {"acc": 0.5})]
    alone = mesh.hm("best", wid, "--goal", "maximize")
    assert alone.returncode == 2 and "--goal needs --metric NAME" in alone.stderr
    # The README's example declares its objective, so `best` ranks it as it is.
    sweep = load_recipe(ROOT / "examples/pipeline/pipeline.yaml").experiment("sweep")
    assert sweep.objective is not None and sweep.objective.metric == "val_acc"


# ------------------------------------------------------------------ etcd that does not answer


def _hm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hypermesh", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never says a word."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def test_an_unresolvable_etcd_host_is_one_clear_line() -> None:
    result = _hm("--etcd", "http://no-such-host.invalid:2379", "status")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        "hypermesh: error: cannot reach etcd at no-such-host.invalid:2379: cannot resolve "
        "host name 'no-such-host.invalid'"
    )
    assert result.stderr.count("\n") == 1, result.stderr  # no gRPC log lines, no repr


def test_a_silent_etcd_port_is_one_clear_line(silent_port: int) -> None:
    result = _hm("status", "--etcd", f"http://127.0.0.1:{silent_port}")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        f"hypermesh: error: cannot reach etcd at 127.0.0.1:{silent_port}: no answer within 5 s\n"
    )


def test_etcd_named_by_a_host_name_is_reached(mesh: Mesh) -> None:
    # "localhost" resolves on every machine (etcd listens on loopback only); the CLI
    # resolves it itself (hypermesh/etcd_endpoints.py resolve) before dialling.
    port = mesh.etcd.url.rsplit(":", 1)[1]
    result = mesh.hm("--etcd", f"http://localhost:{port}", "status", "--json", check=True)
    assert json.loads(result.stdout) == []


# ------------------------------------------------------------------ help


def _commands(group: click.Group, path: str) -> Iterator[tuple[str, click.Command]]:
    for name, command in group.commands.items():
        yield f"{path} {name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, f"{path} {name}")


def test_no_help_text_shows_rest_markup() -> None:
    from hypermesh.chunkfs.mount import mount

    commands = [("hypermesh", main), *_commands(main, "hypermesh"), ("hypermesh mount", mount)]
    for name, command in commands:
        text = command.get_help(click.Context(command, info_name=name))
        assert "``" not in text and ":func:" not in text, f"{name} --help:\n{text}"
    assert "workers cap" in _hm("scale", "--help").stdout


def test_every_command_takes_dash_h_and_nodes_explains_its_hits_column() -> None:
    mount = _hm("mount", "-h")
    assert mount.returncode == 0 and mount.stdout.startswith("Usage: hypermesh mount ")
    assert "-h, --help" in mount.stdout
    nodes = _hm("nodes", "-h").stdout
    assert "HITS C/P/S %" in nodes and "its own chunk cache (C)" in " ".join(nodes.split())
