"""``stop_process``: the local servers' and agents' stop, also after an interrupted poll."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from hypermesh.local.processes import stop_process

IGNORES_TERM = ("import signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\n"
                "time.sleep(600)\n")


def _stopped_within(proc: subprocess.Popen[str], timeout: float, seconds: float) -> list[object]:
    """stop_process(proc, timeout) in a thread, joined for ``seconds``; what it returned
    (empty if it had not returned by then)."""
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(stop_process(proc, timeout)),
                              daemon=True)
    worker.start()
    worker.join(seconds)
    return got


def test_a_process_that_exits_on_sigterm_gives_its_exit_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
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
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert proc._waitpid_lock.acquire(False)
    try:
        assert proc.poll() is None  # what every later poll says: "still running"
        assert _stopped_within(proc, 10, 20) == [-signal.SIGTERM]
    finally:
        if proc.returncode is None:
            proc.kill()
        proc._waitpid_lock.release()
    assert proc.poll() == -signal.SIGTERM
