"""``--json`` of ``submit``, ``pool set`` and ``pool rm``, and the plain output of
``submit``, ``tasks``, ``retry``, ``scale`` and ``extend``, against a real mesh (real
etcd, a real agent)."""

from __future__ import annotations

import json
import re

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh

GATED = "until [ -f gate ]; do sleep 0.05; done"


def test_submit_json_with_and_without_wait(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe(
        "name: jsonic\nexperiments:\n  a: {samples: 2, command: ['true']}\n"
        "  b: {after: [a], command: ['true']}\n"
    )
    plain = mesh.hm("submit", str(recipe), "--seed", "5", check=True)
    assert re.fullmatch(r"jsonic-[0-9a-f]+\n", plain.stdout)  # unchanged: the id alone
    out = json.loads(mesh.hm("submit", str(recipe), "--seed", "7", "--json", check=True).stdout)
    assert out == {"workflow": out["workflow"], "name": "jsonic", "seed": 7,
                   "experiments": ["a", "b"], "state": "pending"}
    assert mesh.hm_json("status", out["workflow"])["name"] == "jsonic"
    waited = mesh.hm("submit", str(recipe), "--name", "waited", "--wait", "--json", check=True)
    body = json.loads(waited.stdout)  # the progress went to stderr, stdout is one object
    assert body["name"] == "waited" and body["state"] == "succeeded"
    assert f"{body['workflow']}: succeeded" in waited.stderr
    assert mesh.hm_json("status", body["workflow"])["state"] == "succeeded"
    failing = mesh.write_recipe("experiments:\n  bad: {command: ['false']}\n", "bad.yaml")
    failed = mesh.hm("submit", str(failing), "--wait", "--json")
    assert failed.returncode == 1 and json.loads(failed.stdout)["state"] == "failed"
    rejected = mesh.hm("submit", str(mesh.write_recipe("experiments: 3\n", "x.yaml")), "--json")
    assert rejected.returncode == 2 and rejected.stdout == ""


def test_pool_set_and_rm_json(mesh: Mesh) -> None:
    args = ("pool", "set", "cloud", "--kind", "local", "--price", "3", "--max", "4", "--spot")
    first = json.loads(mesh.hm(*args, "--option", "root=/tmp/x", "--json", check=True).stdout)
    assert first["name"] == "cloud" and first["kind"] == "local" and first["price"] == 3.0
    assert first["spot"] is True and first["max_nodes"] == 4
    assert first["options"] == {"root": "/tmp/x"} and first["replaced"] is False
    second = json.loads(mesh.hm(*args, "--json", check=True).stdout)
    assert second["replaced"] is True and second["options"] == {}
    (listed,) = mesh.hm_json("pool", "ls")
    assert {k: listed[k] for k in second if k != "replaced"} == {
        k: v for k, v in second.items() if k != "replaced"}
    bad = mesh.hm("pool", "set", "cloud", "--max", "-1", "--json")
    assert bad.returncode == 2 and bad.stdout == "" and "--max" in bad.stderr
    assert mesh.hm_json("pool", "ls")[0]["max_nodes"] == 4  # nothing was written
    removed = json.loads(mesh.hm("pool", "rm", "cloud", "--json", check=True).stdout)
    assert removed == {"name": "cloud", "declaration": {
        k: v for k, v in second.items() if k != "replaced"}}
    assert mesh.hm_json("pool", "ls") == []
    again = mesh.hm("pool", "rm", "cloud", "--json")
    assert again.returncode == 1 and again.stdout == "" and "no pool 'cloud'" in again.stderr
    plain = mesh.hm(*args, check=True)
    assert plain.stdout == "" and "pool cloud set (local)" in plain.stderr
    plain = mesh.hm("pool", "rm", "cloud", check=True)
    assert plain.stdout == "" and "pool cloud removed" in plain.stderr


def test_plain_output_of_tasks_retry_scale_extend(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe(
        f"""
experiments:
  flaky:
    parameters: {{x: {{values: [1, 2]}}}}
    command: ["test -f fixed || [ $HM_PARAM_X = 1 ]"]
  slow: {{after: [flaky], samples: 2, workers: 1, command: ["{GATED}"]}}
"""
    )
    wid = mesh.submit(recipe)
    mesh.wait_state(wid, {"failed"})
    lines = mesh.hm("tasks", wid, "--experiment", "flaky", check=True).stdout.splitlines()
    assert len(lines) == 2
    ok = re.fullmatch(rf"{wid}\.flaky\.0 +succeeded +node1 +attempts=1 exit=0 x=1", lines[0])
    failed = re.fullmatch(rf"{wid}\.flaky\.1 +failed +node1 +attempts=1 exit=1 x=2", lines[1])
    assert ok and failed, lines
    (mesh.root / "fixed").touch()
    retried = mesh.hm("retry", wid, check=True)
    assert retried.stdout == f"{wid}.flaky.1\n"  # the ids on stdout, the count on stderr
    assert f"{wid}: 1 failed task(s) will run again" in retried.stderr
    wait_for(lambda: mesh.hm_json("status", wid)["experiments"]["slow"]["running"] == 1,
             30, "a slow task to run", interval=0.2)
    scaled = mesh.hm("scale", wid, "slow", "--workers", "2", check=True)
    assert scaled.stdout == "" and f"{wid} slow: workers 1 -> 2" in scaled.stderr
    extended = mesh.hm("extend", wid, "slow", "--samples", "1", check=True)
    assert extended.stdout == "" and f"{wid} slow: 1 task(s) added, 3 in all" in extended.stderr
    again = mesh.hm("retry", wid, check=True)
    assert again.stdout == "" and f"{wid}: no failed tasks" in again.stderr
    (mesh.root / "gate").touch()
    assert mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})["state"] == "succeeded"
    slow = mesh.hm("tasks", wid, "--state", "succeeded", "--experiment", "slow", check=True)
    assert [line.split()[0] for line in slow.stdout.splitlines()] == [
        f"{wid}.slow.{i}" for i in range(3)]


def test_followed_summary_is_the_published_one_with_the_current_state() -> None:
    """``submit --wait``/``status --watch`` show the leader's published summary; before
    the first one, the workflow record's own (all pending); once the state key says the
    workflow ended, that state."""
    from hypermesh.cli.workflows import _followed_summary
    from hypermesh.recipe.recipe import parse_recipe
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.records import WorkflowRecord, dumps
    from hypermesh.state.view import MeshView

    ks = Keyspace("t")
    view = MeshView(ks)
    recipe = parse_recipe("experiments:\n  a: {samples: 3, command: ['true']}\n")
    wf = WorkflowRecord(id="w-1", name="w", recipe=recipe, seed=1, submitted_at=1.0,
                        workdir="/tmp", source="r.yaml")
    view.apply(ks.workflow("w-1"), dumps(wf.to_json()), 1, 1)
    view.apply(ks.workflow_state("w-1"), dumps({"state": "pending"}), 2, 2)
    first = _followed_summary(view, "w-1")
    assert first["state"] == "pending" and first["experiments"]["a"]["pending"] == 3
    published = dict(first, state="running",
                     experiments={"a": dict(first["experiments"]["a"], pending=1, running=2)})
    view.apply(ks.progress("w-1"), dumps(published), 3, 3)
    assert _followed_summary(view, "w-1") == published
    view.apply(ks.workflow_state("w-1"), dumps({"state": "cancelled"}), 2, 4)
    assert _followed_summary(view, "w-1") == published | {"state": "cancelled"}
    view.apply(ks.progress("w-1"), b'{"state": "running"}', 3, 5)  # malformed: ignored
    assert view.progress["w-1"] == published
