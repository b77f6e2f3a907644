"""``stop_process``: the local servers' and agents' stop, also after an interrupted poll."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

from hypermesh.local.processes import stop_process, wait_for

WAITS = "import signal; signal.pause()"  # until a signal ends it: no timer of its own
IGNORES_TERM = ("import signal\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\n"
                "signal.pause()\n")


def _stopped_within(proc: subprocess.Popen[str], timeout: float, seconds: float,
                    group: bool = False) -> list[object]:
    """stop_process(proc, timeout) in a thread, joined for ``seconds``; what it returned
    (empty if it had not returned by then)."""
    got: list[object] = []
    worker = threading.Thread(
        target=lambda: got.append(stop_process(proc, timeout, group=group)), daemon=True)
    worker.start()
    worker.join(seconds)
    return got


def test_a_process_that_exits_on_sigterm_gives_its_exit_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", WAITS])
    assert _stopped_within(proc, 10, 20) == [-signal.SIGTERM]
    assert proc.poll() == -signal.SIGTERM


def test_one_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    assert _stopped_within(proc, 0.5, 20) == [-signal.SIGKILL]


def test_a_poll_interrupted_while_it_held_the_popen_lock_does_not_hang_the_stop() -> None:
    # A KeyboardInterrupt (Ctrl-C, or local_mesh.py's SIGTERM) raised inside Popen.poll
    # just after it took its lock leaves the lock held: here it is taken by hand.
    # Popen.wait would then never return; the local mesh once hung so on SIGTERM.
    proc = subprocess.Popen([sys.executable, "-c", WAITS])
    assert proc._waitpid_lock.acquire(False)
    try:
        assert proc.poll() is None  # what every later poll says: "still running"
        assert _stopped_within(proc, 10, 20) == [-signal.SIGTERM]
    finally:
        if proc.returncode is None:
            proc.kill()
        proc._waitpid_lock.release()
    assert proc.poll() == -signal.SIGTERM


def test_a_child_reaped_behind_the_popens_back_stops_at_once() -> None:
    # An interrupt after Popen.poll's waitpid but before it recorded the status: the
    # child is reaped and its status lost. Popen itself then says 0.
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitpid(proc.pid, 0)
    assert _stopped_within(proc, 10, 5) == [0]


def test_a_stopped_process_group_is_stopped_whole() -> None:
    # A server started in a session of its own, paused (as the "store went away" tests
    # pause S3), with a child of its own: all of it ends.
    child_code = "import os, signal; print(os.getpid(), flush=True); signal.pause()"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, subprocess, sys\n"
         f"subprocess.Popen([sys.executable, '-c', {child_code!r}])\n"
         "signal.pause()\n"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())  # the child's own word: it runs
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        assert _stopped_within(proc, 10, 20, group=True) == [-signal.SIGTERM]
        wait_for(lambda: not _alive(child), 10, "the server's child to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

