"""Live changes to running workflows against a real mesh (real etcd, real agents):
``status --watch``, ``cancel --experiment``, ``scale``, ``extend`` and ``retry``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from hypermesh.local.processes import wait_for
from tests.conftest import Mesh

GATED = "until [ -f gate ]; do sleep 0.05; done"  # runs until the test creates ./gate


def running(mesh: Mesh, wid: str, experiment: str) -> list[dict[str, Any]]:
    return [t for t in mesh.hm_json("tasks", wid, "--experiment", experiment)
            if t["state"] == "running"]


def spans(tasks: list[dict[str, Any]], experiment: str) -> list[tuple[float, float]]:
    return [
        (a["started_at"], a["ended_at"])
        for t in tasks if t["experiment"] == experiment
        for a in t["attempts"] if a["state"] == "succeeded"
    ]


def test_status_watch_prints_progress_until_the_end(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe(
        f'experiments:\n  a: {{samples: 3, command: ["{GATED}"]}}\n'
        "  b: {after: [a], command: ['true']}\n"
    )
    wid = mesh.submit(recipe)
    watch = subprocess.Popen(
        [sys.executable, "-m", "hypermesh", "status", wid, "--watch", "--json"],
        env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())  # printed while the gate is shut
        assert first["state"] in ("pending", "running") and first["id"] == wid
        (mesh.root / "gate").touch()
        rest, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
        watch.wait()
    assert watch.returncode == 0, err
    lines = [first] + [json.loads(line) for line in rest.splitlines()]
    assert lines[-1]["state"] == "succeeded"
    assert lines[-1]["experiments"]["b"]["succeeded"] == 1
    done = [s["experiments"]["a"]["succeeded"] for s in lines]
    assert done == sorted(done) and done[0] < 3
    text = mesh.hm("status", wid, "--watch", timeout=30)  # already ended: returns at once
    assert text.returncode == 0 and f"{wid}: succeeded" in text.stderr
    bad = mesh.hm("status", "--watch")
    assert bad.returncode == 2 and "needs a WORKFLOW" in bad.stderr
    assert mesh.hm("status", "nope-123456", "--watch").returncode == 1


def test_cancel_one_experiment_keeps_the_rest_running(mesh: Mesh) -> None:
    mesh.agent(slots=4)
    recipe = mesh.write_recipe(
        f"""
experiments:
  slow: {{samples: 3, command: ["{GATED}"]}}
  after_slow: {{after: [slow], command: ["true"]}}
  fast: {{samples: 2, command: ["{GATED}"]}}
