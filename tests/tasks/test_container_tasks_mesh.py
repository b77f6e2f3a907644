"""Tasks in containers end to end: real podman, real etcd, real agents, a real data set mount.

A recipe with ``image:`` runs in the image the tests build here (``hypermesh/local/images.py``)
and behaves as a process task: its output, exit code, metrics, retries and timeouts; its data
read-only and its writable folders writable; only the task's own environment inside. A
cancel, a timeout and a drain stop its container, and a dead agent's containers die with it,
also when the watchdog died too and the next agent in the work directory cleans up.

Every test lists the containers its own agents labelled (``hypermesh.lifeline`` under the
test's folder: tests may run beside others) and none may be left at its end; the fixture
removes what a failure left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hypermesh.agent.tasks.containers import TASK_LABEL
from hypermesh.agent.tasks.lifeline import CONTAINER_LABEL
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import wait_for
from hypermesh.local.s3server import ACCESS_KEY, SECRET_KEY
from tests.conftest import Mesh, process_gone
from tests.tasks.test_lifeline import watchdog_of
from tests.tasks.test_task_environment_mesh import (
    ETCD_PASSWORD,
    agent_with_credentials,
    printed_env,
)

DEADLINE = 10.0  # seconds a dead agent's containers may outlive it (loaded CI, podman calls)

Listed = Callable[..., list[dict[str, Any]]]


def containers_under(root: Path, **labels: str) -> list[dict[str, Any]]:
    """podman's containers (running or not) that agents under ``root`` labelled, with
    ``labels`` besides."""
    out = subprocess.run(
        ["podman", "ps", "--all", "--format", "json", "--filter", f"label={CONTAINER_LABEL}"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    found = []
    for c in json.loads(out or "[]"):
        have = c.get("Labels") or {}
        if have.get(CONTAINER_LABEL, "").startswith(f"{root}/") and all(
            have.get(k) == v for k, v in labels.items()
        ):
            found.append(c)
    return found


@pytest.fixture
def own_containers(mesh: Mesh) -> Iterator[Listed]:
    """Lists the containers of this test's agents; at the end, with the agents stopped,
    none may be left (what a failure left is removed first)."""
    yield lambda **labels: containers_under(mesh.root, **labels)
    mesh.close()
    left = containers_under(mesh.root)
    if left:
        subprocess.run(["podman", "rm", "--force", "--time", "0", "--ignore",
                        *(c["Id"] for c in left)], capture_output=True, check=False, timeout=60)
    assert not left, [(c["Names"], c["State"]) for c in left]


def attempt_label(wid: str, experiment: str, attempt: int = 1, index: int = 0) -> dict[str, str]:
    return {TASK_LABEL: f"{wid}.{experiment}.{index}-{attempt}"}


def running_container(listed: Listed, labels: dict[str, str]) -> int:
    """The host pid of the (one) running container labelled ``labels``, once it runs."""

    def pid() -> int | None:
        found = [c for c in listed(**labels) if c["State"] == "running"]
        return int(found[0]["Pid"]) if len(found) == 1 and found[0].get("Pid") else None

    return wait_for(pid, 60, f"a running container {labels}", interval=0.1)  # type: ignore[return-value]


def attempts_of(mesh: Mesh, wid: str) -> dict[str, list[dict[str, Any]]]:
    return {t["id"].split(".")[1]: t["attempts"] for t in mesh.hm_json("tasks", wid)}


def attempt_log(agent: AgentProcess, wid: str, experiment: str, attempt: int = 1) -> str:
    """An attempt's log as the agent wrote it (``hypermesh logs`` shows the same)."""
    return (agent.work_dir / "attempts" / wid / f"{experiment}.0.{attempt}.log").read_text()


INSIDE = """\
set -e  # every write below must work
test -f /run/.containerenv && echo "in a container"
env
echo "uid $(id -u)"
cat "$HM_DATA_TOY/shard/part.txt"
grep " $HM_DATA_TOY " /proc/mounts | sed 's/^/data mount: /'
grep " $HM_DATA_TOY/.out " /proc/mounts | sed 's/^/out mount: /'
touch "$HM_DATA_TOY/new" 2>/dev/null || echo "data not writable"
echo out > "$HM_DATA_TOY/.out/inside.txt"
echo 7 > "$HM_CHECKPOINT_DIR/step"
echo scratch > "$HM_ATTEMPT_DIR/scratch"
echo 'HM_METRIC {"loss": 0.25}'
echo '{"acc": 0.75}' >> "$HM_METRICS_FILE"
"""


