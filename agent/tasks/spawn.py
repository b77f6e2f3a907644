"""Starting a task's process with less work in the agent than ``subprocess.Popen``.

A trivial task costs its node more in the agent's own process start than in the
task: ``Popen`` spends most of its ~135 µs of parent CPU per process in Python
(encoding ~50 environment variables one by one, searching ``PATH`` through
``os.get_exec_path`` and its warnings filter, building its own bookkeeping) and
only a tenth in the fork and exec themselves. ``spawn`` makes the same call that
``Popen`` ends in, ``_posixsubprocess.fork_exec`` (vfork then exec where the kernel
allows, as ``Popen`` does), with the environment entries and ``PATH`` candidates
memoized, because the tasks of an experiment share nearly all of them: about half
the parent CPU per process (measured in ``docs/benchmarks.md``).

``fork_exec`` is CPython's private function (``multiprocessing`` calls it too), and
its arguments change between Python versions, so ``spawn`` uses it only on the
versions whose signature it knows (``_FAST``) and ``Popen`` everywhere else. Both
give the same child: its own session (``setsid``), stdin, stdout and stderr on the
given descriptors, every other descriptor closed, signals the interpreter ignores
restored to their defaults, the working folder and the environment given. A
command that cannot start raises the same ``OSError`` as ``Popen`` (file name, errno).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import _posixsubprocess
except ImportError:  # not a POSIX CPython
    _posixsubprocess = None  # type: ignore[assignment]

_FAST = _posixsubprocess is not None and (3, 11) <= sys.version_info[:2] <= (3, 13)
"""Python versions whose ``fork_exec`` takes the 23 arguments ``spawn`` passes (3.14
dropped ``allow_vfork``). Cleared if a call is refused for its arguments."""

_USE_VFORK: bool = getattr(subprocess, "_USE_VFORK", True)

_ERRPIPE_MAX = 50_000


class Child:
    """A process ``spawn`` started: what the agent needs of a ``Popen``. Only the owner
    of the process calls ``wait`` (after its pidfd said it exited)."""

    __slots__ = ("pid", "returncode")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def wait(self) -> int:
        """Reap the process (blocks until it exits); its exit code, ``-SIGNAL`` if a
        signal ended it, as ``Popen.wait`` gives."""
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = 0
            else:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def spawn(
    argv: Sequence[str], *, cwd: str, env: Mapping[str, str], stdin: int, stdout: int
) -> Child | subprocess.Popen[bytes]:
    """Start ``argv`` (``argv[0]`` searched on the ``PATH`` of ``env``) in a new
    session, in ``cwd``, with exactly ``env``; stdin from ``stdin``, stdout and stderr
    both to ``stdout``."""
    if _FAST:
        try:
            return _fork_exec(argv, cwd, env, stdin, stdout)
        except _Unsupported:
            _use_popen()
    return subprocess.Popen(
        list(argv), stdin=stdin, stdout=stdout, stderr=subprocess.STDOUT, cwd=cwd, env=env,
        start_new_session=True,
    )


class _Unsupported(Exception):
    """``fork_exec`` refused its arguments (before any fork): not the expected Python."""


def _use_popen() -> None:
    global _FAST
    _FAST = False


def _fork_exec(
    argv: Sequence[str], cwd: str, env: Mapping[str, str], stdin: int, stdout: int
) -> Child:
    entries = _ENV_ENTRIES
    if len(entries) > _ENV_ENTRIES_MAX:
        entries.clear()
    env_list = [entries.get(item) or _env_entry(item) for item in env.items()]
    executables = _executables(argv[0], env.get("PATH"))
    errpipe_read, errpipe_write = os.pipe()
    to_close = []
    while errpipe_write < 3:  # fork_exec moves descriptors 0-2 into place: stay clear
        to_close.append(errpipe_write)
        errpipe_write = os.dup(errpipe_write)
    for fd in to_close:
        os.close(fd)
    try:
        try:
            pid = _call_fork_exec(
                list(argv), executables, errpipe_read, errpipe_write, cwd, env_list, stdin, stdout
            )
        finally:
            os.close(errpipe_write)
        failure = _read_all(errpipe_read)
    finally:
        os.close(errpipe_read)
    if failure:
        _reap_quietly(pid)
        raise _child_error(failure, argv[0], cwd)
    return Child(pid)


def _call_fork_exec(
    args: list[str],
    executables: tuple[bytes, ...],
    errpipe_read: int,
    errpipe_write: int,
    cwd: str,
    env_list: list[bytes],
    stdin: int,
    stdout: int,
) -> int:
    try:
        return _posixsubprocess.fork_exec(
            args, executables,
            True, (errpipe_write,),  # close every other descriptor
            cwd, env_list,
            stdin, -1, -1, stdout, -1, stdout,  # stdin; stdout; stderr to stdout
            errpipe_read, errpipe_write,
            True, True, -1,  # restore signals; new session; no process group
            None, None, None, -1,  # gid, groups, uid, umask unchanged
            None, _USE_VFORK,  # type: ignore[arg-type]  # no preexec function (stub says callable)
        )
    except TypeError as e:
        raise _Unsupported(str(e)) from e


_ENV_ENTRIES: dict[tuple[str, str], bytes] = {}
"""``NAME=value`` as ``execve`` wants it, by (name, value): one dictionary lookup per
variable for the next task of the same experiment."""

_ENV_ENTRIES_MAX = 8192


def _env_entry(item: tuple[str, str]) -> bytes:
    key, value = item
    name = os.fsencode(key)
    if b"=" in name:
        raise ValueError(f"illegal environment variable name {key!r}")
    _ENV_ENTRIES[item] = entry = name + b"=" + os.fsencode(value)
    return entry


@functools.lru_cache(maxsize=256)
def _executables(program: str, path: str | None) -> tuple[bytes, ...]:
    """Where the child tries to exec ``program``, in order, as ``Popen`` lists them:
    the name itself if it has a folder, else each folder of ``path`` (``os.defpath``
    when the environment has no ``PATH``)."""
    name = os.fsencode(program)
    if os.path.dirname(name):
        return (name,)
    folders = (path if path is not None else os.defpath).split(os.pathsep)
    return tuple(os.path.join(os.fsencode(folder), name) for folder in folders)


def _read_all(fd: int) -> bytes:
    """What the child wrote on the error pipe before exec (nothing when exec worked)."""
    data = bytearray()
    while len(data) <= _ERRPIPE_MAX:
        part = os.read(fd, _ERRPIPE_MAX)
        if not part:
            break
        data += part
    return bytes(data)


def _reap_quietly(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _child_error(report: bytes, program: str, cwd: str) -> Exception:
    """The exception ``Popen`` raises for the child's ``NAME:HEX_ERRNO:MESSAGE`` report."""
    try:
        name, hex_errno, message = report.split(b":", 2)
        errno_num = int(hex_errno, 16)
    except ValueError:
        return subprocess.SubprocessError(f"bad exception data from child: {report!r}")
    if name != b"OSError":
        return subprocess.SubprocessError(message.decode(errors="replace"))
    text = message.decode(errors="replace")
    filename: Any = cwd if text == "noexec" else program  # noexec: chdir failed
    if errno_num != 0:
        text = os.strerror(errno_num)
    return OSError(errno_num, text, filename)
