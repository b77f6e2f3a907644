"""Tasks die with their agent: a journal of its task processes and a watchdog that outlives it.

A task's processes are not the agent's to keep alive once the agent is gone: its claim
goes with the agent's lease and the task runs again elsewhere, so a copy left running
here would run twice. When an agent opens its :class:`Lifeline`:

- the processes earlier agents in the same work directory left running are killed (their
  journals say what they were) and their journals removed;
- it keeps a journal, ``WORK/lifeline/PID.START`` (the agent's pid and start time, in
  ticks since boot): a line ``+ PID STARTED_BY`` when a command process starts and ``- PID``
  when it has been reaped (``leftovers.Record`` says why a start bound rules out a reused
  pid), and ``c RUNTIME`` before its first container of that runtime; rewritten to the
  live entries when it grows long;
- every task's environment carries ``HYPERMESH_LIFELINE=<journal path>``, a marker the
  task's children inherit, also those that leave its session; a container gets it too
  (by name), and the label ``hypermesh.lifeline=<journal path>`` (``containers.py``);
- it starts a watchdog, ``python -m hypermesh.agent.tasks.lifeline JOURNAL``, in a
  session of its own, whose stdin is a pipe only the agent holds open. Whatever ends the
  agent (SIGKILL, the OOM killer, a clean exit) closes the pipe; the watchdog wakes,
  kills every process of the journal's tasks and every marked one
  (``leftovers.kill_leftovers``: the containers' processes among them), then has each
  runtime of the journal remove the containers labelled with it
  (``leftovers.remove_containers``: a container outlives its killed client), removes the
  journal and exits. It ignores SIGINT, SIGTERM and SIGHUP: it lives exactly as long as
  its agent. If it dies first, the agent starts another.

Per task this costs two ``write`` calls and the marker in an environment the agent builds
anyway: no process, no file, no ``fork`` instead of ``vfork``; the watchdog execs a
container runtime only for a journal that names one. What is covered and what not
is said in ``leftovers``; docs/operations.md ("Tasks die with their agent") says why this
and not a cgroup or ``PR_SET_PDEATHSIG``.

One lifeline serves the whole agent process (:data:`ACTIVE`, which the runner reads at
every start); only the agent's event loop uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from hypermesh.agent.tasks.leftovers import (
    GONE_WAIT_S,
    RUNTIMES,
    Record,
    boot_ticks,
    is_running,
    kill_leftovers,
    read_proc,
    remove_containers,
)

log = logging.getLogger("hypermesh.agent")

MARKER = "HYPERMESH_LIFELINE"
"""The environment variable every task process gets: its value is the journal's path."""

CONTAINER_LABEL = "hypermesh.lifeline"
"""The label of every container a task runs in: its value is the journal's path."""

FOLDER = "lifeline"
"""The journals' folder in the work directory."""

COMPACT_LINES = 4096
"""Journal lines after which it is rewritten to its live entries (when they are at most a
quarter of it): a journal stays under a few hundred KiB however many tasks run."""

WATCHDOG_EXIT_S = 10.0
"""How long :meth:`Lifeline.close` waits for the watchdog's clean-up, in seconds."""


class Journal:
    """The agent's record of its running command processes (``+``/``-`` lines, appended).
    Written only by the agent's event loop; read by a watchdog or a later agent only once
    this agent is gone. A write that fails (a full disk) is logged once; the marker still
    finds the tasks."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._live: dict[int, int] = {}
        self._runtimes: list[str] = []  # container runtimes named in the journal
        self._lines = 0
        self._broken = False
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                           0o644)

    def started(self, pid: int) -> None:
        ticks = boot_ticks()
        self._live[pid] = ticks
        self._write(b"+ %d %d\n" % (pid, ticks))

    def container(self, runtime: str) -> None:
        """Note that tasks run containers with ``runtime`` (once per runtime)."""
        if runtime not in self._runtimes:
            self._runtimes.append(runtime)
            self._write(b"c %s\n" % runtime.encode())

    def ended(self, pid: int) -> None:
        if self._live.pop(pid, None) is None:
            return
        self._write(b"- %d\n" % pid)
        if self._lines > COMPACT_LINES and self._lines > 4 * len(self._live):
            self._compact()

    def close(self) -> None:
        """Stop writing (later starts and ends are not recorded)."""
        self._broken = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write(self, line: bytes) -> None:
        if self._broken:
            return
        try:
            os.write(self._fd, line)
            self._lines += 1
        except OSError as exc:
            self._broken = True
            log.warning("lifeline journal %s: %s; tasks are found by their marker alone",
                        self.path, exc)

    def _compact(self) -> None:
        """Replace the journal by its live entries (a rename: a reader sees one or the other)."""
        text = b"".join(b"c %s\n" % runtime.encode() for runtime in self._runtimes)
        text += b"".join(b"+ %d %d\n" % item for item in self._live.items())
        tmp = f"{self.path}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                         0o644)
            os.write(fd, text)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("lifeline journal %s: cannot compact: %s", self.path, exc)
            return
        os.close(self._fd)
        self._fd = fd
        self._lines = len(self._live) + len(self._runtimes)


def read_journal(path: str) -> list[Record]:
    """The processes a journal holds as running; a torn last line is left out."""
    live: dict[int, int] = {}
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return []
    for line in lines[:-1]:  # the part after the last newline is torn or empty
        parts = line.split()
        with contextlib.suppress(ValueError, IndexError):
            if parts[0] == b"+":
                live[int(parts[1])] = int(parts[2])
            elif parts[0] == b"-":
                live.pop(int(parts[1]), None)
    return [Record(pid, started_by) for pid, started_by in live.items()]


def journal_runtimes(path: str) -> list[str]:
    """The container runtimes a journal names (only known ones: the watchdog execs them)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return []
    found = []
    for line in lines[:-1]:
        parts = line.split()
        if len(parts) == 2 and parts[0] == b"c":
            runtime = parts[1].decode(errors="replace")
            if runtime in RUNTIMES and runtime not in found:
                found.append(runtime)
    return found


