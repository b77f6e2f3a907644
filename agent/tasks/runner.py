"""Running one attempt of a task as subprocesses.

The commands of a task run in order, each as ``/bin/bash -c COMMAND`` in its own
process group (so a stop reaches every child). A command with no shell syntax at all
(``python train.py --lr 0.1``: plain words, a first word that is no shell keyword or
builtin) is executed directly, as GNU make does: bash would only exec it after
starting, which costs a short task more CPU than the task itself (``direct_argv``).
The first failing command ends the attempt. A stop (cancel, drain, timeout) sends
SIGTERM to the group, then SIGKILL after the grace period, and then runs the attempt's
``on_stop`` when it has one: a container runtime's client that dies leaves its container
running, which ``on_stop`` removes (``containers.py``).

Their stdout and stderr go to one pipe that the agent's event loop copies into the
attempt's log file, as a container runtime's shim does. The file is made only when
there is something to put in it: output, or the note of a failure or a timeout. A
task that succeeds silently (most trivial tasks) leaves no file, because creating
one is the dearest thing such an attempt costs the node (see ``dirpool``). The
``[hypermesh] $ COMMAND`` line before each command is written only with the first
output. When a command has exited the pipe is drained before the next one starts, so
the log keeps the order; after the last one it is drained and closed, and a
straggler that still writes gets EPIPE.

Where the agent opened its lifeline (``lifeline.ACTIVE``), every command's environment
carries the lifeline's marker and its process is in the lifeline's journal from its start
until it has been reaped, so that it dies with the agent (``agent/tasks/lifeline.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import string
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypermesh.agent.tasks import lifeline
from hypermesh.agent.tasks.spawn import spawn

log = logging.getLogger("hypermesh.agent")


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
        cwd: str | Path,
        log_path: str | Path,
        timeout: float | None,
        grace: float,
        on_stop: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.commands = list(commands)
        self.on_stop = on_stop
        self.env = dict(env)
        line = lifeline.ACTIVE
        if line is not None:
            self.env[lifeline.MARKER] = line.marker
        self.cwd = cwd
        self.log_path = log_path
        self.timeout = timeout
        self.grace = grace
        self._stop_reason: str | None = None
        self._woken: asyncio.Future[str] | None = None  # what a running command awaits
        self._proc: Any = None  # a spawn.Child (or Popen), or asyncio's Process without pidfds

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
            _settle(self._woken, "stop")

    async def run(self) -> Outcome:
        out = LazyLog(self.log_path)
        try:
            if not os.path.isdir(self.cwd):
                out.note(f"[hypermesh] workdir {self.cwd} does not exist on this node\n")
                return Outcome("failed", 127, "exit", time.time())
            with OutputPipe(out.write) as pipe:
                return await self._run_all(out, pipe)
        finally:
            out.close()

    async def _run_all(self, out: LazyLog, pipe: OutputPipe) -> Outcome:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for command in self.commands:
            if self._stop_reason is not None:
                return self._stopped_outcome(None)
            out.header(f"[hypermesh] $ {command}\n")
            code, timed_out = await self._run_one(command, pipe.write_fd, deadline)
            pipe.drain()
            if timed_out:
                out.note(f"[hypermesh] timed out after {self.timeout:g}s\n")
                return Outcome("failed", code, "timeout", time.time())
            if self._stop_reason is not None:
                return self._stopped_outcome(code)
            if code != 0:
                out.note(f"[hypermesh] exit code {code}\n")
                return Outcome("failed", code, "exit", time.time())
        return Outcome("succeeded", 0, "exit", time.time())

    def _stopped_outcome(self, code: int | None) -> Outcome:
        reason = self._stop_reason or "cancelled"
        # A trial the search pruned ended as the search wanted: not a failure.
        state = {"cancelled": "cancelled", "pruned": "succeeded"}.get(reason, "failed")
        return Outcome(state, code, reason, time.time())

    async def _spawn(self, command: str, log: int) -> tuple[Any, asyncio.Future[int]]:
        """Start ``command`` (directly, or as ``bash -c command``); the process and a
        future of its exit status. A direct start that fails (not found, not
        executable, a script without ``#!``) is left to bash, whose error message
        and exit status the log then shows, as without the shortcut.

        Where the kernel has pidfds the exit is read from the event loop (one fd
        watched per child): no asyncio subprocess transport, which costs more per
        short task than the task's own process start."""
        line = lifeline.ACTIVE
        journal = line.journal if line is not None else None
        if not _HAVE_PIDFD:
            proc = await self._start(command, log, _asyncio_exec)
            waiter = asyncio.ensure_future(proc.wait())
            if journal is not None:
                journal.started(proc.pid)
                waiter.add_done_callback(lambda _: journal.ended(proc.pid))
            return proc, waiter
        popen = await self._start(command, log, _popen)
        if journal is not None:
            journal.started(popen.pid)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        pidfd = os.pidfd_open(popen.pid)

        def reap() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            code = popen.wait()
            if journal is not None:
                journal.ended(popen.pid)
            if not exited.done():
                exited.set_result(code)

        loop.add_reader(pidfd, reap)
        return popen, exited

    async def _start(self, command: str, log: int, start: _Starter) -> Any:
        """``start`` the command's own arguments, or else bash's."""
        argv = direct_argv(command)
        if argv is not None and (
            not _BASH_ENV.isdisjoint(self.env) or f"BASH_FUNC_{argv[0]}%%" in self.env
        ):
            argv = None  # bash would read a file, set options or call a function: let it
        if argv is not None:
            # bash would set PWD to the folder it starts in; a program started
            # directly would otherwise see the agent's.
            env = {**self.env, "PWD": os.path.abspath(self.cwd)}
            try:
                return await start(argv, log, self.cwd, env)
            except OSError:
                pass  # bash says why, as it would have without the shortcut
        return await start(["/bin/bash", "-c", command], log, self.cwd, self.env)

    async def _run_one(self, command: str, log: int, deadline: float | None) -> tuple[int, bool]:
        """Run one command until it exits, the attempt is stopped or ``deadline``
        passes; its exit status and whether it timed out. One future is awaited, settled
        by whichever comes first (no task or ``asyncio.wait`` per command)."""
        proc, exited = await self._spawn(command, log)
        self._proc = proc
        why = "stop"
        if self._stop_reason is None:
            loop = asyncio.get_running_loop()
            woken = self._woken = loop.create_future()
            exited.add_done_callback(lambda _: _settle(woken, "exited"))
            timer = None
            if deadline is not None:
                delay = max(0.0, deadline - time.monotonic())
                timer = loop.call_later(delay, _settle, woken, "timeout")
            try:
                why = await woken
            finally:
                self._woken = None
                if timer is not None:
                    timer.cancel()
        if why == "exited":
            return exited.result(), False
        await self._terminate(proc, exited)
        return exited.result(), why == "timeout"

    async def _terminate(self, proc: Any, waiter: asyncio.Future[int]) -> None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout=self.grace)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await waiter
        # Children that ignored SIGTERM and outlived their parent still die.
        _signal_group(proc.pid, signal.SIGKILL)
        if self.on_stop is not None:
            try:
                await self.on_stop()
            except Exception:  # the attempt's end is recorded whatever this left
                log.exception("after stopping %s", self.log_path)


