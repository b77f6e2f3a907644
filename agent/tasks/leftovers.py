"""Finding every process of an agent's tasks after the agent is gone, and killing them.

An attempt's command leads a session of its own (``spawn``), and what it starts stays in
that session unless it leaves (``setsid``, a daemon's double fork). The processes that
belong to a dead agent's tasks are (:func:`doomed`):

- each recorded command process that is still the process recorded (a :class:`Record`
  says by when it had started: a process with that pid that started later reuses the
  number), with every member of its session;
- the members of a recorded session whose leader is gone: the kernel does not hand out a
  number while a process still has it as its session id, so they are that session's;
- every descendant of those: a child that left the session while its parent lived;
- every process whose environment carries the agent's marker entry (``lifeline``), which
  children inherit even when they leave the session and their parent dies.

A container is run by its runtime (podman's conmon, dockerd), not by the task's own
processes: killing its client leaves it running. Its processes carry the marker (the
agent passes it in by name), so they are found here too; what the runtime still holds of it
afterwards, :func:`remove_containers` removes by the label the agent gave it.

Not covered: a process that left the session, lost its parent and dropped the marker
from its environment (inside a container too, though its container is removed).

:func:`kill_leftovers` stops (SIGSTOP) what it finds, so that nothing forks or leaves while
it looks, looks again until nothing new turns up (nor a process whose environment read
empty, as it does in the middle of an exec), then kills it all (SIGKILL) and waits
until it is gone. Reading ``/proc`` directly, it needs no import beyond the standard
library, so that the watchdog that runs it starts fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Container, Iterable, Mapping

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""Units of a process's start time in ``/proc/PID/stat`` (ticks since boot)."""

FIND_PASSES = 8
"""Most looks for processes that appeared while the found ones were being stopped."""

KTHREADD = 2
"""The kernel's thread creator: it and its children (kernel threads) have no environment."""

UNSURE_PAUSE_S = 0.005
"""Pause before looking again when a process's environment read empty and nothing new
was found: an exec shows the new program's environment within microseconds."""

GONE_WAIT_S = 5.0
"""How long :func:`kill_leftovers` waits for what it killed to be gone, in seconds."""

RUNTIMES = ("docker", "podman")
"""The container runtimes whose CLIs the agent runs containers with (``containers.py``)."""

RUNTIME_WAIT_S = 20.0
"""How long :func:`remove_containers` waits for each call of a runtime's CLI, in seconds."""


@dataclasses.dataclass(frozen=True)
class Record:
    """A command process an agent started: ``pid``, and ``started_by``, a time in clock
    ticks since boot at which it had surely started (taken just after the start, before
    the process could be reaped and its number handed out again)."""

    pid: int
    started_by: int


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process as ``/proc`` shows it: parent, session, start (ticks since boot),
    whether it is a zombie (already dead) and whether its environment has the marker."""

    pid: int
    ppid: int
    sid: int
    start: int
    zombie: bool = False
    marked: bool = False


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc/PID/stat`` gives start times in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLOCK_TICKS)


def doomed(records: Iterable[Record], table: Mapping[int, Proc], spare: Container[int]) -> set[int]:
    """The live processes of ``table`` that belong to the recorded tasks (see the module's
    docstring), without those in ``spare``."""
    sessions = set()
    for record in records:
        leader = table.get(record.pid)
        if leader is None or leader.start <= record.started_by:
            sessions.add(record.pid)
        # else the number is another process's now: the session was empty when reused
    found = {pid for pid, p in table.items() if p.sid in sessions or p.marked}
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {pid for pid in found if pid not in spare and not table[pid].zombie}


def read_proc(pid: int) -> Proc | None:
    """``pid`` as ``/proc`` shows it now (``marked`` left False); None if it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # pid (comm) state ppid pgrp session ... starttime: comm may hold spaces and ')'
    fields = stat[stat.rindex(b")") + 2:].split()
    return Proc(pid, int(fields[1]), int(fields[3]), int(fields[19]), fields[0] in (b"Z", b"X"))


