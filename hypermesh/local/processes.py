"""Helpers for the local servers' processes: free ports, waiting with a deadline, stopping.

Shared by :mod:`~hypermesh.local.etcd`, :mod:`~hypermesh.local.agents`,
:mod:`~hypermesh.local.s3server` and the tests; they import this module, never each other
for these helpers.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

_PORTS_FLOOR = 10_000  # below this, well-known services live (and root-only ports)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range.

    Servers that the tests stop and start again on the same ports (S3, etcd, agents)
    must find them free again: a port from the ephemeral range could meanwhile become
    the local port of any outgoing connection on the machine, and the restart would
    fail to bind. So the port is drawn below that range, where the kernel never hands
    out ports by itself; only where the range leaves no room is the kernel asked.
    """
    low, _ = _ephemeral_range()
    if low - _PORTS_FLOOR >= 1000:
        for _ in range(100):
            port = random.randrange(_PORTS_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT_TRIES = 3  # first starts whose ports another process took between drawing and binding

T = TypeVar("T")


def log_size(path: Path) -> int:
    """How many bytes ``path`` holds now (0 if it does not exist): where to read on from."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def ports_taken(log: Path, offset: int) -> bool:
    """Whether a server's log, from ``offset`` on, says it could not bind a port."""
    with contextlib.suppress(OSError), open(log, "rb") as f:
        f.seek(offset)
        return b"address already in use" in f.read()
    return False


def on_fresh_ports(start: Callable[[], T], logs: Sequence[Path], redraw: Callable[[], None],
                   may_redraw: bool) -> T:
    """``start()`` a server on ports drawn with ``free_port``; when it fails
    (``RuntimeError``) and one of its ``logs`` says, since this try began, that a port was
    taken meanwhile (another process bound it between the draw and the server's bind),
    ``redraw()`` its ports and try again, up to ``PORT_TRIES`` times in all. Only where
    ``may_redraw``: a server that served once keeps its ports, and its restart fails."""
    for tries_left in reversed(range(PORT_TRIES)):
        logged = [(log, log_size(log)) for log in logs]
        try:
            return start()
        except RuntimeError:
            if not (may_redraw and tries_left and any(ports_taken(*at) for at in logged)):
                raise
        redraw()
    raise AssertionError("unreachable")


def wait_for(
    condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> object:
    """Poll ``condition`` until it returns something truthy; TimeoutError names ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def unmount_under(root: Path) -> list[str]:
    """Lazily unmount every FUSE file system mounted at or below ``root`` (data set
    mounts of agents that died without unmounting); returns their mount points."""
    prefix = str(Path(root).resolve())
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3 or not fields[2].startswith("fuse"):
                continue
            point = fields[1].encode().decode("unicode_escape")  # \040 for spaces
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    for point in sorted(found, reverse=True):  # nested mounts first
        subprocess.run(["fusermount3", "-uz", point], check=False, capture_output=True)
    return found


def stop_process(proc: subprocess.Popen[Any], timeout: float, *, group: bool = False
                 ) -> int | None:
    """SIGTERM ``proc`` (and SIGCONT, so that a stopped one sees it), wait up to
    ``timeout`` seconds, then SIGKILL; its exit code (None if even SIGKILL left it running
    for 30 s: a process stuck in the kernel). ``group``: signal its whole process group
    (a process started with ``start_new_session``, and its children).

    The exit is read with ``os.waitpid``, not ``Popen.wait``: a KeyboardInterrupt (Ctrl-C,
    or a SIGTERM handler that raises one) that lands inside ``Popen.poll`` just after it
    took the Popen's lock leaves that lock held for good, and ``Popen.wait`` would then
    never return, so that one interrupted poll (a start's health check, an "is it alive"
    loop) would hang every later stop."""
    send = os.killpg if group else os.kill
    if not _reaped(proc, 0):  # not reaped yet: its pid is still its own to signal
        with contextlib.suppress(ProcessLookupError):
            send(proc.pid, signal.SIGTERM)
            send(proc.pid, signal.SIGCONT)
        if not _reaped(proc, timeout):
            with contextlib.suppress(ProcessLookupError):
                send(proc.pid, signal.SIGKILL)
            _reaped(proc, 30)
    return proc.returncode


def _reaped(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit, and reap it (setting
    ``returncode``); whether it did."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while proc.returncode is None:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            # Reaped already by an interrupted poll that could not record the status:
            # what Popen itself says then.
            proc.returncode = 0
            break
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    return True


def stop_started_under(root: Path, timeout: float) -> list[int]:
    """SIGTERM every live process whose command line names a path under ``root`` (an etcd's
    data directory, an agent's work directory...), other than this one and its parents,
    wait up to ``timeout`` seconds, then
    SIGKILL what is left; their pids. This finds what a start interrupted by a signal left
    unrecorded: a child that ``subprocess.Popen`` had started when the interrupt was raised
    inside it, before it could return the child to anyone."""
    import psutil  # only here: the servers' own helpers need the standard library alone

    prefix = str(Path(root).resolve())
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}  # this process names ROOT itself
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.pid in spared:
            continue
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
            prefix in arg for arg in proc.info["cmdline"] or []
        ):
            found.append(proc)
    stop_processes(found, timeout)
    return [p.pid for p in found]


def stop_processes(procs: list[Any], timeout: float) -> None:
    """SIGTERM each of ``procs`` (psutil processes), wait up to ``timeout`` seconds, then
    SIGKILL what is left and wait for it."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=timeout)