# What a command may be made of to be executed without a shell: every other character
# (quotes, $, globs, redirections, ~, #, braces, tabs, newlines...) means bash.
_PLAIN = frozenset(string.ascii_letters + string.digits + " _-./:,+@%=")
# First words bash must run itself: its keywords, and its builtins, which act on the
# shell or differ from the program of the same name. Only ``true`` and ``false``
# without arguments are the same either way.
_SHELL_WORDS = frozenset({
    ".", ":", "alias", "bg", "bind", "break", "builtin", "caller", "case", "cd", "command",
    "compgen", "complete", "compopt", "continue", "coproc", "declare", "dirs", "disown",
    "do", "done", "echo", "elif", "else", "enable", "esac", "eval", "exec", "exit",
    "export", "fc", "fg", "fi", "for", "function", "getopts", "hash", "help", "history",
    "if", "in", "jobs", "kill", "let", "local", "logout", "mapfile", "popd", "printf",
    "pushd", "pwd", "read", "readarray", "readonly", "return", "select", "set", "shift",
    "shopt", "source", "suspend", "test", "then", "time", "times", "trap", "type",
    "typeset", "ulimit", "umask", "unalias", "unset", "until", "wait", "while",
})  # (the others, such as [[ or {, are not plain: see _PLAIN)