def test_a_task_runs_in_its_image_as_a_process_task_would(
    mesh: Mesh, own_containers: Listed, container_image: str, store: S3Store, store_url: str,
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    (src / "shard").mkdir(parents=True)
    (src / "shard" / "part.txt").write_text("hello from the data set\n")
    put_dataset(store, src, "toy", chunk_size=4 << 20)
    # The agent's own credentials are the store's (it uploads logs and outputs with them).
    agent = agent_with_credentials(mesh, slots=3, aws=(ACCESS_KEY, SECRET_KEY), extra=(
        "--store", store_url, "--cache-size", "64MiB", "--grace", "1"))
    recipe = mesh.write_recipe(f"""
experiments:
  inside:
    image: {container_image}
    data: {{toy: toy}}
    env: {{OWN: mine}}
    command: [{json.dumps(INSIDE)}]
  fails:
    image: {container_image}
    retries: 1
    command: ["echo failing; exit 3"]
  slow:
    image: {container_image}
    timeout: 3
    command: ['trap "" TERM; echo started; sleep 120']
""")
    wid = mesh.submit(recipe)
    mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    tasks = {t["id"].split(".")[1]: t for t in mesh.hm_json("tasks", wid)}

    # Output, environment, mounts and metrics of the one that ran.
    (ran,) = tasks["inside"]["attempts"]
    assert (ran["state"], ran["exit_code"]) == ("succeeded", 0), mesh.logs()
    log = attempt_log(agent, wid, "inside")
    assert "in a container" in log and "hello from the data set" in log
    assert f"uid {os.getuid()}" in log
    inside = printed_env(log)
    assert inside["OWN"] == "mine" and inside["HM_TASK_ID"] == f"{wid}.inside.0"
    assert inside["HYPERMESH_LIFELINE"].startswith(str(agent.work_dir / "lifeline"))
    assert "AWS_SECRET_ACCESS_KEY" not in inside and SECRET_KEY not in log
    assert ETCD_PASSWORD not in log
    assert inside["PATH"] != os.environ["PATH"]  # the image's, not the host's
    # The last mount at a path is the one its files are reached through.
    data_mount = [line for line in log.splitlines() if line.startswith("data mount: ")][-1]
    out_mount = [line for line in log.splitlines() if line.startswith("out mount: ")][-1]
    assert "ro" in data_mount.split()[5].split(",")
    assert "rw" in out_mount.split()[5].split(",")
    assert "data not writable" in log
    assert store.get("outputs/inside.txt") == b"out\n"
    assert store.get(f"outputs/checkpoints/{wid}.inside.0/step") == b"7\n"
    assert tasks["inside"]["metrics"] == {"loss": 0.25, "acc": 0.75}

    # The exit code, and a retry, as for a process.
    assert [(a["state"], a["exit_code"], a["reason"]) for a in tasks["fails"]["attempts"]] == [
        ("failed", 3, "exit"), ("failed", 3, "exit")]
    assert "failing" in attempt_log(agent, wid, "fails", attempt=2)

    # A timeout: SIGTERM ignored inside, the client killed after the grace, and the
    # container removed before the attempt's end was recorded.
    (slow,) = tasks["slow"]["attempts"]
    assert (slow["state"], slow["reason"]) == ("failed", "timeout")
    assert "started\n[hypermesh] timed out after 3s" in attempt_log(agent, wid, "slow")
    assert own_containers(**attempt_label(wid, "slow")) == []
    assert own_containers() == []  # the others removed themselves (--rm)

    # A cancel stops a running container; so does a drain (SIGTERM reaches the task).
    long_recipe = mesh.write_recipe(f"""
experiments:
  long:
    image: {container_image}
    command: ['trap "echo got TERM; exit 0" TERM; echo started; sleep 120 & wait']
""", "long.yaml")
    cancelled = mesh.submit(long_recipe)
    running_container(own_containers, attempt_label(cancelled, "long"))
    mesh.hm("cancel", cancelled, check=True)
    wait_for(lambda: attempts_of(mesh, cancelled)["long"][0]["state"] == "cancelled", 30,
             "the cancelled attempt's end")
    assert own_containers(**attempt_label(cancelled, "long")) == []

    drained = mesh.submit(long_recipe)
    running_container(own_containers, attempt_label(drained, "long"))
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGTERM)
    agent.proc.wait(30)
    assert "got TERM" in attempt_log(agent, drained, "long")
    assert own_containers() == []
    (preempted,) = attempts_of(mesh, drained)["long"]
    assert preempted["reason"] == "preempted"


def test_a_dead_agents_containers_die_with_it_and_an_agent_without_runtime_says_so(
    mesh: Mesh, own_containers: Listed, container_image: str
) -> None:
    agent = mesh.agent("node1", slots=1)
    plain = mesh.agent("node2", slots=1, extra=(
        "--container-runtime", "none", "--pool", "plain"))
    wid = mesh.submit(mesh.write_recipe(f"""
experiments:
  long:
    image: {container_image}
    pools: [default]
    command: ["echo started; sleep 300"]
"""))
    # An agent told to run no containers runs an image's task as a process, and says so.
    without = mesh.submit(mesh.write_recipe(f"""
experiments:
  t:
    image: {container_image}
    pools: [plain]
    command: ["test ! -f /run/.containerenv && echo ran here"]
""", "plain.yaml"), "--wait")
    out = attempt_log(plain, without, "t")
    assert ("containers are off on this node (--container-runtime none); running with the "
            "process runtime") in out
    assert "ran here" in out

    # The agent and its watchdog die together: the container runs on, until the next
    # agent in the same work directory removes it.
    first = running_container(own_containers, attempt_label(wid, "long"))
    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGSTOP)
    dog = watchdog_of(agent)
    dog.kill()
    wait_for(lambda: process_gone(dog.pid), DEADLINE, "the watchdog to die")
    agent.kill()
    assert not process_gone(first)
    again = mesh.agent("node1", slots=1)
    wait_for(lambda: process_gone(first) and not own_containers(**attempt_label(wid, "long")),
             DEADLINE, "the earlier agent's container removed", interval=0.1)

    # The task runs again here; SIGKILL the agent, its watchdog alive: the container dies.
    second = running_container(own_containers, attempt_label(wid, "long", attempt=2))
    killed_at = time.monotonic()
    again.kill()
    wait_for(lambda: process_gone(second) and not own_containers(), DEADLINE,
             "the container to die with its agent", interval=0.05)
    print(f"container gone {time.monotonic() - killed_at:.3f}s after the agent's SIGKILL")