def marker_entry(journal: str) -> bytes:
    """The environment entry that marks the processes of ``journal``'s tasks."""
    return os.fsencode(f"{MARKER}={journal}")


def agent_of(journal: str) -> tuple[int, int] | None:
    """The pid and start (ticks since boot) of the agent that writes ``journal``."""
    pid, _, start = os.path.basename(journal).partition(".")
    return (int(pid), int(start)) if pid.isdigit() and start.isdigit() else None


def kill_journal(journal: str, wait: float = GONE_WAIT_S) -> tuple[int, int]:
    """Kill what ``journal``'s tasks left running, remove their containers and the
    journal; how many processes were killed and containers removed."""
    agent = agent_of(journal)
    since = 0 if agent is None else agent[1]  # its tasks are no older than it
    # Processes first: a client killed now starts no container after the runtime looked.
    killed = kill_leftovers(read_journal(journal), marker_entry(journal), since, wait)
    removed = sum(remove_containers(runtime, f"{CONTAINER_LABEL}={journal}")
                  for runtime in journal_runtimes(journal))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal)
    return killed, removed


def clean_earlier(folder: str, own: str, decide: Callable[[str], None]) -> int:
    """Kill what earlier agents of this work directory left running (processes, and
    containers: removed); how many processes.
    A journal whose agent still runs (two agents on one work directory) is left alone."""
    total = 0
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        agent = agent_of(path.removesuffix(".tmp"))
        if path == own or agent is None:
            continue
        if is_running(*agent):
            decide(f"agent {agent[0]} still runs in this work directory: its tasks are left alone")
            continue
        if path.endswith(".tmp"):  # a compaction the agent did not finish
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        killed, removed = kill_journal(path)
        if killed:
            decide(f"killed {killed} processes that an earlier agent ({agent[0]}) left running")
        if removed:
            decide(f"removed {removed} containers that an earlier agent ({agent[0]}) left")
        total += killed
    return total


ACTIVE: Lifeline | None = None
"""The lifeline of the agent in this process, if it opened one."""


class Lifeline:
    """An agent's journal and watchdog (see the module's docstring). :meth:`open` makes it
    and makes it :data:`ACTIVE`; :meth:`close` ends it (an agent that simply exits gets the
    same clean-up from its watchdog)."""

    def __init__(self, journal: Journal, decide: Callable[[str], None]) -> None:
        self.journal = journal
        self.marker = journal.path  # the value of MARKER in every task's environment
        self.decide = decide
        self._pipe = -1  # the write end: open while this agent lives
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._pidfd = -1
        self._closed = False

    @classmethod
    def open(cls, work_dir: str | os.PathLike[str], decide: Callable[[str], None]) -> Lifeline:
        """Kill what earlier agents of ``work_dir`` left, start this agent's journal and
        watchdog. ``decide`` gets a line for the decision log when something was killed."""
        global ACTIVE
        folder = os.path.join(os.path.abspath(work_dir), FOLDER)
        os.makedirs(folder, exist_ok=True)
        me = read_proc(os.getpid())
        assert me is not None
        own = os.path.join(folder, f"{me.pid}.{me.start}")
        clean_earlier(folder, own, decide)
        line = cls(Journal(own), decide)
        line._start_watchdog()
        ACTIVE = line
        return line

    def close(self, wait: float = WATCHDOG_EXIT_S) -> None:
        """Let go: the watchdog kills what still runs and removes the journal."""
        global ACTIVE
        if ACTIVE is self:
            ACTIVE = None
        self._closed = True
        self._stop_watching()
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        self.journal.close()
        if self._watchdog is not None:
            try:
                self._watchdog.wait(wait)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
                self._watchdog.wait()

    def _start_watchdog(self) -> None:
        if self._pipe >= 0:
            os.close(self._pipe)  # a dead watchdog's pipe
        read_end, self._pipe = os.pipe()  # both close on exec: only the watchdog gets one
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", __name__, self.journal.path],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            os.close(read_end)
        self._watch_watchdog()

    def _watch_watchdog(self) -> None:
        """Start another watchdog if this one dies while the agent lives (where the event
        loop runs and the kernel has pidfds)."""
        try:
            loop = asyncio.get_running_loop()
            assert self._watchdog is not None
            self._pidfd = os.pidfd_open(self._watchdog.pid)
        except (RuntimeError, AttributeError, OSError):
            return
        loop.add_reader(self._pidfd, self._watchdog_died)

    def _stop_watching(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def _watchdog_died(self) -> None:
        self._stop_watching()
        assert self._watchdog is not None
        code = self._watchdog.wait()
        if self._closed:
            return
        self.decide(f"lifeline watchdog {self._watchdog.pid} exited ({code}); starting another")
        self._start_watchdog()


def watch(journal: str) -> int:
    """The watchdog: wait until the agent is gone (stdin at its end), then kill what its
    tasks left and remove the journal."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
    killed, removed = kill_journal(journal)
    if killed or removed:
        print(f"hypermesh lifeline: the agent of {journal} is gone; killed {killed} processes "
              f"and removed {removed} containers of its tasks", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(watch(sys.argv[1]))
