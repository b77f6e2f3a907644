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
each runtime whether its daemon answers, once per agent (``--container-runtime`` names one,
or ``none`` for the process runtime).

A container outlives its client: ``podman run`` (or ``docker run``) killed, the container
runs on under conmon (or dockerd). So every container carries labels that find it
(``hypermesh.lifeline``: the agent's lifeline journal; ``hypermesh.task``: its attempt),
its processes carry the lifeline's marker (passed by name), and

- a stopped attempt (cancel, timeout, drain) removes its containers once its client is
  gone (``remove_argv``; a container that exits by itself is removed by ``--rm``);
- when the agent dies, its lifeline watchdog kills the marked processes and then removes
  what its journal's runtimes still hold under its label (``lifeline.kill_journal``), as
  does the next agent started in the same work directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

from hypermesh.agent.tasks import lifeline
from hypermesh.agent.tasks.leftovers import RUNTIMES
from hypermesh.config import CONTAINER_RUNTIMES
from hypermesh.recipe.recipe import IMAGE_RE

log = logging.getLogger("hypermesh.agent")

# Images for `framework:`; an experiment's `image:` wins over its framework.
FRAMEWORK_IMAGES: dict[str, str] = {
    "pytorch": "pytorch/pytorch:2.4.1-cuda12.1-cudnn9-runtime",
    "tensorflow": "tensorflow/tensorflow:2.17.0-gpu",
    "jax": "ghcr.io/nvidia/jax:jax",
    "sklearn": "python:3.12-slim",
}
RUNTIME_CHOICES = CONTAINER_RUNTIMES
"""``--container-runtime``: ``auto`` probes ``RUNTIMES`` in order; ``none`` runs every task
with the process runtime."""
PROBE_TIMEOUT_S = 10.0
REMOVE_TIMEOUT_S = 30.0
"""How long a stopped attempt waits for its runtime to remove its containers, in seconds."""
TASK_LABEL = "hypermesh.task"
"""The label naming the attempt (``TASK.ATTEMPT``, with the rank for a gang member) whose
command a container runs."""


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
    labels: Mapping[str, str] | None = None,
) -> list[str]:
    """``RUNTIME run ... IMAGE bash -c COMMAND`` for one command of a task."""
    if not IMAGE_RE.fullmatch(image):  # the recipe checked it; this is the last word
        raise ValueError(f"not an image reference: {image[:80]!r}")
    argv = [runtime, "run", "--rm", "--init", "--name", name, "--network", "host",
            "--ipc", "host", "-w", workdir]
    for key, value in sorted((labels or {}).items()):
        argv += ["--label", f"{key}={value}"]
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


def remove_argv(runtime: str, names: Iterable[str]) -> list[str]:
    """The command that kills (SIGKILL, no second grace) and removes the containers
    ``names``; one already gone is no error to podman and a harmless one to docker."""
    if runtime == "podman":
        return ["podman", "rm", "--force", "--time", "0", "--ignore", *names]
    return [runtime, "rm", "--force", *names]


def container_names(task_name: str, count: int) -> list[str]:
    """The names of the containers of an attempt's ``count`` commands."""
    return [f"hm-{task_name}-{i}" for i in range(count)]


def current_user() -> str:
    return f"{os.getuid()}:{os.getgid()}"


def task_env_names(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    """The names a container gets: the task's variables except those ``base`` (the
    allow-listed part of the agent's environment, ``task_env.host_env``) gave it unchanged,
    whose PATH and HOME belong to the host. What the recipe passes by name (``pass_env``)
    goes in; the values come from the client's environment, which is the task's."""
    return sorted(k for k, v in env.items() if base.get(k) != v)


async def run_quietly(argv: list[str], timeout: float) -> int | None:
    """Run ``argv`` without input or output, for at most ``timeout`` seconds; its exit
    status (None: it did not start, or was killed at the deadline). Failures are logged."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        log.warning("%s: %s", shlex.join(argv[:3]), exc)
        return None
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("%s: no answer in %gs", shlex.join(argv[:3]), timeout)
        return None
    if proc.returncode:
        log.warning("%s exited %d: %s", shlex.join(argv[:3]), proc.returncode,
                    err.decode(errors="replace").strip()[-300:])
    return proc.returncode


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
    once, when the first task that names an image or framework starts: ``choice`` is
    ``--container-runtime`` (``RUNTIME_CHOICES``)."""

    def __init__(self, choice: str = "auto") -> None:
        if choice not in RUNTIME_CHOICES:
            raise ValueError(f"container runtime {choice!r}: expected one of "
                             f"{', '.join(RUNTIME_CHOICES)}")
        self.choice = choice
        self._runtime: asyncio.Task[str | None] | None = None

    async def runtime(self) -> str | None:
        if self._runtime is None:
            candidates = {"auto": RUNTIMES, "none": ()}.get(self.choice, (self.choice,))
            self._runtime = asyncio.ensure_future(find_runtime(candidates))
        return await self._runtime

    def _no_runtime(self) -> str:
        """Why tasks with an image run with the process runtime here."""
        if self.choice == "none":
            return "containers are off on this node (--container-runtime none)"
        asked = RUNTIMES if self.choice == "auto" else (self.choice,)
        return f"no {' or '.join(asked)} answers on this node"

    def remover(
        self, runtime: str | None, task_name: str, count: int
    ) -> Callable[[], Awaitable[None]] | None:
        """What a stopped attempt runs once its client is gone (``AttemptProcess``'s
        ``on_stop``): remove the containers of its ``count`` commands, which a killed
        client leaves running. None for the process runtime."""
        if runtime is None:
            return None
        argv = remove_argv(runtime, container_names(task_name, count))

        async def remove() -> None:
            await run_quietly(argv, REMOVE_TIMEOUT_S)

        return remove

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
            with open(log_path, "a") as out:
                out.write(f"[hypermesh] image {image}: {self._no_runtime()}; running with "
                          "the process runtime\n")
            return commands, None
        data = sorted({v for k, v in env.items() if k.startswith("HM_DATA_")})
        # Writable: the attempt's folder, each data set's .out/ (over its read-only
        # mount) and the checkpoint folder, which may lie in one of those.
        rw = [env.get("HM_ATTEMPT_DIR", ""), *(f"{d}/.out" for d in data),
              env.get("HM_CHECKPOINT_DIR", "")]
        names = task_env_names(env, base_env)
        labels = {TASK_LABEL: task_name}
        line = lifeline.ACTIVE
        if line is not None:  # found by the watchdog: by label, and by marker inside
            line.journal.container(runtime)
            labels[lifeline.CONTAINER_LABEL] = line.marker
            names.append(lifeline.MARKER)
        return [
            shlex.join(
                container_argv(
                    runtime, image, command, name=name, env=names,
                    workdir=str(workdir), mounts=rw, read_only=data, gpus=devices,
                    user=current_user(), labels=labels,
                )
            )
            for name, command in zip(container_names(task_name, len(commands)), commands,
                                     strict=True)
        ], runtime
