"""A failure stays in its workflow (issue 22): a workflow whose expansion raises on the
leader ends ``failed`` with the reason in ``status``, and the scheduling of every other
workflow goes on: one submitted after it runs to the end. Real etcd, real agents."""

from __future__ import annotations

import asyncio
import textwrap
import time

from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.records import WorkflowRecord, dumps
from hypermesh.state.txns import state_value
from tests.conftest import Mesh

SOUND = """
experiments:
  e:
    parameters: {x: {values: [a, b]}}
    samples: 3
    command: ["echo {{x}}"]
"""


def write_unexpandable(mesh: Mesh) -> str:
    """Write a workflow straight into etcd, past ``submit`` and its loader, whose
    parameter has no values: planning counts its 3 samples, drawing them raises."""
    wf = WorkflowRecord(
        id="broken-000001", name="broken", recipe=parse_recipe(textwrap.dedent(SOUND)),
        seed=1, submitted_at=time.time(), workdir=str(mesh.root),
    )
    record = wf.to_json()
    record["recipe"]["experiments"][0]["parameters"][0]["values"] = []
    ks = Keyspace(mesh.namespace)

    async def write() -> None:
        async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
            done = await etcd.txn([], [
                etcd.op_put(ks.workflow(wf.id), dumps(record)),
                etcd.op_put(ks.workflow_state(wf.id), state_value("pending")),
            ])
            assert done.succeeded

    asyncio.run(write())
    return wf.id


def test_a_workflow_whose_expansion_raises_fails_alone(mesh: Mesh) -> None:
    mesh.agent("node1", slots=2)
    mesh.agent("node2", slots=2)
    broken = write_unexpandable(mesh)
    fine = mesh.submit(mesh.write_recipe(SOUND))

    status = mesh.wait_state(broken, {"failed", "succeeded", "cancelled"}, timeout=60)
    assert status["state"] == "failed"
    assert status["reason"].startswith("expanding experiment 'e' failed: ")
    assert "no values" in status["reason"]
    text = mesh.hm("status", broken, check=True).stdout
    assert f"reason: {status['reason']}" in text

    done = mesh.wait_state(fine, {"failed", "succeeded", "cancelled"}, timeout=60)
    assert done["state"] == "succeeded", mesh.logs()
    assert done["experiments"]["e"]["succeeded"] == 3
    assert "reason" not in done
    # Every workflow listed, the failed one with its reason.
    listed = {s["id"]: s for s in mesh.hm_json("status")}
    assert listed[broken]["reason"] == status["reason"] and "reason" not in listed[fine]
