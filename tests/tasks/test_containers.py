"""Container runtimes: the docker/podman command lines built for a task (construction
only: no container daemon runs here), and a task naming an image on a node without a
working runtime, which runs with the process runtime and says so."""

from __future__ import annotations

import shlex

import pytest

from hypermesh.agent.tasks.containers import (
    FRAMEWORK_IMAGES,
    container_argv,
    image_for,
    task_env_names,
)
from tests.conftest import Mesh


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


def test_without_a_runtime_the_process_runtime_runs_it_and_says_so(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An agent whose PATH holds no docker nor podman (whatever this machine has).
    (mesh.root / "bin").mkdir()
    monkeypatch.setenv("PATH", str(mesh.root / "bin"))
    mesh.agent()
    recipe = mesh.write_recipe(
        """
experiments:
  t:
    framework: pytorch
    command: ["echo ran here"]
"""
    )
    wid = mesh.submit(recipe, "--wait")
    out = mesh.hm("logs", f"{wid}.t.0", check=True).stdout
    assert "no docker or podman answers on this node; running with the process runtime" in out
    assert "ran here" in out
