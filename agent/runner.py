"""Running one attempt of a task as subprocesses.

The commands of a task run in order, each as ``/bin/bash -c COMMAND`` in its own
process group (so a stop reaches every child), with stdout and stderr appended to
one log file. The first failing command ends the attempt. A stop (cancel, drain,
timeout) sends SIGTERM to the group, then SIGKILL after the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: ``state`` is succeeded, failed or cancelled."""

    state: str
    exit_code: int | None
    reason: str
    ended_at: float


class AttemptProcess:
    """One attempt's processes. Only the agent's task that owns it calls ``run``;
    anyone may call ``stop``."""

    def __init__(
        self,
        commands: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
        timeout: float | None,
        grace: float,
    ) -> None:
        self.commands = list(commands)
        self.env = dict(env)
        self.cwd = cwd
        self.log_path = log_path
        self.timeout = timeout
        self.grace = grace
        self._stop_reason: str | None = None
        self._stopped = asyncio.Event()
        self._proc: Any = None  # subprocess.Popen, or asyncio's Process without pidfds

    @property
    def pid(self) -> int | None:
        """The running command's process id (it leads its own process group), if one runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def stop(self, reason: str, grace: float | None = None) -> None:
        """Ask the attempt to end with ``reason`` (cancelled, preempted, node-lost, pruned)."""
        if self._stop_reason is None:
            self._stop_reason = reason
            if grace is not None:
                self.grace = grace
            self._stopped.set()

    async def run(self) -> Outcome:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with open(self.log_path, "ab", buffering=0) as log:
            if not self.cwd.is_dir():
                log.write(f"[hypermesh] workdir {self.cwd} does not exist on this node\n".encode())
                return Outcome("failed", 127, "exit", time.time())
            for command in self.commands:
                if self._stop_reason is not None:
                    return self._stopped_outcome(None)
                log.write(f"[hypermesh] $ {command}\n".encode())
                code, timed_out = await self._run_one(command, log, deadline)
                if timed_out:
                    log.write(f"[hypermesh] timed out after {self.timeout:g}s\n".encode())
                    return Outcome("failed", code, "timeout", time.time())
                if self._stop_reason is not None:
                    return self._stopped_outcome(code)
                if code != 0:
                    log.write(f"[hypermesh] exit code {code}\n".encode())
                    return Outcome("failed", code, "exit", time.time())
        return Outcome("succeeded", 0, "exit", time.time())

    def _stopped_outcome(self, code: int | None) -> Outcome:
        reason = self._stop_reason or "cancelled"
        # A trial the search pruned ended as the search wanted: not a failure.
        state = {"cancelled": "cancelled", "pruned": "succeeded"}.get(reason, "failed")
        return Outcome(state, code, reason, time.time())

    async def _spawn(self, command: str, log: object) -> tuple[Any, asyncio.Future[int]]:
        """Start ``bash -c command``; the process and a future of its exit status.

        Where the kernel has pidfds the exit is read from the event loop (one fd
        watched per child): no asyncio subprocess transport, which costs more per
        short task than the task's own process start."""
        args = ["/bin/bash", "-c", command]
        if not _HAVE_PIDFD:
            proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.DEVNULL, stdout=log,  # type: ignore[arg-type]
                stderr=asyncio.subprocess.STDOUT, cwd=self.cwd, env=self.env,
                start_new_session=True,
            )
            return proc, asyncio.ensure_future(proc.wait())
        popen = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env, start_new_session=True,
        )
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        pidfd = os.pidfd_open(popen.pid)

        def reap() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            code = popen.wait()
            if not exited.done():
                exited.set_result(code)

        loop.add_reader(pidfd, reap)
        return popen, exited

    async def _run_one(self, command: str, log: object, deadline: float | None) -> tuple[int, bool]:
        proc, waiter = await self._spawn(command, log)
        self._proc = proc
        stopper = asyncio.ensure_future(self._stopped.wait())
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait(
                {waiter, stopper}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopper.cancel()
        if waiter in done:
            return waiter.result(), False
        timed_out = stopper not in done
        await self._terminate(proc, waiter)
        return waiter.result(), timed_out

    async def _terminate(self, proc: Any, waiter: asyncio.Future[int]) -> None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout=self.grace)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await waiter
        # Children that ignored SIGTERM and outlived their parent still die.
        _signal_group(proc.pid, signal.SIGKILL)


def _pidfd_works() -> bool:
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


_HAVE_PIDFD = _pidfd_works()


def use_pidfd_child_watcher() -> None:  # call from within the running loop
    """On Python 3.11 asyncio waits for each child in a thread of its own; a pidfd
    watcher waits in the event loop instead, which is much cheaper per task.
    Python 3.12+ does this by itself."""
    if sys.version_info >= (3, 12) or not _HAVE_PIDFD:
        return  # or a kernel without pidfds: keep the default watcher
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
