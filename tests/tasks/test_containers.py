"""Container runtimes: the docker/podman command lines built for a task (construction),
the runtime probe against real podman and a docker CLI whose daemon does not answer, a
task naming an image on a node without a working runtime (it runs with the process runtime
and says so), and the lifeline's clean-up of a dead agent's containers with real podman.
Tasks in containers end to end: ``test_container_tasks_mesh.py``."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.agent.tasks import lifeline
from hypermesh.agent.tasks.containers import (
    FRAMEWORK_IMAGES,
    TASK_LABEL,
    Containers,
    container_argv,
    container_names,
    find_runtime,
    image_for,
    remove_argv,
    task_env_names,
)
from hypermesh.agent.tasks.leftovers import remove_containers
from hypermesh.agent.tasks.lifeline import (
    CONTAINER_LABEL,
    Journal,
    journal_runtimes,
    kill_journal,
    read_journal,
)
from hypermesh.agent.tasks.runner import AttemptProcess, Outcome
from hypermesh.config import AgentConfig
from hypermesh.errors import UsageError


def test_image_comes_from_image_then_framework() -> None:
    assert image_for("pytorch", "me/custom:1") == "me/custom:1"
    assert image_for("PyTorch", None) == FRAMEWORK_IMAGES["pytorch"]
    assert image_for("caffe", None) is None
    assert image_for(None, None) is None


def test_docker_command_passes_mounts_env_names_and_gpus() -> None:
    argv = container_argv(
        "docker", "pytorch/pytorch:x", "python train.py --lr 0.1",
        name="hm-wf.train.3-1-0", env=["HM_TASK_ID", "HM_PARAM_LR", "CUDA_VISIBLE_DEVICES"],
        workdir="/work/proj", mounts=["/w/attempts/t/1", "/data/set/.out/checkpoints/t"],
        read_only=["/data/set"], gpus=[2, 5], user="1000:1000",
    )
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[-4:] == ["pytorch/pytorch:x", "bash", "-c", "python train.py --lr 0.1"]
    text = shlex.join(argv)
    assert "-w /work/proj" in text and "--user 1000:1000" in text
    assert "--network host" in text and "--ipc host" in text
    # Data read-only, then the checkpoint folder inside it writable (mounted over it).
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert volumes == [
        "/work/proj:/work/proj:rw",
        "/data/set:/data/set:ro",
        "/w/attempts/t/1:/w/attempts/t/1:rw",
        "/data/set/.out/checkpoints/t:/data/set/.out/checkpoints/t:rw",
    ]
    # Values stay off the command line; GPUs are renumbered inside the container.
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert envs == ["HM_PARAM_LR", "HM_TASK_ID", "CUDA_VISIBLE_DEVICES=0,1"]
    assert argv[argv.index("--gpus") + 1] == '"device=2,5"'


def test_podman_uses_cdi_devices_and_no_gpu_hides_all() -> None:
    argv = container_argv("podman", "img", "true", name="n", env=[], workdir="/w", gpus=[1])
    assert argv[argv.index("--device") + 1] == "nvidia.com/gpu=1"
    assert "--gpus" not in argv
    argv = container_argv("docker", "img", "true", name="n", env=[], workdir="/w")
    assert "--gpus" not in argv and "CUDA_VISIBLE_DEVICES=" in argv


def test_only_the_task_environment_is_passed() -> None:
    base = {"PATH": "/usr/bin", "HOME": "/root", "SAME": "1"}
    env = dict(base, HM_TASK_ID="t", SAME="1", PATH="/usr/bin")
    assert task_env_names(env, base) == ["HM_TASK_ID"]


def test_labels_name_the_attempt_and_a_stop_removes_its_containers() -> None:
    argv = container_argv("podman", "img", "true", name="hm-t-1-0", env=[], workdir="/w",
                          labels={TASK_LABEL: "t-1", CONTAINER_LABEL: "/work/lifeline/7.9"})
    labels = [argv[i + 1] for i, a in enumerate(argv) if a == "--label"]
    assert labels == ["hypermesh.lifeline=/work/lifeline/7.9", "hypermesh.task=t-1"]
    assert argv.index("--label") < argv.index("img")
    names = container_names("wf.e.0-2", 2)
    assert names == ["hm-wf.e.0-2-0", "hm-wf.e.0-2-1"]
    assert remove_argv("podman", names) == [
        "podman", "rm", "--force", "--time", "0", "--ignore", *names]
    assert remove_argv("docker", names) == ["docker", "rm", "--force", *names]


def test_the_stop_path_alone_runs_on_stop(tmp_path: Path) -> None:
    """A client that exits removes its container itself (``--rm``): only a stop (here a
    timeout whose SIGTERM is ignored, so the group is killed after the grace) runs
    ``on_stop``, once its processes are gone."""
    calls: list[str] = []

    async def run(command: str, timeout: float | None) -> Outcome:
        async def on_stop() -> None:
            calls.append(command)

        process = AttemptProcess([command], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                                 log_path=tmp_path / "log", timeout=timeout, grace=0.2,
                                 on_stop=on_stop)
        return await asyncio.wait_for(process.run(), 10)

    assert asyncio.run(run("exit 3", None)).exit_code == 3
    assert calls == []
    slow = "trap '' TERM; sleep 30"
    assert asyncio.run(run(slow, 0.2)).reason == "timeout"
    assert calls == [slow]


def test_the_runtime_choice_is_checked() -> None:
    with pytest.raises(UsageError, match="--container-runtime 'rkt'"):
        AgentConfig.local(container_runtime="rkt")
    assert AgentConfig.local(container_runtime="none").container_runtime == "none"
    with pytest.raises(ValueError, match="rkt"):
        Containers("rkt")


@pytest.fixture
def dead_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A docker CLI whose daemon does not answer (``docker info`` fails, as the real CLI
    does without dockerd), first on PATH; the folder it is in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def test_the_probe_skips_a_cli_whose_daemon_does_not_answer(dead_docker: Path) -> None:
    assert asyncio.run(find_runtime()) == "podman"  # the real one, which answers
    assert asyncio.run(find_runtime(["docker"])) is None
    assert asyncio.run(Containers("podman").runtime()) == "podman"
    assert asyncio.run(Containers("none").runtime()) is None


@pytest.mark.parametrize(
    ("choice", "path", "said"),
    [
        ("auto", "dead-docker-only", "no docker or podman answers on this node"),
        ("docker", "", "no docker answers on this node"),
        ("none", "", "containers are off on this node (--container-runtime none)"),
    ],
)
def test_without_a_runtime_the_process_runtime_runs_it_and_says_so(
    dead_docker: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    choice: str, path: str, said: str,
) -> None:
    if path:  # no podman either
        monkeypatch.setenv("PATH", str(dead_docker))
    log = tmp_path / "attempt.log"

    async def wrap() -> tuple[list[str], str | None]:
        return await Containers(choice).wrap("t-1", "img:1", ["echo ran"], {}, {}, [], tmp_path,
                                             log)

    assert asyncio.run(wrap()) == (["echo ran"], None)
    assert log.read_text() == (f"[hypermesh] image img:1: {said}; running with the process "
                               "runtime\n")


def test_journal_names_its_runtimes_and_keeps_them_when_compacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifeline, "COMPACT_LINES", 10)
    path = tmp_path / "journal"
    journal = Journal(str(path))
    journal.container("podman")
    journal.container("podman")
    for pid in range(100, 130):
        journal.started(pid)
        journal.ended(pid)
    journal.started(7)
    journal.close()
    assert path.read_bytes().count(b"c podman\n") == 1
    assert journal_runtimes(str(path)) == ["podman"]
    assert [r.pid for r in read_journal(str(path))] == [7]
    path.write_text("c podman\nc /bin/evil\nc docker\nc podm")  # unknown names, a torn line
    assert journal_runtimes(str(path)) == ["podman", "docker"]


def _labelled(label: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "--all", "--quiet", "--filter", f"label={label}"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.split()


@pytest.fixture
def detached(container_image: str) -> Iterator[list[str]]:
    """Labels of the containers a test starts with :func:`run_detached`: each is removed
    at the end, and none may be left."""
    labels: list[str] = []
    yield labels
    left = [c for label in labels for c in _labelled(label)]
    if left:
        subprocess.run(["podman", "rm", "--force", "--time", "0", "--ignore", *left],
                       capture_output=True, check=False, timeout=60)
    assert not left


def run_detached(image: str, labels: list[str], label: str) -> str:
    """Start a container that runs on with no client (as a killed client's does)."""
    labels.append(label)
    return subprocess.run(
        ["podman", "run", "--detach", "--init", "--label", label, "--name",
         f"hm-test-{uuid.uuid4().hex[:10]}", image, "sleep", "300"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()


def test_a_dead_agents_journal_removes_its_labelled_containers_and_no_others(
    tmp_path: Path, container_image: str, detached: list[str]
) -> None:
    journal = tmp_path / "lifeline" / "4242.1"
    journal.parent.mkdir()
    journal.write_text("c podman\n")
    mine = f"{CONTAINER_LABEL}={journal}"
    other = f"{CONTAINER_LABEL}={tmp_path}/lifeline/4343.1"
    run_detached(container_image, detached, mine)
    spared = run_detached(container_image, detached, other)
    assert kill_journal(str(journal)) == (0, 1)
    assert _labelled(mine) == [] and not journal.exists()
    assert [c for c in _labelled(other) if spared.startswith(c)]
    assert remove_containers("podman", other) == 1
    assert _labelled(other) == []
    with pytest.raises(ValueError, match="rkt"):  # the watchdog execs only known runtimes
        remove_containers("rkt", other)