class ProcessScan:
    """Reads the process table (of this pid namespace) as often as asked, and the
    environment of each process started at ``since`` or later (ticks since boot; a task
    is no older than its agent) once, looking for ``marker`` (``NAME=value``)."""

    def __init__(self, marker: bytes | None, since: int = 0) -> None:
        self.marker = None if marker is None else b"\0" + marker + b"\0"
        self.since = since
        self._marked: dict[tuple[int, int], bool] = {}
        # Processes of the last table whose environment read empty: in the middle of an
        # exec (the kernel shows a new program's environment only once it is set up), or
        # started with none. Read again at the next table, never taken as unmarked.
        self.unsure: set[int] = set()

    def table(self) -> dict[int, Proc]:
        table = {}
        self.unsure = set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                proc = read_proc(int(name))
                if proc is not None:
                    if self.marker is not None and proc.start >= self.since:
                        proc = dataclasses.replace(proc, marked=self._is_marked(proc))
                    table[proc.pid] = proc
        return table

    def _is_marked(self, proc: Proc) -> bool:
        key = (proc.pid, proc.start)
        marked = self._marked.get(key)
        if marked is None:
            environ = _read(f"/proc/{proc.pid}/environ")  # None: gone, or not ours to read
            assert self.marker is not None
            # init and the kernel's threads are never a task's (and may have none)
            system = proc.pid in (1, KTHREADD) or proc.ppid == KTHREADD
            if environ == b"" and not proc.zombie and not system:
                self.unsure.add(proc.pid)  # an exec under way, maybe: not cached
                return False
            marked = self._marked[key] = environ is not None and self.marker in b"\0" + environ
        return marked


def _read(path: str) -> bytes | None:
    """A /proc file's bytes (os calls: a third of ``open``'s cost); None if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = b""
        while part := os.read(fd, 65536):
            data += part
        return data
    except OSError:
        return None
    finally:
        os.close(fd)


def is_running(pid: int, start: int) -> bool:
    """Whether ``pid`` is the live process that started at ``start`` (ticks since boot)."""
    proc = read_proc(pid)
    return proc is not None and proc.start == start and not proc.zombie


def _ancestors() -> set[int]:
    """This process and its ancestors: never killed, even if they carry the marker."""
    spare = {0, 1}
    pid = os.getpid()
    while pid > 1 and pid not in spare:
        spare.add(pid)
        proc = read_proc(pid)
        pid = proc.ppid if proc is not None else 0
    return spare


def kill_leftovers(
    records: Iterable[Record], marker: bytes | None, since: int = 0, wait: float = GONE_WAIT_S
) -> int:
    """Kill every process of the recorded tasks, and every process started at ``since``
    or later (ticks since boot) with ``marker`` in its environment; how many there were.
    Waits up to ``wait`` seconds for them to be gone."""
    records = list(records)
    spare = _ancestors()
    scan = ProcessScan(marker, since)
    stopped: set[int] = set()
    for _ in range(FIND_PASSES):
        new = doomed(records, scan.table(), spare) - stopped
        if not new and not scan.unsure - stopped:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
        if not new:
            time.sleep(UNSURE_PAUSE_S)  # let an exec under way show its environment
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    left = stopped
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if (p := read_proc(pid)) is not None and not p.zombie}
        if left:
            time.sleep(0.005)
    return len(stopped)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def remove_containers(runtime: str, label: str, wait: float = RUNTIME_WAIT_S) -> int:
    """Kill and remove every container of ``runtime`` (one of ``RUNTIMES``) labelled
    ``label`` (``KEY=VALUE``); how many it found. A runtime that is missing, fails or
    does not answer within ``wait`` seconds removes nothing."""
    if runtime not in RUNTIMES:
        raise ValueError(f"container runtime {runtime!r}: expected one of {RUNTIMES}")
    listed = _run_cli([runtime, "ps", "--all", "--quiet", "--filter", f"label={label}"], wait)
    ids = listed.split() if listed is not None else []
    if ids:
        force = ["--force", "--time", "0", "--ignore"] if runtime == "podman" else ["--force"]
        _run_cli([runtime, "rm", *force, *ids], wait)
    return len(ids)


def _run_cli(argv: list[str], wait: float) -> str | None:
    """``argv``'s output, or None if it cannot start, fails or outlives ``wait``."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=wait, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