"""
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: running(mesh, wid, "slow") and running(mesh, wid, "fast"),
             30, "slow and fast tasks to run", interval=0.2)
    out = mesh.hm_json("cancel", wid, "--experiment", "slow")
    assert out == {"workflow": wid, "experiment": "slow", "state": "cancelled", "changed": True}

    def slow_stopped() -> dict[str, Any] | None:
        s = mesh.hm_json("status", wid)
        return s if s["experiments"]["slow"]["state"] == "cancelled" else None

    status = wait_for(slow_stopped, 30, "slow to be cancelled", interval=0.2)
    assert isinstance(status, dict)
    assert status["state"] == "running"  # fast goes on
    assert status["experiments"]["after_slow"]["state"] == "cancelled"
    assert status["experiments"]["fast"]["state"] in ("running", "pending")
    (mesh.root / "gate").touch()
    final = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert final["state"] == "cancelled"
    assert final["experiments"]["fast"]["succeeded"] == 2
    assert final["experiments"]["slow"]["cancelled"] == 3
    slow = mesh.hm_json("tasks", wid, "--experiment", "slow")
    attempts = [a for t in slow for a in t["attempts"]]
    assert attempts and all(a["reason"] == "cancelled" for a in attempts)
    again = mesh.hm("cancel", wid, "--experiment", "slow", "--json")
    assert again.returncode == 1 and "has ended" in again.stderr
    missing = mesh.hm("cancel", wid, "--experiment", "nope")
    assert missing.returncode == 1 and "no experiment 'nope'" in missing.stderr


def test_scale_changes_the_workers_cap_live(mesh: Mesh) -> None:
    mesh.agent(slots=4)
    recipe = mesh.write_recipe(
        f'experiments:\n  capped: {{samples: 4, workers: 1, command: ["{GATED}"]}}\n'
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: running(mesh, wid, "capped"), 30, "a capped task to run", interval=0.2)
    out = mesh.hm_json("scale", wid, "capped", "--workers", "3")
    assert out == {"workflow": wid, "experiment": "capped", "workers": 3, "previous": 1}
    wait_for(lambda: len(running(mesh, wid, "capped")) == 3, 30, "three running", interval=0.2)
    assert mesh.hm_json("scale", wid, "capped", "--workers", "0")["previous"] == 3
    (mesh.root / "gate").touch()
    wait_for(lambda: mesh.hm_json("status", wid)["experiments"]["capped"]["succeeded"] == 3,
             30, "the three to finish", interval=0.2)
    status = mesh.hm_json("status", wid)["experiments"]["capped"]
    assert (status["running"], status["pending"]) == (0, 1)  # workers 0: none started
    released = time.time()
    mesh.hm("scale", wid, "capped", "--workers", "none", check=True)
    final = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert final["state"] == "succeeded"
    starts = sorted(s for s, _ in spans(mesh.hm_json("tasks", wid), "capped"))
    assert len(starts) == 4 and starts[-1] >= released
    for bad in ("-1", "many"):
        result = mesh.hm("scale", wid, "capped", "--workers", bad)
        assert result.returncode == 2 and "--workers" in result.stderr


def test_extend_adds_samples_and_dependents_wait_for_them(mesh: Mesh) -> None:
    mesh.agent(slots=4)
    recipe = mesh.write_recipe(
        f"""
experiments:
  first: {{command: ["true"]}}
  sweep:
    after: [first]
    parameters: {{lr: {{range: [0.1, 0.2]}}}}
    samples: 2
    command: ["{GATED}"]
  report: {{after: [sweep], command: ["true"]}}
"""
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: len(running(mesh, wid, "sweep")) == 2, 30, "sweep to run", interval=0.2)
    refused = mesh.hm("extend", wid, "first", "--samples", "1")
    assert refused.returncode == 1 and "dependents that already started" in refused.stderr
    out = mesh.hm_json("extend", wid, "sweep", "--samples", "3")
    assert out == {"workflow": wid, "experiment": "sweep", "added": 3, "total": 5}
    assert mesh.hm_json("status", wid)["experiments"]["sweep"]["total"] == 5
    (mesh.root / "gate").touch()
    final = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert final["state"] == "succeeded", final
    assert final["experiments"]["sweep"]["succeeded"] == 5
    tasks = mesh.hm_json("tasks", wid)
    sweep = [t for t in tasks if t["experiment"] == "sweep"]
    assert sorted(t["index"] for t in sweep) == [0, 1, 2, 3, 4]
    assert all(0.1 <= t["params"]["lr"] <= 0.2 for t in sweep)
    assert max(e for _, e in spans(tasks, "sweep")) <= min(s for s, _ in spans(tasks, "report"))
    ended = mesh.hm("extend", wid, "sweep", "--samples", "1")
    assert ended.returncode == 1 and "has ended" in ended.stderr
    assert mesh.hm("extend", wid, "sweep", "--samples", "0").returncode == 2


def test_extend_past_the_task_cap_is_refused_and_writes_nothing(mesh: Mesh) -> None:
    mesh.hm("settings", "max-workflow-tasks=10", check=True)
    recipe = mesh.write_recipe(
        'experiments:\n  a: {samples: 4, command: ["true"]}\n'
        '  b: {samples: 3, workers: 1, command: ["true"]}\n'
    )
    wid = mesh.submit(recipe)  # no agent: the workflow stays pending, live changes still apply
    assert mesh.hm_json("extend", wid, "a", "--samples", "2")["total"] == 6  # 9 in all
    refused = mesh.hm("extend", wid, "b", "--samples", "2")
    assert refused.returncode == 2, refused.stderr
    assert f"workflow {wid} would plan 11 tasks (a 6, b 5)" in refused.stderr
    assert "max-workflow-tasks (10)" in refused.stderr
    assert "`hypermesh settings max-workflow-tasks=11`" in refused.stderr
    totals = mesh.hm_json("status", wid)["experiments"]
    assert (totals["a"]["total"], totals["b"]["total"]) == (6, 3)  # nothing written
    assert mesh.hm_json("extend", wid, "b", "--samples", "1")["total"] == 4  # 10: at the cap
    # scale changes how many tasks run at once, never how many there are: not capped
    assert mesh.hm_json("scale", wid, "b", "--workers", "50")["workers"] == 50
    mesh.hm("settings", "max-workflow-tasks=11", check=True)
    assert mesh.hm_json("extend", wid, "b", "--samples", "1")["total"] == 5


def test_retry_reruns_failed_tasks_and_keeps_their_history(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe(
        """
