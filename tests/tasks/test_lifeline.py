"""Tasks die with their agent (agent/tasks/lifeline.py, agent/tasks/leftovers.py).

The choice of what to kill is a pure function tested on tables; the rest runs real
processes: real agents with real etcd, SIGKILLed while a task's tree runs, and a restarted
agent in the same work directory. Waits have deadlines; every process a test starts is
killed at its end, passed or failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hypermesh.agent.tasks import leftovers, lifeline
from hypermesh.agent.tasks.leftovers import (
    Proc,
    Record,
    boot_ticks,
    doomed,
    kill_leftovers,
    read_proc,
)
from hypermesh.agent.tasks.lifeline import Journal, marker_entry, read_journal
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone, task_pid

DEADLINE = 5.0  # seconds the processes of a dead agent's tasks may outlive it (loaded CI)

# A task whose shell has three children, one of them in a session of its own.
TREE = 'echo $$ > "$HM_ATTEMPT_DIR/pid"; sleep 300 & setsid sleep 300 & sleep 300; wait'


# ---------------------------------------------------------------- what is doomed (pure)
def table(*procs: Proc) -> dict[int, Proc]:
    return {p.pid: p for p in procs}


AGENT_TREE = table(
    Proc(100, 1, 100, start=50),  # a recorded command (session leader)
    Proc(101, 100, 100, start=60),  # its child, same session
    Proc(102, 100, 102, start=61),  # its child that left the session (setsid)
    Proc(103, 102, 102, start=62),  # and that one's child
    Proc(200, 1, 100, start=70),  # an orphan still in the recorded session
    Proc(300, 1, 300, start=80, marked=True),  # an orphan in a session of its own, marked
    Proc(400, 1, 400, start=90),  # someone else's
    Proc(401, 400, 400, start=91),
    Proc(500, 1, 500, start=95, zombie=True, marked=True),  # dead already
)


@pytest.mark.parametrize(
    ("records", "procs", "spare", "expected"),
    [
        # the recorded leader alive: its session, its descendants, the marked ones
        ([Record(100, 55)], AGENT_TREE, set(), {100, 101, 102, 103, 200, 300}),
        # started after the record: pid 100 is another process's now (its session too)
        ([Record(100, 40)], AGENT_TREE, set(), {300}),
        # the leader is gone: what is left of its session, and their descendants
        ([Record(100, 55)], {k: v for k, v in AGENT_TREE.items() if k != 100}, set(),
         {101, 200, 300}),
        # a record of nothing, and nothing marked
        ([Record(999, 10)], table(Proc(400, 1, 400, 90)), set(), set()),
        # the caller and its ancestors are never doomed
        ([Record(100, 55)], AGENT_TREE, {101, 200}, {100, 102, 103, 300}),
        # no records: the marked ones and their descendants only
        ([], table(Proc(7, 1, 7, 5, marked=True), Proc(8, 7, 8, 6)), set(), {7, 8}),
    ],
    ids=["leader-alive", "pid-reused", "leader-gone", "nothing", "spared", "marker-only"],
)
def test_what_is_doomed(
    records: list[Record], procs: dict[int, Proc], spare: set[int], expected: set[int]
) -> None:
    assert doomed(records, procs, spare) == expected


# ---------------------------------------------------------------- the journal
def test_journal_reads_back_the_live_processes_and_ignores_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal = Journal(str(path))
    journal.started(10)
    journal.started(11)
    journal.ended(10)
    journal.ended(99)  # never started here: no line
    journal.close()
    with open(path, "ab") as f:
        f.write(b"+ 12 3")  # the agent died in the middle of a line
    (record,) = read_journal(str(path))
    assert record.pid == 11 and 0 < record.started_by <= boot_ticks()
    assert path.read_bytes().count(b"\n") == 3


def test_journal_is_rewritten_to_its_live_entries_when_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifeline, "COMPACT_LINES", 20)
    path = tmp_path / "journal"
    journal = Journal(str(path))
    journal.started(1)
    for pid in range(100, 200):
        journal.started(pid)
        journal.ended(pid)
    journal.started(2)
    journal.close()
    assert {r.pid for r in read_journal(str(path))} == {1, 2}
    assert path.read_bytes().count(b"\n") <= 21


# ---------------------------------------------------------------- real processes
@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Pids the test started: whatever is left of them is killed at its end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int, count: int) -> list[psutil.Process]:
    """``pid`` and its descendants, once there are ``count`` of them in all."""

    def found() -> list[psutil.Process] | None:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        return procs if len(procs) >= count else None

    return wait_for(found, DEADLINE, f"{count} processes under {pid}", interval=0.02)  # type: ignore[return-value]


def all_gone(procs: list[psutil.Process]) -> bool:
    return all(process_gone(p.pid) for p in procs)


def test_leftovers_are_found_by_session_descent_and_marker_and_a_reused_pid_is_spared(
    tmp_path: Path, reaper: list[int]
) -> None:
    marker = marker_entry(str(tmp_path / "journal"))
    name, _, value = os.fsdecode(marker).partition("=")
    # A recorded command and its tree (one child in a session of its own).
    tree = subprocess.Popen(["/bin/bash", "-c", "sleep 300 & setsid sleep 300 & sleep 300; wait"],
                            start_new_session=True)
    reaper.append(tree.pid)
    recorded = Record(tree.pid, boot_ticks())
    tree_procs = descendants(tree.pid, 4)
    reaper.extend(p.pid for p in tree_procs)
    # A marked process that left the session and lost its parent.
    pid_file = tmp_path / "orphan"
    subprocess.run(["/bin/bash", "-c", f"setsid sleep 300 & echo $! > {pid_file}"],
                   env=dict(os.environ, **{name: value}), check=True, start_new_session=True)
    orphan = int(pid_file.read_text())
    reaper.append(orphan)
    # A process whose pid a record names, started after the record: a reused number.
    before = boot_ticks() - 1
    innocent = subprocess.Popen(["sleep", "300"], start_new_session=True)
    reaper.append(innocent.pid)
    try:
        killed = kill_leftovers([recorded, Record(innocent.pid, before)], marker, wait=DEADLINE)
        tree.wait(DEADLINE)
        assert all_gone(tree_procs) and process_gone(orphan)
        assert killed == len(tree_procs) + 1
        assert innocent.poll() is None
    finally:
        innocent.kill()
        innocent.wait()


def test_a_marked_process_caught_in_the_middle_of_an_exec_is_still_killed(
    tmp_path: Path, reaper: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a process execs, the kernel shows its new program's environment only once
    it is set up: read then, a marked process (one whose parent has just exited, say)
    looks unmarked. The first read of its environment is made empty here, as that
    window would; it must be read again, and the process killed. A process that has
    no environment at all is read again too, and spared."""
    marker = marker_entry(str(tmp_path / "journal"))
    name, _, value = os.fsdecode(marker).partition("=")
    marked = subprocess.Popen(["sleep", "300"], env={name: value}, start_new_session=True)
    bare = subprocess.Popen(["sleep", "300"], env={}, start_new_session=True)
    reaper.extend([marked.pid, bare.pid])
    wait_for(lambda: all(psutil.Process(p.pid).name() == "sleep" for p in (marked, bare)),
             DEADLINE, "both processes to run sleep")
    assert read_proc_environ(marked.pid) == marker + b"\0"
    assert read_proc_environ(bare.pid) == b""
    real_read = leftovers._read
    reads: list[int] = []

    def in_exec_once(path: str) -> bytes | None:
        if path == f"/proc/{marked.pid}/environ":
            reads.append(marked.pid)
            if len(reads) == 1:
                return b""  # the first look falls in the exec's window
        return real_read(path)

    monkeypatch.setattr(leftovers, "_read", in_exec_once)
    try:
        assert kill_leftovers([], marker, wait=DEADLINE) == 1
        assert marked.wait(DEADLINE) == -signal.SIGKILL and len(reads) >= 2
        assert bare.poll() is None  # no environment: read again, never marked
    finally:
        for proc in (marked, bare):
            proc.kill()
            proc.wait()


