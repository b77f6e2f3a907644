"""Helpers for the local servers' processes: free ports, waiting with a deadline, stopping.

Shared by :mod:`~hypermesh.local.etcd`, :mod:`~hypermesh.local.agents`,
:mod:`~hypermesh.local.s3server` and the tests; they import this module, never each other
for these helpers.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM ``proc``, wait up to ``timeout`` seconds, then SIGKILL; its exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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