# Variables by which the environment makes bash do something before the command (read
# a start-up file, trace it...): with any of them set, commands go through bash.
_BASH_ENV = frozenset({"BASH_ENV", "SHELLOPTS", "BASHOPTS"})


def direct_argv(command: str) -> list[str] | None:
    """The argument vector that runs ``command`` without a shell, or None when it
    needs bash (shell syntax, a keyword or builtin, an assignment first)."""
    if not _PLAIN.issuperset(command):
        return None
    argv = [word for word in command.split(" ") if word]
    if not argv:
        return None
    first = argv[0]
    if first in _SHELL_WORDS or "=" in first or first[0] in "-%":
        return None
    if first in ("true", "false") and len(argv) > 1:
        return None  # the programs take --help and --version; the builtins do not
    return argv


class LazyLog:
    """An attempt's log file, made at the first byte that goes into it. Header lines
    wait for output to follow them; notes (failures, timeouts) are written at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._file: Any = None
        self._pending = b""  # the running command's header line, until output follows
        self._broken = False

    def header(self, text: str) -> None:
        if self._file is None:
            self._pending = text.encode()
        else:
            self._file.write(text.encode())

    def note(self, text: str) -> None:
        self.write(text.encode())

    def write(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            if self._file is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (see close)
                self._file.write(self._pending)
            self._file.write(data)
        except OSError as exc:  # a full or broken disk: the task runs on, unlogged
            self._broken = True
            log.warning("attempt log %s: %s; the rest of its output is dropped", self.path, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


PIPE_READ = 1 << 18
"""Bytes read from an attempt's output pipe per wake-up."""


class OutputPipe:
    """The pipe an attempt's commands write to, copied to ``sink`` from the event loop."""

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self.sink = sink
        self._read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(self.write_fd, True)  # the tasks' end: writes wait when full
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._read_fd, self.drain)

    def __enter__(self) -> OutputPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.remove_reader(self._read_fd)
        os.close(self.write_fd)
        self.drain()
        os.close(self._read_fd)

    def drain(self) -> None:
        """Copy what is in the pipe now (never waits)."""
        while True:
            try:
                data = os.read(self._read_fd, PIPE_READ)
            except BlockingIOError:
                return
            if not data:
                return
            self.sink(data)
            if len(data) < PIPE_READ:
                return


_Starter = Callable[[list[str], int, "str | Path", Mapping[str, str]], Awaitable[Any]]
"""Starts a command's process: arguments, output fd, working folder, environment."""


async def _popen(args: list[str], log: int, cwd: str | Path, env: Mapping[str, str]) -> Any:
    return spawn(args, cwd=os.fspath(cwd), env=env, stdin=_devnull(), stdout=log)


async def _asyncio_exec(
    args: list[str], log: int, cwd: str | Path, env: Mapping[str, str]
) -> Any:
    return await asyncio.create_subprocess_exec(
        *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
        cwd=cwd, env=env, start_new_session=True,
    )


_DEVNULL: int | None = None


def _devnull() -> int:
    """One read-only ``/dev/null`` descriptor for every task's stdin, rather than the
    open and close that ``subprocess.DEVNULL`` costs per process."""
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _DEVNULL


def _settle(future: asyncio.Future[str] | None, why: str) -> None:
    if future is not None and not future.done():
        future.set_result(why)


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