experiments:
  flaky: {samples: 3, retries: 1, command: ["test -f gate || [ $HM_TASK_INDEX = 0 ]"]}
  after_flaky: {after: [flaky], command: ["true"]}
"""
    )
    wid = mesh.submit(recipe)
    failed = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert failed["state"] == "failed"
    assert failed["experiments"]["after_flaky"]["state"] == "cancelled"
    (mesh.root / "gate").touch()
    out = mesh.hm_json("retry", wid)
    assert out == {"workflow": wid, "retried": [f"{wid}.flaky.1", f"{wid}.flaky.2"]}
    final = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"})
    assert final["state"] == "succeeded", final
    assert final["experiments"]["after_flaky"]["succeeded"] == 1
    tasks = {t["id"]: t for t in mesh.hm_json("tasks", wid)}
    assert [a["state"] for a in tasks[f"{wid}.flaky.0"]["attempts"]] == ["succeeded"]
    for i in (1, 2):  # two counted failures (retries: 1), then the retry's success
        history = [(a["attempt"], a["state"]) for a in tasks[f"{wid}.flaky.{i}"]["attempts"]]
        assert history == [(1, "failed"), (2, "failed"), (3, "succeeded")]
    assert mesh.hm_json("retry", wid)["retried"] == []
    mesh.hm("cancel", wid, check=True)  # ended: cancel changes nothing
    assert mesh.hm("retry", "nope-123456").returncode == 1


def test_live_commands_reject_unknown_workflows(mesh: Mesh) -> None:
    for args in (("scale", "nope-1", "e", "--workers", "1"),
                 ("extend", "nope-1", "e", "--samples", "1"), ("retry", "nope-1"),
                 ("cancel", "nope-1", "--experiment", "e")):
        result = mesh.hm(*args)
        assert result.returncode == 1 and "no workflow 'nope-1'" in result.stderr, args


def test_live_changes_with_several_agents_and_a_crash_keep_the_invariants(mesh: Mesh) -> None:
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=3)
    recipe = mesh.write_recipe(
        f"""
experiments:
  work: {{samples: 12, workers: 4, command: ["{GATED}"]}}
  after_work: {{after: [work], command: ["true"]}}
