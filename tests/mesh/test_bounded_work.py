"""Bounded work (issue 22), end to end: a large experiment is written page by page as its
backlog runs low, runs every task once, and the CLI reads it in pages; ``status``
folded to counts says what the full records say. Real etcd, real agents."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from hypermesh.agent.leader.policy import BACKLOG_MIN_TASKS
from hypermesh.cli import common
from hypermesh.state import view as view_module
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh

TASKS = BACKLOG_MIN_TASKS + 904  # a first page and a short second one


def test_a_large_experiment_is_written_in_pages_and_runs_every_task_once(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh.agent("node1", slots=2)
    mesh.agent("node2", slots=2)
    recipe = mesh.write_recipe(f"""
experiments:
  many: {{samples: {TASKS}, parameters: {{x: {{values: [a, b, c]}}}}, command: ["true"]}}
  after: {{after: [many], command: ["true"]}}
""")
    wid = mesh.submit(recipe)
    status = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert status["state"] == "succeeded", mesh.logs()
    assert status["experiments"]["many"]["succeeded"] == TASKS
    assert status["experiments"]["after"]["succeeded"] == 1

    # The leader wrote a first page of BACKLOG_MIN_TASKS, then the rest when it ran low.
    log = "\n".join(a.log_path.read_text() for a in mesh.agents.values())
    pages = [int(n) for n in re.findall(rf"(?:expanded|extended) {wid}/many by (\d+) tasks",
                                        log)]
    assert pages == [BACKLOG_MIN_TASKS, TASKS - BACKLOG_MIN_TASKS], pages

    listed = mesh.hm("tasks", wid, "--experiment", "many", "--limit", "5", "--json",
                     check=True)
    rows = json.loads(listed.stdout)
    assert [r["index"] for r in rows] == list(range(5))
    assert all(r["state"] == "succeeded" and len(r["attempts"]) == 1 for r in rows)
    assert f"{TASKS - 5} more task(s) not listed" in listed.stderr

    # Folded to counts (every settled block), status reads as from the full records.
    monkeypatch.setattr(view_module, "FOLD_AFTER_TASKS", 0)

    async def both() -> tuple[dict, dict, int]:
        ks = Keyspace(mesh.namespace)
        async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
            folded = await common.load_view(etcd, ks, wid, fold=True)
            full = await common.load_view(etcd, ks, wid)
        return folded.workflow_summary(wid), full.workflow_summary(wid), len(folded.folded)

    folded, full, blocks = asyncio.run(both())
    assert folded == full and blocks > 0
