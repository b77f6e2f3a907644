"""Container runtimes: running a task's commands inside ``image`` (or its ``framework``'s
image) with docker or podman, or with the process runtime where neither works.

``container_argv`` builds the command line (pure, tested as construction): the task's
working folder, attempt folder, checkpoint folder and data mounts are bind-mounted at the
same paths (data read-only), the task's environment is passed by name (``-e NAME``: values
never appear on a command line; the runtime's client runs with the task's environment, not
the agent's), the user is the agent's, networking and IPC are the
host's (rendezvous ports, shared-memory data loaders), and the booked GPUs are passed
through (``--gpus device=...`` for docker, CDI ``nvidia.com/gpu=N`` devices for podman),
renumbered from 0 inside, as ``CUDA_VISIBLE_DEVICES`` then says. ``find_runtime`` asks
each runtime whether its daemon answers, once per agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from hypermesh.recipe.recipe import IMAGE_RE

# Images for `framework:`; an experiment's `image:` wins over its framework.
FRAMEWORK_IMAGES: dict[str, str] = {
    "pytorch": "pytorch/pytorch:2.4.1-cuda12.1-cudnn9-runtime",
    "tensorflow": "tensorflow/tensorflow:2.17.0-gpu",
    "jax": "ghcr.io/nvidia/jax:jax",
    "sklearn": "python:3.12-slim",
}
RUNTIMES = ("docker", "podman")
PROBE_TIMEOUT_S = 10.0


def image_for(framework: str | None, image: str | None) -> str | None:
    """The image an experiment runs in: ``image``, else its framework's, else None
    (an unknown framework is recorded only, as before)."""
    if image:
        return image
    return FRAMEWORK_IMAGES.get((framework or "").lower())


def container_argv(
    runtime: str,
    image: str,
    command: str,
    *,
    name: str,
    env: Iterable[str],
    workdir: str,
    mounts: Iterable[str] = (),
    read_only: Iterable[str] = (),
    gpus: list[int] | None = None,
    user: str | None = None,
) -> list[str]:
    """``RUNTIME run ... IMAGE bash -c COMMAND`` for one command of a task."""
    if not IMAGE_RE.fullmatch(image):  # the recipe checked it; this is the last word
        raise ValueError(f"not an image reference: {image[:80]!r}")
    argv = [runtime, "run", "--rm", "--init", "--name", name, "--network", "host",
            "--ipc", "host", "-w", workdir]
    if user is not None:
        argv += ["--user", user]
    seen: set[str] = set()
    # Read-only data first: a checkpoint folder inside a data mount is mounted over it.
    for path, mode in [(workdir, "rw"), *((m, "ro") for m in read_only),
                       *((m, "rw") for m in mounts)]:
        if path and path not in seen:
            seen.add(path)
            argv += ["-v", f"{path}:{path}:{mode}"]
    for key in sorted(set(env) - {"CUDA_VISIBLE_DEVICES"}):
        argv += ["-e", key]
    devices = gpus or []
    if devices and runtime == "docker":
        argv += ["--gpus", f"\"device={','.join(str(i) for i in devices)}\""]
    elif devices:
        for i in devices:
            argv += ["--device", f"nvidia.com/gpu={i}"]
    argv += ["-e", "CUDA_VISIBLE_DEVICES=" + ",".join(str(i) for i in range(len(devices)))]
    return [*argv, image, "bash", "-c", command]


def current_user() -> str:
    return f"{os.getuid()}:{os.getgid()}"


def task_env_names(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    """The names a container gets: the task's variables except those ``base`` (the
    allow-listed part of the agent's environment, ``task_env.host_env``) gave it unchanged,
    whose PATH and HOME belong to the host. What the recipe passes by name (``pass_env``)
    goes in; the values come from the client's environment, which is the task's."""
    return sorted(k for k, v in env.items() if base.get(k) != v)


async def find_runtime(candidates: Iterable[str] = RUNTIMES) -> str | None:
    """The first runtime whose CLI is installed and whose daemon (or socket) answers."""
    for runtime in candidates:
        if shutil.which(runtime) is None:
            continue
        proc = await asyncio.create_subprocess_exec(
            runtime, "info", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            if await asyncio.wait_for(proc.wait(), PROBE_TIMEOUT_S) == 0:
                return runtime
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return None


class Containers:
    """Wraps a task's commands in the node's container runtime. The runtime is probed
    once, when the first task that names an image or framework starts."""

    def __init__(self) -> None:
        self._runtime: asyncio.Task[str | None] | None = None

    async def runtime(self) -> str | None:
        if self._runtime is None:
            self._runtime = asyncio.ensure_future(find_runtime())
        return await self._runtime

    async def wrap(
        self,
        task_name: str,
        image: str,
        commands: list[str],
        env: Mapping[str, str],
        base_env: Mapping[str, str],
        devices: list[int],
        workdir: Path,
        log_path: Path,
    ) -> tuple[list[str], str | None]:
        """The commands to run, and the runtime (None: the process runtime, which the
        attempt's log then says)."""
        runtime = await self.runtime()
        if runtime is None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as log:
                log.write(f"[hypermesh] image {image}: no docker or podman answers on this "
                          "node; running with the process runtime\n")
            return commands, None
        data = [v for k, v in env.items() if k.startswith("HM_DATA_")]
        rw = [env.get("HM_ATTEMPT_DIR", ""), env.get("HM_CHECKPOINT_DIR", "")]
        names = task_env_names(env, base_env)
        return [
            shlex.join(
                container_argv(
                    runtime, image, command, name=f"hm-{task_name}-{i}", env=names,
                    workdir=str(workdir), mounts=rw, read_only=data, gpus=devices,
                    user=current_user(),
                )
            )
            for i, command in enumerate(commands)
        ], runtime