def read_proc_environ(pid: int) -> bytes | None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()
    return None


def watchdogs(agent: AgentProcess) -> list[psutil.Process]:
    """The agent's live lifeline watchdogs (its children that run the module)."""
    assert agent.proc is not None
    found = []
    for child in psutil.Process(agent.proc.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            if "hypermesh.agent.tasks.lifeline" in child.cmdline() and not process_gone(child.pid):
                found.append(child)
    return found


def watchdog_of(agent: AgentProcess, other_than: int = 0) -> psutil.Process:
    """The agent's one watchdog (one that is not ``other_than``), once it runs."""

    def one() -> psutil.Process | None:
        dogs = [d for d in watchdogs(agent) if d.pid != other_than]
        return dogs[0] if len(dogs) == 1 else None

    return wait_for(one, DEADLINE, f"agent {agent.name}'s watchdog")  # type: ignore[return-value]


@contextlib.contextmanager
def tree_task(mesh: Mesh, agent: AgentProcess) -> Iterator[list[psutil.Process]]:
    """Submit one task that runs TREE; its four processes once they all run, killed (if
    they are not gone) when the block ends."""
    wid = mesh.submit(mesh.write_recipe(f"experiments:\n  tree:\n    command: [{TREE!r}]\n"))
    procs = descendants(task_pid(agent, f"{wid}.tree.0"), 4)
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def kill_agent(agent: AgentProcess, procs: list[psutil.Process]) -> float:
    """SIGKILL the agent (no drain); seconds until every one of ``procs`` is gone."""
    killed_at = time.monotonic()
    agent.kill()
    wait_for(lambda: all_gone(procs), DEADLINE, "the task's processes to die with the agent",
             interval=0.01)
    return time.monotonic() - killed_at


def test_sigkill_of_the_agent_takes_its_tasks_whole_trees(mesh: Mesh) -> None:
    agent = mesh.agent("node1")
    with tree_task(mesh, agent) as procs:
        print(f"last task process gone {kill_agent(agent, procs):.3f}s after the SIGKILL")
        lifeline_dir = agent.work_dir / "lifeline"
        wait_for(lambda: not any(lifeline_dir.iterdir()), DEADLINE, "the journal removed")


def test_a_restarted_agent_kills_what_an_earlier_one_left(mesh: Mesh) -> None:
    agent = mesh.agent("node1")
    with tree_task(mesh, agent) as procs:
        assert agent.proc is not None
        journal = next((agent.work_dir / "lifeline").iterdir())
        # The agent and its watchdog die together (as an OOM kill of both would):
        # nothing cleans up when they go.
        os.kill(agent.proc.pid, signal.SIGSTOP)
        dog = watchdog_of(agent)
        dog.kill()
        wait_for(lambda: process_gone(dog.pid), DEADLINE, "the watchdog to die")
        agent.kill()
        assert not any(process_gone(p.pid) for p in procs)  # left running
        assert read_journal(str(journal))

        again = mesh.agent("node1")  # the same work directory
        wait_for(lambda: all_gone(procs), DEADLINE, "the leftovers to be killed", interval=0.01)
        assert not journal.exists()
        assert "killed 4 processes that an earlier agent" in again.log_tail(100_000)
        assert [d.pid for d in watchdogs(again)] == [watchdog_of(again).pid]


def test_a_dead_watchdog_is_replaced_while_the_agent_lives(mesh: Mesh) -> None:
    agent = mesh.agent("node1")
    first = watchdog_of(agent)
    first.kill()
    watchdog_of(agent, other_than=first.pid)
    assert "starting another" in agent.log_tail(100_000)
    with tree_task(mesh, agent) as procs:
        kill_agent(agent, procs)


def test_read_proc_sees_this_process() -> None:
    me = read_proc(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.sid == os.getsid(0)
