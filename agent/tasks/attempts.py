"""Running the attempts this node claimed, and recording how each ended.

Each attempt runs in a scratch folder ``attempts/WID/EXPERIMENT.INDEX.N`` (from the
pool of empty folders), writes its output beside it (``.log``), sees the task's
environment (the recipe's and an allow-list of the agent's, never the agent's credentials:
``task_env.py``) with its parameters, its data sets mounted (``HM_DATA_*``), a checkpoint
folder and exactly the GPUs booked for it, and runs in its image when the experiment
names one. Its log is shipped to the store and its metrics watched while it runs.

Its end is recorded with a transaction fenced on its claim (``finish_attempts``); ends
that arrive in the same loop turn share one transaction. While etcd is away the record
is retried as long as the node lease is fresh; a claim that is gone (a lost lease, a
re-claim by a peer) rejects it, and the decision log says so. The end of an attempt of a
held block goes to the block duty instead, which records it in the block's next flush.

Every path here runs once per attempt: it is kept to plain strings (no pathlib) and to
what a trivial task needs (no thread hop without data sets, no task for metrics before
the first poll).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypermesh.agent.ops.telemetry import TaskRoot
from hypermesh.agent.tasks.containers import image_for
from hypermesh.agent.tasks.gpu_pool import visible_devices
from hypermesh.agent.tasks.images import ImageUnavailable
from hypermesh.agent.tasks.metrics_watch import PruningMedians, attempt_watch, metrics_file
from hypermesh.agent.tasks.mounts import Mounts
from hypermesh.agent.tasks.runner import AttemptProcess, Outcome
from hypermesh.agent.tasks.task_env import task_environment
from hypermesh.errors import EtcdUnavailable, HypermeshError, LeaseLost
from hypermesh.recipe.templating import param_env, render
from hypermesh.state.records import Attempt
from hypermesh.state.txns import Finish, finish_attempts
from hypermesh.task_outputs import ENV as TENSORBOARD_ENV
from hypermesh.task_outputs import tensorboard_dir

if TYPE_CHECKING:
    from hypermesh.agent.tasks.blocks import BlockDuty
    from hypermesh.agent.tasks.containers import Containers
    from hypermesh.agent.tasks.dirpool import DirPool
    from hypermesh.agent.tasks.gpu_pool import GpuPool
    from hypermesh.agent.tasks.images import ImageCache
    from hypermesh.agent.tasks.logs import LogShipper
    from hypermesh.agent.tasks.running import Running
    from hypermesh.config import AgentConfig
    from hypermesh.recipe.recipe import Experiment
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace, TaskRef
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")


class AttemptsHost(Protocol):
    """What :class:`Attempts` uses of its agent. The collaborators (``view`` to ``blocks``)
    and the events are read once, at construction; ``cfg``, ``drain_grace`` and
    ``written_revision`` at every use. It writes ``written_revision`` (never lowers it)."""

    cfg: AgentConfig  # replaced by the Drain RPC (its kill_grace)
    view: MeshView
    etcd: Etcd
    ks: Keyspace
    base_env: dict[str, str]  # the allow-listed part of agent_env (task_env.host_env)
    agent_env: dict[str, str]  # whence pass_env takes what it names
    work_dir: Path
    dirs: DirPool
    mounts: Mounts
    containers: Containers
    images: ImageCache  # read at every attempt with an image
    logs: LogShipper
    gpu_pool: GpuPool
    blocks: BlockDuty
    pruning_medians: PruningMedians
    written_revision: int
    drain_grace: float | None
    view_whole: asyncio.Event  # set while ``view`` holds the whole namespace
    stopping: asyncio.Event
    lease_lost: asyncio.Event
    wakeup: asyncio.Event

    def lease_fresh(self) -> bool: ...

    def decide(self, message: str) -> None: ...


class Attempts:
    """The attempts this node runs. ``running`` holds each from its start until its end
    is recorded (or found rejected): :meth:`start` adds it, its own task removes it. Only
    the agent's event loop touches it; anyone on the loop may stop a process."""

    def __init__(self, agent: AttemptsHost) -> None:
        self.agent = agent
        self.running: dict[TaskRef, Running] = {}
        self.name = agent.cfg.name
        self.view = agent.view
        self.etcd = agent.etcd
        self.ks = agent.ks
        self.base_env = agent.base_env
        self._agent_env = agent.agent_env
        self.work_dir = agent.work_dir
        self._work_dir = str(agent.work_dir)
        self.dirs = agent.dirs
        self.mounts = agent.mounts
        self.containers = agent.containers
        self.logs = agent.logs
        self.gpu_pool = agent.gpu_pool
        self.blocks = agent.blocks
        self._stopping = agent.stopping
        self._lease_lost = agent.lease_lost
        self._wake = agent.wakeup
        self._attempts = str(agent.work_dir / "attempts")
        self._checkpoints = str(agent.work_dir / "checkpoints")
        self._workflow_dirs: set[str] = set()  # attempts/WID folders made by this run
        # (workflow, experiment) -> (its recipe, the environment its tasks share)
        self._task_env: dict[tuple[str, str], tuple[object, dict[str, str]]] = {}
        self._finishing: list[tuple[Finish, asyncio.Future[int | None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ running
    def start(self, r: Running) -> None:
        """Run ``r``, claimed by this node: it is in ``running`` until it ended."""
        self.running[r.plan.ref] = r
        r.task = asyncio.create_task(self.execute(r), name=f"attempt {r.plan.ref}")

    def stop_all(self, reason: str, grace: float | None) -> None:
        """Stop the process of every attempt (those not started yet stop at their start
        when the agent drains)."""
        for r in list(self.running.values()):
            if r.process is not None:
                r.process.stop(reason, grace=grace)

    def processes_gone(self) -> bool:
        """Whether no attempt's process may still run: each has one, stopped before it
        started or exited (an attempt still being set up has none yet)."""
        return all(r.process is not None and r.process.pid is None
                   for r in self.running.values())

    def stop_cancelled(self) -> None:
        """Stop the attempts of workflows and experiments cancelled since they started."""
        view = self.view
        for ref, r in self.running.items():
            if r.process is not None and (
                view.workflow_state(ref.workflow) == "cancelled"
                or view.experiment_cancelled(ref.workflow, ref.experiment)
            ):
                r.process.stop("cancelled")

    def task_roots(self) -> list[TaskRoot]:
        """The first process of each running attempt, for telemetry."""
        roots = []
        for ref, r in self.running.items():
            pid = r.process.pid if r.process is not None else None
            if pid is not None:
                roots.append(TaskRoot(ref.id, r.plan.attempt, pid))
        return roots

    # ------------------------------------------------------------------ folders
    def attempt_dir(self, ref: TaskRef, attempt: int) -> Path:
        """The attempt's scratch folder (``HM_ATTEMPT_DIR``), beside its log."""
        return Path(self.attempt_path(ref, attempt))

    def attempt_path(self, ref: TaskRef, attempt: int) -> str:
        # Strings on the path of every attempt: pathlib costs more than the rest of it.
        return f"{self._attempts}/{ref.workflow}/{ref.experiment}.{ref.index}.{attempt}"

    def attempt_log(self, ref: TaskRef, attempt: int) -> Path:
        """The attempt's output: ``attempts/WID/EXPERIMENT.INDEX.N.log``."""
        return Path(f"{self.attempt_path(ref, attempt)}.log")

    def open_attempt_dir(self, ref: TaskRef, attempt: int) -> Path:
        """Make the attempt's scratch folder (from the pool of empty ones) and its
        workflow's folder, which also holds the logs; the scratch folder's path."""
        return Path(self._open_attempt_path(ref, attempt))

    def _open_attempt_path(self, ref: TaskRef, attempt: int) -> str:
        path = self.attempt_path(ref, attempt)
        if ref.workflow not in self._workflow_dirs:
            os.makedirs(f"{self._attempts}/{ref.workflow}", exist_ok=True)
            self._workflow_dirs.add(ref.workflow)
        self.dirs.make(path)
        return path

    def _checkpoint_path(self, ref: TaskRef) -> str:
        """A task's checkpoint folder on this node, for tasks without data sets."""
        return f"{self._checkpoints}/{ref.id}"

    # ------------------------------------------------------------------ environment
    def environment(
        self, ref: TaskRef, attempt: int, params: dict[str, Any], folder: str
    ) -> dict[str, str]:
        """The attempt's environment: the agent's allow-listed variables, those the
        experiment passes by name (``pass_env``), the recipe's and the experiment's ``env``
        (all shared by the experiment's tasks: ``task_env.task_environment``), its
        parameters and the ``HM_*`` variables."""
        wf = self.view.workflows[ref.workflow]
        shared = self._task_env.get((ref.workflow, ref.experiment))
        if shared is None or shared[0] is not wf.recipe:
            exp = wf.recipe.experiment(ref.experiment)
            recipe_env = {k: str(v) for k, v in dict(wf.recipe.env).items()}
            recipe_env.update({k: str(v) for k, v in dict(exp.env).items()})
            base = task_environment(self.base_env, self._agent_env, exp.pass_env, recipe_env)
            if len(self._task_env) >= 256:
                self._task_env.clear()
            shared = self._task_env[(ref.workflow, ref.experiment)] = (wf.recipe, base)
        env = dict(shared[1])
        env.update(param_env(params))
        env.update(
            HM_WORKFLOW_ID=ref.workflow,
            HM_EXPERIMENT=ref.experiment,
            HM_TASK_ID=ref.id,
            HM_TASK_INDEX=str(ref.index),
            HM_ATTEMPT=str(attempt),
            HM_NODE=self.name,
            HM_PYTHON=sys.executable,  # the agent's own interpreter, with hypermesh in it
            HM_ATTEMPT_DIR=folder,
            HM_METRICS_FILE=metrics_file(folder),
        )
        return env

    async def data_environment(self, ref: TaskRef, data: dict[str, str]) -> dict[str, str]:
        """Mount the task's data sets; ``HM_DATA_<ALIAS>`` for each, ``HM_DATA`` for the
        first, and ``HM_CHECKPOINT_DIR``: in the mounts' shared writable area when the
        task has data (so a later attempt on any node finds it), else on this node;
        ``HM_TENSORBOARD_DIR``: see ``hypermesh/task_outputs.py``."""
        env: dict[str, str] = {}
        for alias, spec in data.items():
            path = await self.mounts.ensure(spec)
            env[f"HM_DATA_{alias.upper()}"] = str(path)
            env.setdefault("HM_DATA", str(path))
        if "HM_DATA" in env:
            checkpoints = Mounts.checkpoint_dir(Path(env["HM_DATA"]), ref.id)
            await asyncio.to_thread(checkpoints.mkdir, parents=True, exist_ok=True)
            env["HM_CHECKPOINT_DIR"] = str(checkpoints)
        else:  # local: no thread hop on the hot path of trivial tasks
            local = self._checkpoint_path(ref)
            if not os.path.isdir(local):
                self.dirs.make(local)
            env["HM_CHECKPOINT_DIR"] = local
        # Not made in advance: the writer makes it (hypermesh/task_outputs.py).
        workdir = self.view.workflows[ref.workflow].workdir or self._work_dir
        env[TENSORBOARD_ENV] = tensorboard_dir(env.get("HM_DATA"), workdir, ref.id)
        return env

    # ------------------------------------------------------------------ one attempt
    async def execute(self, r: Running) -> None:
        """The task of attempt ``r``: run it, record its end, give back what it held."""
        ref, n = r.plan.ref, r.plan.attempt
        started = r.started_at or time.time()
        folder = self.attempt_path(ref, n)
        try:
            self._open_attempt_path(ref, n)
            wf = self.view.workflows[ref.workflow]
            exp = wf.recipe.experiment(ref.experiment)
            params = (r.params if r.params is not None
                      else self.view.tasks.get(ref, {}).get("params", {}))
            values = dict(params) | {
                "workflow_id": ref.workflow,
                "experiment": ref.experiment,
                "task_id": ref.id,
                "task_index": ref.index,
                "attempt": n,
            }
            commands = [render(c, values) for c in exp.command]
            env = self.environment(ref, n, params, folder)
            # Exactly the GPUs booked for it (none: every GPU hidden), in NVML's order.
            env.update(CUDA_VISIBLE_DEVICES=visible_devices(r.devices),
                       CUDA_DEVICE_ORDER="PCI_BUS_ID")
            try:
                env.update(await self.data_environment(ref, dict(exp.data)))
            except HypermeshError as exc:
                # The data set cannot be mounted here: the attempt fails (its log says
                # why) and retries, if any, may run where the store answers.
                self.agent.decide(f"{ref} attempt {n}: data: {exc}")
                failed_log = self.attempt_log(ref, n)
                failed_log.write_text(f"hypermesh: cannot mount the task's data: {exc}\n")
                outcome = Outcome("failed", None, "data", time.time())
                await self._finish(r, exp.retries, started, outcome)
                self.logs.after_end(ref, n, failed_log)
                return
            log_path = f"{folder}.log"  # attempt_log's path, without pathlib's cost
            on_stop = None  # a container left by a stop: removed
            image = image_for(exp.framework, exp.image)
            if image is not None:
                try:  # pulled ahead as a rule (agent/tasks/images.py): then present
                    await self.agent.images.ensure(image)
                except ImageUnavailable as exc:  # reason image; retries as usual
                    self.agent.decide(f"{ref} attempt {n}: image {image}: {exc}")
                    with open(log_path, "a") as image_log:
                        image_log.write(f"hypermesh: cannot pull image {image}: {exc}\n")
                    outcome = Outcome("failed", None, "image", time.time())
                    await self._finish(r, exp.retries, started, outcome)
                    self.logs.after_end(ref, n, log_path)
                    return
                commands, runtime = await self.containers.wrap(
                    f"{ref.id}-{n}", image, commands, env, self.base_env, r.devices,
                    Path(wf.workdir or self.work_dir), Path(log_path),
                )
                on_stop = self.containers.remover(runtime, f"{ref.id}-{n}", len(commands))
                self.agent.decide(
                    f"{ref} attempt {n}: image {image} with {runtime or 'no runtime'}"
                )
            process = r.process = AttemptProcess(
                commands,
                env=env,
                cwd=wf.workdir or self._work_dir,
                log_path=log_path,
                timeout=exp.timeout,
                grace=self.agent.cfg.kill_grace,
                on_stop=on_stop,
            )
            if self._stopping.is_set():
                r.process.stop("preempted", grace=self.agent.drain_grace)
            outcome = await self.run_watched(r, exp, process, log_path)
            await self._finish(r, exp.retries, started, outcome)
            self.logs.after_end(ref, n, log_path)
            if "HM_DATA" not in env:  # with data, the mount stored them already
                self.logs.events_after_end(ref, env[TENSORBOARD_ENV])
        except Exception:
            log.exception("%s: attempt %s/%d crashed", self.name, ref, n)
            await self._finish(r, 0, started, Outcome("failed", None, "exit", time.time()))
        finally:
            self.running.pop(ref, None)
            self.gpu_pool.release(ref)
            # Left empty (as trivial tasks leave them): back to the pool of folders.
            self.dirs.recycle(folder)
            self.dirs.recycle(self._checkpoint_path(ref))
            self._wake.set()

    async def run_watched(
        self, r: Running, exp: Experiment, process: AttemptProcess, log_path: str | Path
    ) -> Outcome:
        """Run an attempt's process while its log is copied to the store and its metrics
        are stored (and pruning asked); the metrics are stored once more at the end."""
        ref, n = r.plan.ref, r.plan.attempt
        copier = self.logs.while_running(ref, n, log_path)
        watch = attempt_watch(self.agent, r, exp, log_path, self.attempt_path(ref, n))
        stop_following = watch.follow_later(lambda: process.stop("pruned"))
        try:
            outcome = await process.run()
        finally:
            stop_following()
            if copier is not None:
                copier.cancel()
        try:
            await watch.finish()
        except Exception as exc:  # the claim is gone or etcd is away: the result decides
            self.agent.decide(f"{ref} attempt {n}: metrics not stored: {exc}")
        return outcome

    # ------------------------------------------------------------------ recording
    async def _finish(self, r: Running, retries: int, started: float, outcome: Outcome) -> None:
        agent = self.agent
        ref, n = r.plan.ref, r.plan.attempt
        attempt = Attempt(
            n,
            self.name,
            outcome.state,
            outcome.exit_code,
            outcome.reason,
            started,
            outcome.ended_at,
        )
        if r.block is not None:
            final = self.blocks.ended(r.block, r.claim_revision, ref.index, n, outcome.state,
                                      outcome.exit_code, outcome.reason, started,
                                      outcome.ended_at)
            if final != "succeeded":
                again = "; will run again" if final is None else f"; task {final}"
                agent.decide(f"{ref} attempt {n} {outcome.state} ({outcome.reason}){again}")
            return
        # node-lost / preempted: runs again, not counted
        final = self.view.final_state(ref, outcome.state, outcome.reason, retries)
        delay = 0.1
        while True:  # until recorded, or until the claim is surely gone
            try:
                written = await self._record(
                    Finish(ref, r.claim_revision, r.plan.slot, attempt, final)
                )
                ok = written is not None
                if written is not None:
                    agent.written_revision = max(agent.written_revision, written)
                break
            except LeaseLost:
                ok = False
                break
            except EtcdUnavailable as exc:
                if self._lease_lost.is_set() or not agent.lease_fresh():
                    ok = False
                    break
                log.warning("recording %s attempt %d: %s", ref, n, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
        if ok:
            suffix = f"; task {final}" if final else "; will run again"
            agent.decide(f"{ref} attempt {n} {outcome.state} ({outcome.reason}){suffix}")
        else:
            agent.decide(f"{ref} attempt {n} result rejected: claim no longer ours")

    async def _record(self, item: Finish) -> int | None:
        """Record an attempt's end; ends that arrive together share one transaction."""
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._finishing.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_finishes())
        return await future

    async def _flush_finishes(self) -> None:
        await asyncio.sleep(0)  # let attempts that end in the same loop turn join
        per_txn = 100 // Finish.OPS
        while self._finishing:
            batch = self._finishing[:per_txn]
            del self._finishing[:per_txn]
            try:
                revision = await finish_attempts(self.etcd, self.ks, [item for item, _ in batch])
                if revision is None and len(batch) > 1:
                    # One fence failed (a claim was lost): record the others alone.
                    for item, future in batch:
                        future.set_result(await finish_attempts(self.etcd, self.ks, [item]))
                    continue
                for _, future in batch:
                    future.set_result(revision)
            except Exception as exc:  # every waiter sees the failure and retries
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
