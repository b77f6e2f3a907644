"""The agent's event loop (``hypermesh.cli.common.agent_loop_runner``): uvloop's, or
asyncio's with ``HYPERMESH_EVENT_LOOP=asyncio``. Real agents on each run tasks, say in
their log which loop they run on, and drain on SIGTERM; a value that names neither is
refused before the agent starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import uvloop

from hypermesh.cli.common import ENV_EVENT_LOOP, agent_loop_runner
from hypermesh.errors import UsageError
from tests.conftest import Mesh

RECIPE = """
name: loops
experiments:
  echo:
    parameters: {i: {values: [1, 2, 3, 4, 5, 6]}}
    command: ["echo i={{i}} && test {{i}} -ne 4"]
    retries: 0
"""


def test_uvloop_unless_asyncio_is_asked_for_and_nothing_else_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_EVENT_LOOP, raising=False)
    assert agent_loop_runner() is uvloop.run
    monkeypatch.setenv(ENV_EVENT_LOOP, "")
    assert agent_loop_runner() is uvloop.run
    monkeypatch.setenv(ENV_EVENT_LOOP, " Asyncio ")
    assert agent_loop_runner() is asyncio.run
    monkeypatch.setenv(ENV_EVENT_LOOP, "uv")
    with pytest.raises(UsageError, match="HYPERMESH_EVENT_LOOP='uv': expected uvloop or asyncio"):
        agent_loop_runner()


def _run_on(mesh: Mesh, name: str) -> None:
    """The recipe runs on ``name`` alone: five tasks succeed, one fails with its exit
    code, each output recorded once; then the agent drains and exits 0 on SIGTERM."""
    agent = mesh.agent(name, slots=2)
    wid = mesh.submit(mesh.write_recipe(RECIPE, f"{name}.yaml"))
    status = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert status["state"] == "failed"
    tasks = mesh.hm_json("tasks", wid)
    assert sorted((t["index"], t["state"], t["node"], [a["exit_code"] for a in t["attempts"]])
                  for t in tasks) == [
        (i, "failed" if i == 3 else "succeeded", name, [1 if i == 3 else 0]) for i in range(6)
    ]
    logs = mesh.hm("logs", f"{wid}.echo.1", check=True).stdout
    assert logs.count("\ni=2\n") == 1
    assert agent.terminate(timeout=30) == 0


def test_an_agent_on_either_loop_runs_tasks_and_drains(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_EVENT_LOOP, raising=False)
    _run_on(mesh, "fast")
    monkeypatch.setenv(ENV_EVENT_LOOP, "asyncio")
    _run_on(mesh, "plain")
    assert "fast: event loop: uvloop" in mesh.agents["fast"].log_path.read_text()
    assert "plain: event loop: asyncio" in mesh.agents["plain"].log_path.read_text()


def test_an_agent_asked_for_an_unknown_loop_exits_2_before_it_registers(mesh: Mesh) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hypermesh", "agent", "start", "--name", "odd",
         "--listen", "127.0.0.1:0", "--work-dir", str(mesh.root / "odd")],
        env={**mesh.env, ENV_EVENT_LOOP: "tokio"}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "HYPERMESH_EVENT_LOOP='tokio': expected uvloop or asyncio" in done.stderr
    assert mesh.hm_json("nodes") == []