"""
    )
    wid = mesh.submit(recipe)
    wait_for(lambda: len(running(mesh, wid, "work")) == 4, 30, "four running", interval=0.2)
    mesh.hm("scale", wid, "work", "--workers", "2", check=True)
    mesh.hm("extend", wid, "work", "--samples", "6", check=True)
    mesh.hm("scale", wid, "work", "--workers", "none", check=True)
    wait_for(lambda: len(running(mesh, wid, "work")) == 9, 30, "nine running", interval=0.2)
    victim = next(
        n for n in ("node2", "node3") if any(t["node"] == n for t in running(mesh, wid, "work"))
    )
    mesh.agents[victim].crash()
    mesh.hm("extend", wid, "work", "--samples", "2", check=True)
    (mesh.root / "gate").touch()
    final = mesh.wait_state(wid, {"succeeded", "failed", "cancelled"}, timeout=90)
    assert final["state"] == "succeeded", final
    tasks = mesh.hm_json("tasks", wid)
    work = [t for t in tasks if t["experiment"] == "work"]
    assert sorted(t["index"] for t in work) == list(range(20))
    for t in work:  # exactly one success each; the crash's attempts are node-lost
        states = [(a["state"], a["reason"]) for a in t["attempts"]]
        assert states.count(("succeeded", "exit")) == 1, t
        assert all(s == ("failed", "node-lost") for s in states if s[0] != "succeeded"), t
    assert any(len(t["attempts"]) > 1 for t in work)  # the crash cost someone an attempt
    assert max(e for _, e in spans(tasks, "work")) <= min(s for s, _ in spans(tasks, "after_work"))


def _progress(mesh: Mesh, wid: str) -> dict[str, Any] | None:
    """The leader's published summary of ``wid`` (``progress/<wid>``), read from etcd."""
    import asyncio

    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace

    async def read() -> dict[str, Any] | None:
        async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
            found = await etcd.get(Keyspace(mesh.namespace).progress(wid))
        return None if found is None else json.loads(found[0])

    return asyncio.run(read())


def test_leader_publishes_progress_that_watchers_follow(mesh: Mesh) -> None:
    """The leader publishes each running workflow's summary (``progress/<wid>``) and
    its final one with the final state; what ``status --watch --json`` ends with is
    what ``status --json`` says from every task's records."""
    mesh.agent(slots=3)
    recipe = mesh.write_recipe(
        f'experiments:\n  a: {{samples: 3, command: ["{GATED}"]}}\n'
        "  b: {after: [a], samples: 2, retries: 0, command: ['test $HM_TASK_INDEX = 0']}\n"
    )
    wid = mesh.submit(recipe)

    def three_running() -> dict[str, Any] | None:
        p = _progress(mesh, wid)
        return p if p and p["experiments"]["a"]["running"] == 3 else None

    published = wait_for(three_running, 30, "the leader to publish 3 running tasks")
    assert published["id"] == wid and published["state"] == "running"  # type: ignore[index]
    watch = subprocess.Popen(
        [sys.executable, "-m", "hypermesh", "status", wid, "--watch", "--json"],
        env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        (mesh.root / "gate").touch()
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
        watch.wait()
    assert watch.returncode == 1, err  # one task of b failed
    last = json.loads(out.splitlines()[-1])
    status = mesh.hm_json("status", wid)
    status.pop("cost")
    status.pop("best", None)
    assert last == status
    assert last["state"] == "failed"
    assert (last["experiments"]["b"]["succeeded"], last["experiments"]["b"]["failed"]) == (1, 1)
    assert _progress(mesh, wid) == last  # published with the final state


def test_a_workflow_cancelled_from_the_cli_is_summarized_at_the_end(mesh: Mesh) -> None:
    """Cancelling writes the state without a final summary: the watcher reads the
    workflow's records once and ends with a summary made from them."""
    mesh.agent(slots=2)
    recipe = mesh.write_recipe(f'experiments:\n  a: {{samples: 4, command: ["{GATED}"]}}\n')
    wid = mesh.submit(recipe)
    wait_for(lambda: len(running(mesh, wid, "a")) == 2, 30, "two tasks running")
    watch = subprocess.Popen(
        [sys.executable, "-m", "hypermesh", "status", wid, "--watch", "--json"],
        env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert watch.stdout is not None
        json.loads(watch.stdout.readline())  # following
        mesh.hm("cancel", wid, check=True)
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
        watch.wait()
    assert watch.returncode == 1, err
    last = json.loads(out.splitlines()[-1])
    a = last["experiments"]["a"]
    assert last["state"] == "cancelled" and a["total"] == 4
    # From the records, not the leader's last summary (2 pending, 2 running then): the
    # tasks that never started are cancelled; the 2 running ones are stopping.
    assert a["pending"] == 0 and a["succeeded"] == 0 and a["cancelled"] >= 2
    assert a["running"] + a["cancelled"] == 4
