"""Images pulled ahead, end to end: real etcd, real agents, real podman and a real registry
on loopback holding images the tests pushed (agent/tasks/images.py).

An agent that may run an experiment with an image pulls it before it claims the
experiment's first task; meanwhile ``hypermesh tasks`` (and --json) and the dashboard say
``pulling image REF on NODE``. A pull that fails ends the attempt with reason ``image``
and the runtime's message in the attempt's log (also a registry down past the agent's
``--image-pull-deadline``); retries apply as usual. Past ``--image-budget`` the least
recently used image goes, never that of a running task."""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hypermesh.local.images import image_exists
from hypermesh.local.processes import wait_for
from hypermesh.local.registry import Registry
from tests.conftest import Mesh
from tests.tasks import test_images
from tests.tasks.test_images import Pushed

pushed = test_images.pushed
"""Images pushed under names of this test, removed at the end (test_images' fixture)."""


@pytest.fixture
def pushed_python(registry: Registry, container_image: str) -> Iterator[str]:
    """The tests' Python image, pushed under a name of this test; the pulled copy is
    removed at the end (that reference only)."""
    ref = f"{registry.address}/t{uuid.uuid4().hex[:12]}/python:1"
    done = subprocess.run(["podman", "push", container_image, ref], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    try:
        yield ref
    finally:
        registry.resume()
        if image_exists(ref):
            subprocess.run(["podman", "rmi", ref], capture_output=True, check=False)


def task_rows(mesh: Mesh, wid: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = mesh.hm_json("tasks", wid)
    return rows


def test_a_task_runs_in_its_image_after_the_agent_pulled_it_ahead(
    mesh: Mesh, registry: Registry, pushed_python: str
) -> None:
    node = mesh.agent("node1")
    registry.pause()  # the pull holds until the registry answers again
    recipe = mesh.write_recipe(f"""
experiments:
  hello:
    image: {pushed_python}
    command: ["python3 -c 'import sys; print(\\"in image\\", sys.version_info[0])'"]
""")
    wid = mesh.submit(recipe)
    waiting = f"pulling image {pushed_python} on node1"

    def shown_as_pulling() -> bool:
        rows = task_rows(mesh, wid)
        return bool(rows) and rows[0]["state"] == "pending" and rows[0].get("waiting") == waiting

    wait_for(shown_as_pulling, 30, "tasks --json to say the image is being pulled", interval=0.2)
    assert waiting in mesh.hm("tasks", wid, check=True).stdout
    with urllib.request.urlopen(f"http://{node.http_address}/api/workflows/{wid}",
                                timeout=10) as answer:
        dashboard = json.load(answer)
    assert dashboard["tasks"][0]["waiting"] == waiting
    assert dashboard["status"]["experiments"]["hello"]["waiting"] == waiting
    assert "claimed" not in node.log_tail()  # nothing is claimed while it pulls
    registry.resume()
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "succeeded", mesh.logs()
    assert "in image 3" in mesh.hm("logs", f"{wid}.hello.0", check=True).stdout
    log = node.log_tail()
    assert log.index(f"pulling image {pushed_python}") < log.index(f"claimed {wid}.hello.0")
    assert f"image {pushed_python}: pulled" in log
    assert "waiting" not in task_rows(mesh, wid)[0]
    pulled = json.loads((node.work_dir / "images.json").read_text())["pulled"]
    assert list(pulled) == [pushed_python]  # what this agent pulled, for its budget


def test_a_wrong_image_name_ends_attempts_with_reason_image_and_the_message(
    mesh: Mesh, registry: Registry
) -> None:
    mesh.agent("node1")
    wrong = f"{registry.address}/t{uuid.uuid4().hex[:12]}/missing:1"
    recipe = mesh.write_recipe(f"""
experiments:
  broken:
    image: {wrong}
    retries: 1
    command: ["echo never"]
""")
    wid = mesh.submit(recipe)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
    assert status["state"] == "failed"
    (row,) = task_rows(mesh, wid)
    assert [(a["state"], a["reason"]) for a in row["attempts"]] == [("failed", "image")] * 2
    log = mesh.hm("logs", f"{wid}.broken.0", check=True).stdout
    assert f"cannot pull image {wrong}" in log and "manifest unknown" in log
    assert not image_exists(wrong)


@pytest.fixture
def own_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """A registry of this test's own (podman and agents started afterwards find it): the
    test may pause it without holding up the session's."""
    server = Registry(tmp_path / "own-registry")
    server.start()
    try:
        monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(server.registries_conf()))
        yield server
    finally:
        server.stop()


def test_a_registry_down_past_the_agents_pull_deadline_ends_attempts_with_reason_image(
    mesh: Mesh, own_registry: Registry, tmp_path: Path
) -> None:
    images = Pushed(own_registry, tmp_path)
    try:
        ref = images.tiny("down")
        node = mesh.agent("node1", extra=("--image-pull-deadline", "2s"))
        own_registry.pause()
        recipe = mesh.write_recipe(f"""
experiments:
  stuck:
    image: {ref}
    retries: 1
    command: ["echo never"]
""")
        wid = mesh.submit(recipe)
        status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
        assert status["state"] == "failed", mesh.logs()
        (row,) = task_rows(mesh, wid)
        assert [(a["state"], a["reason"]) for a in row["attempts"]] == [("failed", "image")] * 2
        log = mesh.hm("logs", f"{wid}.stuck.0", check=True).stdout
        assert f"cannot pull image {ref}: podman pull {ref} did not finish within 2s" in log
        assert f"image {ref}: pull failed" in node.log_tail()
        assert not image_exists(ref)
    finally:
        own_registry.resume()
        images.remove()


def test_past_the_agents_image_budget_the_lru_image_goes_and_a_running_tasks_stays(
    mesh: Mesh, pushed: Pushed
) -> None:
    a, b, c = (pushed.tiny(name, runnable=True) for name in "abc")
    sizes = pushed.sizes
    budget = sizes[a] + sizes[b] + min(sizes.values()) // 2  # two fit, three do not
    node = mesh.agent("node1", extra=("--image-budget", str(budget)))

    def run(name: str, image: str, command: str, *extra: str) -> str:
        recipe = mesh.write_recipe(f"""
experiments:
  {name}:
    image: {image}
    command: [{json.dumps(command)}]
""", f"{name}.yaml")
        return mesh.submit(recipe, *extra)

    # A's task runs on (its image the least recently used of the three from now on).
    long = run("a", a, "echo started; sleep 300")
    wait_for(lambda: task_rows(mesh, long)[0]["state"] == "running", 60,
             "the task in image A to run", interval=0.2)
    for name, image in (("b", b), ("c", c)):
        wid = run(name, image, f"echo in {name}")
        status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)
        assert status["state"] == "succeeded", mesh.logs()

    # Pulling C took the three past the budget: B, unused, went; A stayed for its task.
    log = node.log_tail()
    assert f"image {b}: removed (unused; images past the budget)" in log
    assert f"image {a}: removed" not in log and f"image {c}: removed" not in log
    assert not image_exists(b) and image_exists(a) and image_exists(c)
    wait_for(lambda: set(json.loads((node.work_dir / "images.json").read_text())["pulled"])
             == {a, c}, 10, "images.json to record A and C")
    assert task_rows(mesh, long)[0]["state"] == "running"
    mesh.hm("cancel", long, check=True)
    mesh.wait_state(long, {"cancelled", "failed", "succeeded"}, timeout=60)
