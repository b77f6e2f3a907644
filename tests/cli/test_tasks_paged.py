"""``hypermesh tasks`` reads a workflow a batch of tasks at a time (issue 22): the same
rows as the whole view gives, in id order, and ``--limit`` stops reading early. Real
etcd, real agents."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from hypermesh.cli import common
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.txns import expand_experiment
from tests.conftest import Mesh


def _etcd(mesh: Mesh) -> Etcd:
    return Etcd([mesh.etcd.url.split("//")[1]])


def _whole(mesh: Mesh, wid: str, experiment: str | None = None) -> list[dict[str, Any]]:
    """The rows as ``tasks`` made them before: from the view of the whole workflow."""

    async def read() -> list[dict[str, Any]]:
        async with _etcd(mesh) as etcd:
            view = await common.load_view(etcd, Keyspace(mesh.namespace), wid)
        return view.task_rows(wid, experiment)

    return asyncio.run(read())


def _line(r: dict[str, Any]) -> str:
    last = r["attempts"][-1] if r["attempts"] else {}
    params = " ".join(f"{k}={v}" for k, v in r["params"].items())
    return (f"{r['id']:<40} {r['state']:<10} {r['node'] or '-':<14} "
            f"attempts={len(r['attempts'])} exit={last.get('exit_code', '-')} {params}".rstrip())


def test_rows_match_the_whole_view_in_id_order(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe("""
experiments:
  a: {parameters: {x: {values: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}}, workers: 2,
      command: ["[ $HM_PARAM_X -lt 6 ]"]}
  big: {samples: 40, command: ["true"]}
  dep: {after: [a], samples: 3, command: ["true"]}
  gpu: {hardware: {gpus: 1}, command: ["true"]}
""")
    wid = mesh.submit(recipe)

    def settled() -> bool:
        exps = mesh.hm_json("status", wid)["experiments"]
        return all(exps[e]["state"] in ("succeeded", "failed") for e in ("a", "big"))

    wait_for(settled, 120, "a and big to end")
    whole = _whole(mesh, wid)
    assert [(r["experiment"], r["index"]) for r in whole] == sorted(
        (r["experiment"], r["index"]) for r in whole)
    assert {r["experiment"] for r in whole} == {"a", "big", "dep", "gpu"}
    assert any(r["state"] == "failed" for r in whole)
    assert [r["state"] for r in whole if r["experiment"] == "dep"] == ["cancelled"] * 3
    (gpu,) = [r for r in whole if r["experiment"] == "gpu"]
    assert gpu["state"] == "pending" and "gpu" in gpu["waiting"]

    listed = mesh.hm("tasks", wid, "--json", check=True)
    assert listed.stdout == json.dumps(whole, indent=2) + "\n"  # what print_json printed
    plain = mesh.hm("tasks", wid, check=True).stdout
    assert plain == "".join(
        _line(r) + "\n" + (f"  {r['waiting']}\n" if "waiting" in r else "") for r in whole)
    only = mesh.hm_json("tasks", wid, "--experiment", "a")
    assert only == [r for r in whole if r["experiment"] == "a"]
    assert mesh.hm_json("tasks", wid, "--experiment", "nope") == []

    limited = mesh.hm("tasks", wid, "--limit", "3", "--json", check=True)
    assert json.loads(limited.stdout) == whole[:3]
    assert [r["index"] for r in whole[:3]] == [0, 1, 2]
    assert f"{len(whole) - 3} more task(s) not listed (--limit 3)" in limited.stderr
    failed = [r for r in whole if r["state"] == "failed"]
    one = mesh.hm("tasks", wid, "--state", "failed", "--limit", "1", "--json", check=True)
    assert json.loads(one.stdout) == failed[:1]
    assert ("more failed tasks not listed" in one.stderr) == (len(failed) > 1)
    every = mesh.hm("tasks", wid, "--state", "failed", "--limit", str(len(failed)), "--json",
                    check=True)
    assert json.loads(every.stdout) == failed and "not listed" not in every.stderr


def test_limit_reads_a_few_keys_of_a_large_workflow(mesh: Mesh) -> None:
    tasks, per_task = 20_000, 300
    recipe = mesh.write_recipe(f"""
experiments:
  many: {{samples: {tasks}, command: ["true"]}}
  single: {{samples: {per_task}, workers: 4, command: ["true"]}}
""")
    wid = mesh.submit(recipe)  # no agent: nothing expands it but this test
    ks = Keyspace(mesh.namespace)

    async def write_and_read() -> dict[str, Any]:
        async with _etcd(mesh) as etcd:
            assert await expand_experiment(etcd, ks, wid, "many",
                                           [{"x": i} for i in range(tasks)], block=256)
            assert await expand_experiment(etcd, ks, wid, "single",
                                           [{"y": i} for i in range(per_task)])
            out: dict[str, Any] = {}
            for name, experiment, n in (("many", "many", 10), ("single", "single", 10),
                                        ("all", None, tasks + per_task)):
                tally = common.ReadTally()
                rows = []
                async with contextlib.aclosing(
                    common.task_rows(etcd, ks, wid, experiment, tally)
                ) as stream:
                    async for row in stream:
                        rows.append((row["experiment"], row["index"], row["params"]))
                        if len(rows) == n:
                            break
                out[name] = (rows, tally)
            out["total"] = await common.listed_total(etcd, ks, wid)
        return out

    out = asyncio.run(write_and_read())
    rows, tally = out["many"]
    assert rows == [("many", i, {"x": i}) for i in range(10)]
    # The block starts (keys only, 79 of them), then the first 8 blocks: not 20,000 tasks.
    assert tally.keys <= 100 and tally.requests <= 12, tally
    rows, tally = out["single"]
    assert rows == [("single", i, {"y": i}) for i in range(10)]
    assert tally.keys <= 400 and tally.requests <= 20, tally  # one batch of 2048 at most
    rows, tally = out["all"]
    assert [(e, i) for e, i, _ in rows] == [("many", i) for i in range(tasks)] + [
        ("single", i) for i in range(per_task)]
    assert out["total"] == tasks + per_task

    limited = mesh.hm("tasks", wid, "--limit", "10", "--json", check=True)
    assert [r["index"] for r in json.loads(limited.stdout)] == list(range(10))
    assert f"{tasks + per_task - 10} more task(s) not listed" in limited.stderr
    pending = mesh.hm("tasks", wid, "--experiment", "single", "--state", "pending",
                      "--limit", "2", check=True)
    lines = pending.stdout.splitlines()
    assert [line.split()[0] for line in lines[::2]] == [f"{wid}.single.0", f"{wid}.single.1"]
    assert all(line.startswith("  no live node") for line in lines[1::2]), lines  # waiting
    assert "more pending tasks not listed" in pending.stderr
